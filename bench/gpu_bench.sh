#!/usr/bin/env bash
# Issue 33's table in one run: ctitan against PyTorch eager and torch.compile (bench/eager_llama.py,
# the same PyTorch, each block compiled as torchtitan's compile.enable does), bf16 mixed precision for
# all, on one GPU, shape by shape, each ctitan / reference trio one after the other:
#   8B_8L   the Llama 3 8B shape with 8 of its 32 layers, seq 8192, batch 1
#   8B_16L  the same with 16 layers (needs ~95 GiB: an H200, not an H100)
#   150M    dim 1024, 12 layers, 16 heads, 8 kv heads, vocabulary 8192, seq 2048, batch 8
# MFU by torchtitan's formula: (6 · non-embedding parameters + 12 · layers · heads · head_dim · seq)
# FLOPs per token, against 989.5 TFLOP/s (the H100/H200 dense bf16 datasheet; CTITAN_PEAK_TFLOPS
# sets another). Prints a Markdown table; a run that fails (out of memory) is a row saying so.
#
#   TRAIN=build-gpu/train bench/gpu_bench.sh [OUT_DIR]     # on the GPU machine (gpu_check.sh (d))
#   CTITAN_BENCH_SHAPES="8B_8L 150M" ...                   # some shapes
#   CTITAN_BENCH_COMPILE=0 ...                             # no torch.compile column
#   CTITAN_BENCH_VARIANTS="sdpa_flash sdpa_cudnn" ...     # more ctitan rows per shape, each with
#       one setting changed (sdpa_<backend>: model.sdpa_backend <backend>; own_kernels:
#       CTITAN_GPU_KERNELS=ctitan, ctitan's own SwiGLU, RoPE, cross-entropy and AdamW kernels;
#       cuda_graphs: training.cuda_graphs, the step captured at step 3 and replayed; graphs_own_kernels:
#       both), against the same eager and compile numbers
# ctitan runs 12 steps: tokens/s and memory are the log line of step 10 (steps 6-10); step 12 is
# recorded by the profiler, and its summary (scripts/profile_summary.py: the ops, and on a GPU
# the kernels and how busy the GPU was) goes to OUT_DIR/<shape>.<variant>.profile.txt. The
# references profile one step after their timed ones (eager_llama.py --profile): their summaries
# go to OUT_DIR/<shape>.eager.profile.txt and <shape>.compile.profile.txt.
#   CTITAN_BENCH_DEVICE=cpu CTITAN_BENCH_SHAPES=tiny CTITAN_BENCH_COMPILE=0 bench/gpu_bench.sh
#       # the pipeline on a CPU with a debug-sized shape (tests/test_launchers' smoke run): the
#       # numbers mean nothing there, the table's arithmetic and the runs are what it checks.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
TRAIN="${TRAIN:-$CTITAN_BUILD_DIR/train}"
OUT="${1:-outputs/gpu_bench}"
# The venv's PyTorch here, the image's python3 on the GPU machine (no venv there).
PY="${PY:-}"
if [[ -z $PY ]]; then
  if [[ -x "$CTITAN_VENV/bin/python" ]]; then PY="$CTITAN_VENV/bin/python"; else PY=python3; fi
fi
DEVICE="${CTITAN_BENCH_DEVICE:-cuda}"
SHAPES="${CTITAN_BENCH_SHAPES:-8B_8L 8B_16L 150M}"
COMPILE="${CTITAN_BENCH_COMPILE:-1}"
VARIANTS="${CTITAN_BENCH_VARIANTS:-}"
PEAK="${CTITAN_PEAK_TFLOPS:-989.5}"
TOKENIZER="${CTITAN_BENCH_TOKENIZER:-$CTITAN_DATA_DIR/tokenizers/moby_dick_8192.model}"
mkdir -p "$OUT"
log() { echo "[gpu_bench] $*" >&2; }

# shape → "flavor seq batch | eager_llama.py's model arguments"
shape_args() {
  case $1 in
    8B_*L) echo "$1 8192 1 | --dim 4096 --layers ${1:3:-1} --heads 32 --kv-heads 8 --ffn-hidden 14336 --vocab 128256" ;;
    150M) echo "150M 2048 8 | --dim 1024 --layers 12 --heads 16 --kv-heads 8 --vocab 8192" ;;
    tiny) echo "debugmodel 64 2 | --dim 256 --layers 6 --heads 16 --kv-heads 16 --vocab 2048" ;;
    *) return 1 ;;
  esac
}

rows=()
for shape in $SHAPES; do
  spec=$(shape_args "$shape") || { log "unknown shape $shape"; exit 2; }
  read -r flavor seq batch <<<"${spec%%|*}"
  read -r -a model_args <<<"${spec#*|}"
  tok="$TOKENIZER"
  [[ $shape == tiny ]] && tok="$CTITAN_DEFAULT_TOKENIZER"
  envs=()
  [[ $DEVICE == cpu ]] && envs=(CUDA_VISIBLE_DEVICES=)
  for variant in ctitan $VARIANTS; do
    extra=()
    run_env=("${envs[@]}")
    case $variant in
      ctitan) ;;
      sdpa_*) extra=(--model.sdpa_backend "${variant#sdpa_}") ;;
      own_kernels) run_env+=(CTITAN_GPU_KERNELS=ctitan) ;;
      cuda_graphs) extra=(--training.cuda_graphs true) ;;
      graphs_own_kernels) run_env+=(CTITAN_GPU_KERNELS=ctitan) extra=(--training.cuda_graphs true) ;;
      *) log "unknown variant $variant"; exit 2 ;;
    esac
    log "$shape: $variant ($flavor, seq $seq, batch $batch)"
    rm -rf "${OUT:?}/$shape.$variant"
    env "${run_env[@]}" "$TRAIN" --job.config_file train_configs/debug_model.toml --model.flavor "$flavor" \
      --model.tokenizer_path "$tok" --training.local_batch_size "$batch" --training.seq_len "$seq" \
      --training.steps 12 --metrics.log_freq 5 --debug.seed 42 --metrics.enable_tensorboard false \
      --activation_checkpoint.mode none --training.mixed_precision_param bfloat16 \
      --profiling.enable_profiling true --profiling.profile_freq 12 \
      "${extra[@]}" --job.dump_folder "$OUT/$shape.$variant" >"$OUT/$shape.$variant.log" 2>&1 ||
      log "$shape: $variant failed: $(tail -1 "$OUT/$shape.$variant.log")"
    trace="$OUT/$shape.$variant/profile_traces/iteration_12/rank0_trace.json"
    [[ -s $trace ]] && "$PY" scripts/profile_summary.py "$trace" 30 >"$OUT/$shape.$variant.profile.txt" 2>&1
    grep -m1 "attention:" "$OUT/$shape.$variant.log" >&2
  done
  for ref in eager compile; do
    rm -f "$OUT/$shape.$ref.json"
    [[ $ref == compile && $COMPILE == 0 ]] && continue
    flags=()
    [[ $ref == compile ]] && flags=(--compile)
    log "$shape: PyTorch $ref"
    rm -f "$OUT/$shape.$ref.trace.json" "$OUT/$shape.$ref.profile.txt"
    "$PY" bench/eager_llama.py --device "$DEVICE" "${model_args[@]}" --seq "$seq" --batch "$batch" --steps 5 \
      --warmup 2 --dtype bf16 "${flags[@]}" --profile "$OUT/$shape.$ref.trace.json" >"$OUT/$shape.$ref.json" \
      2>"$OUT/$shape.$ref.log" || log "$shape: $ref failed: $(tail -1 "$OUT/$shape.$ref.log")"
    # The reference's step profiled as ctitan's is: the kernels side by side say where a gap is.
    [[ -s "$OUT/$shape.$ref.trace.json" ]] &&
      "$PY" scripts/profile_summary.py "$OUT/$shape.$ref.trace.json" 30 >"$OUT/$shape.$ref.profile.txt" 2>&1
  done
  rows+=("$shape $seq $batch $VARIANTS | ${model_args[*]}")
done

"$PY" - "$OUT" "$PEAK" "${rows[@]}" <<'EOF'
import json, os, sys

out, peak = sys.argv[1], float(sys.argv[2]) * 1e12


def ffn_hidden(dim, multiple_of=256):  # torchtitan's width when none is given
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def flops_per_token(a, seq):  # torchtitan's get_num_flop_per_token
    dim, layers, heads, kv = a["--dim"], a["--layers"], a["--heads"], a["--kv-heads"]
    hd, ffn, vocab = dim // heads, a.get("--ffn-hidden") or ffn_hidden(dim), a["--vocab"]
    per_layer = dim * heads * hd * 2 + dim * kv * hd * 2 + 3 * dim * ffn + 2 * dim
    non_embedding = layers * per_layer + dim + dim * vocab  # the output projection counts
    return 6 * non_embedding + 12 * layers * heads * hd * seq


def ctitan(shape, variant="ctitan"):  # the log line of step 10: steps 6-10, before the profiled step
    path = os.path.join(out, f"{shape}.{variant}", "metrics.jsonl")
    rows = [json.loads(l) for l in open(path) if '"tps"' in l] if os.path.exists(path) else []
    rows = [r for r in rows if r.get("step") == 10]
    return rows[-1] if rows else None


def ref(shape, kind):
    path = os.path.join(out, f"{shape}.{kind}.json")
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None


def cell(x, fmt):
    return fmt.format(x) if x is not None else "—"


torch_version = None
print("| shape | ctitan tok/s | eager | ctitan ÷ eager | compile | ctitan ÷ compile "
      "| MFU ctitan / eager / compile | peak GiB ctitan / eager / compile |")
print("|---|---:|---:|---:|---:|---:|---|---|")
for row in sys.argv[3:]:
    head, margs = row.split("|")
    shape, seq, batch, *variants = head.split()
    margs = margs.split()
    a = {margs[i]: int(margs[i + 1]) for i in range(0, len(margs), 2)}
    fpt = flops_per_token(a, int(seq))
    e, k = ref(shape, "eager"), ref(shape, "compile")
    torch_version = torch_version or (e or k or {}).get("torch")
    for variant in ["ctitan"] + variants:
        c = ctitan(shape, variant)
        tps = [c["tps"] if c else None, e["tokens_per_s"] if e else None, k["tokens_per_s"] if k else None]
        mfu = ["—" if t is None else f"{100 * t * fpt / peak:.1f}%" for t in tps]
        mem = [c["memory_gib"] if c else None] + [
            (r.get("peak_gpu_reserved_gib", r.get("peak_rss_gib")) if r else None) for r in (e, k)]
        ratio = lambda x, y: f"{x / y:.2f}×" if x and y else "—"
        label = f"{shape}, seq {seq}, batch {batch}"
        if variant == "own_kernels":
            label += " — ctitan with CTITAN_GPU_KERNELS=ctitan"
        elif variant == "cuda_graphs":
            label += " — ctitan with training.cuda_graphs"
        elif variant == "graphs_own_kernels":
            label += " — ctitan with training.cuda_graphs and CTITAN_GPU_KERNELS=ctitan"
        elif variant != "ctitan":
            label += f" — ctitan with model.sdpa_backend {variant[len('sdpa_'):]}"
        print(f"| {label} | {cell(tps[0], '{:,.0f}')} | {cell(tps[1], '{:,.0f}')} "
              f"| {ratio(tps[0], tps[1])} | {cell(tps[2], '{:,.0f}')} | {ratio(tps[0], tps[2])} "
              f"| {' / '.join(mfu)} | {' / '.join(cell(m, '{:.1f}') for m in mem)} |")
print(f"\nMFU: (6·non-embedding parameters + 12·layers·heads·head_dim·seq) FLOPs per token ÷ "
      f"{peak / 1e12:.1f} TFLOP/s; PyTorch {torch_version or 'unknown'}; bf16 mixed precision.")
EOF
