#!/usr/bin/env bash
# Training-speed benchmark (not a test): ctitan against a plain PyTorch eager reference of the
# same model (bench/eager_llama.py, Debian's python3-torch: the same LibTorch kernels), side by
# side in one run, same config, same threads, each side with the OpenMP wait policy that
# serves it best (ctitan: its own choice, see train_main.cpp; eager: PASSIVE for fp32, whose
# OpenBLAS threads spinning OpenMP workers starve — 551 vs 412 tok/s on 33M — and libgomp's
# default for bf16, 1,005-1,040 vs 975-999). The machine is shared and noisy, so every number is read next to a reference measured in the same run, and the two
# sides alternate (ctitan, eager, ctitan, eager; the better of the two runs of each is kept).
#
#   bench/perf.sh            # everything below, prints Markdown tables (README: "Performance")
#   STEPS=6 bench/perf.sh    # timed steps per run (after 2 untimed warm-up steps)
#
# Tables:
#  1. tokens/s, TFLOP/s, MFU against the matmul peak measured here (2048³ matmuls, same
#     threads, the better of ATen's and oneDNN's GEMM), peak RSS, ctitan / eager — debug (dim 256, 6 layers, 16 heads, 8 kv heads,
#     vocab 2048, seq 512, batch 8) and 33M (dim 512, 8 layers, 8 heads, 4 kv heads, vocab
#     8192, seq 512, batch 4), fp32 and bf16 (ctitan: bf16 mixed precision; eager: autocast).
#  2. sequence scaling: 33M bf16 at seq 2048 × batch 1 against seq 512 × batch 4.
#  3. FSDP 2 ranks × 1 thread against 1 rank × 2 threads (33M, bf16).
#  4. data pipeline alone: tokens/s of the dataloader (no model).
#  5. loss parity: ctitan's first losses and eager's from ctitan's initial weights, the same
#     batches and learning rates, fp32 (and bf16 for information).
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
"$CTITAN_ROOT/scripts/install_deps.sh" --bench >&2
ctitan_build train checkpoint_tool ctitan_spm_shim dataloader_bench >&2
ctitan_ensure_default_corpus
TOK8K="$CTITAN_DATA_DIR/tokenizers/moby_dick_8192.model"
if [[ ! -s "$TOK8K" ]]; then
  "$CTITAN_ROOT/scripts/train_tokenizer.sh" "$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" "$TOK8K" 8192 >&2
fi

PY=/usr/bin/python3
STEPS="${STEPS:-6}"
WARMUP=2
THREADS="${THREADS:-$(nproc)}"
unset OMP_WAIT_POLICY
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
log() { echo "[perf] $*" >&2; }

# Model configs: name → ctitan flags | eager flags
declare -A CT EG
CT[debug]="--model.flavor debugmodel_gqa --model.tokenizer_path $CTITAN_DEFAULT_TOKENIZER --training.seq_len 512 --training.local_batch_size 8"
EG[debug]="--dim 256 --layers 6 --heads 16 --kv-heads 8 --vocab 2048 --seq 512 --batch 8"
CT[33M]="--model.flavor 33M --model.tokenizer_path $TOK8K --training.seq_len 512 --training.local_batch_size 4"
EG[33M]="--dim 512 --layers 8 --heads 8 --kv-heads 4 --vocab 8192 --seq 512 --batch 4"
CT[33M_2048]="--model.flavor 33M --model.tokenizer_path $TOK8K --training.seq_len 2048 --training.local_batch_size 1"

ctitan_prec() { [[ "$1" == bf16 ]] && echo bfloat16 || echo float32; }

# ctitan_run <tag> <config> <prec> [extra flags...] → prints "tokens/s peak_rss_gib flops_per_token"
ctitan_run() {
  local tag=$1 cfg=$2 prec=$3; shift 3
  local dir="$OUT/$tag"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$THREADS "$CTITAN_BUILD_DIR/train" --job.config_file train_configs/debug_model.toml ${CT[$cfg]} \
    --training.mixed_precision_param "$(ctitan_prec "$prec")" --training.steps $((STEPS + WARMUP)) \
    --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 --job.dump_folder "$dir" --debug.seed 7 "$@" \
    >"$dir.log" 2>&1 || { log "ctitan run $tag failed:"; tail -20 "$dir.log" >&2; exit 1; }
  ctitan_summary "$dir"
}
# ctitan_summary <dump folder> [ranks=1] → "tokens/s peak_rss_gib flops_per_token": tokens/s of
# the timed steps over all ranks (the metrics line's tps is per rank, as torchtitan's).
ctitan_summary() {
  $PY - "$1" "${2:-1}" "$WARMUP" <<'EOF'
import json, re, sys
d, ranks, w = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(d + "/metrics.jsonl")][w:]  # log_freq 1: one row per step
tps = len(rows) / sum(1.0 / r["tps"] for r in rows)  # total tokens / total time
fpt = float(re.search(r"([0-9.]+) MFLOP/token", open(d + ".log").read()).group(1)) * 1e6
print(tps * ranks, max(r["memory_gib"] for r in rows), fpt)
EOF
}

# eager_run <config> <prec> → prints "tokens/s peak_rss_gib"
eager_run() {
  local policy=()
  [[ "$2" == fp32 ]] && policy=(env OMP_WAIT_POLICY=PASSIVE)
  # shellcheck disable=SC2086
  "${policy[@]}" $PY bench/eager_llama.py ${EG[$1]} --dtype "$2" --threads "$THREADS" --steps "$STEPS" --warmup $WARMUP \
    | $PY -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["tokens_per_s"], r["peak_rss_gib"])'
}

peak() {  # matmul peak of this process's threads, GFLOP/s: the best of several 2048³ matmuls, each
          # through ATen (torch.mm) and through oneDNN's GEMM (what ctitan's projections call)
  $PY - "$1" "$THREADS" <<'EOF'
import ctypes, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
dt = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
n = 2048
a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
c = torch.empty(n, n)
fns = [lambda: a @ b]
try:  # the libdnnl this LibTorch links (row-major C API; C in fp32)
    dnnl = ctypes.CDLL("libdnnl.so.2")
    f = dnnl.dnnl_gemm_bf16bf16f32 if dt == torch.bfloat16 else dnnl.dnnl_sgemm
    i64, fl, p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, fl, p, i64, p, i64, fl, p, i64]
    fns.append(lambda: f(b"N", b"N", n, n, n, 1.0, a.data_ptr(), n, b.data_ptr(), n, 0.0, c.data_ptr(), n))
except (OSError, AttributeError):
    pass
best = 0
for fn in fns:
    fn()
    for _ in range(6):
        t = time.perf_counter(); fn(); best = max(best, 2 * n**3 / (time.perf_counter() - t))
print(best / 1e9)
EOF
}

best_of() { sort -g -k1,1 | tail -1; }

echo
echo "## ctitan vs PyTorch eager ($(nproc) cores, $THREADS threads, $STEPS timed steps after $WARMUP warm-up, best of 2 alternating runs)"
echo
echo "| model | precision | matmul peak (GFLOP/s) | eager tok/s | ctitan tok/s | ctitan / eager | ctitan TFLOP/s | ctitan MFU | eager MFU | peak RSS eager / ctitan (GiB) |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for cfg in debug 33M; do
  for prec in fp32 bf16; do
    log "$cfg $prec"
    pk=$(peak "$prec")
    c1=$(ctitan_run "${cfg}_${prec}_a" "$cfg" "$prec"); e1=$(eager_run "$cfg" "$prec")
    c2=$(ctitan_run "${cfg}_${prec}_b" "$cfg" "$prec"); e2=$(eager_run "$cfg" "$prec")
    pk2=$(peak "$prec")
    pk=$(printf '%s\n%s\n' "$pk" "$pk2" | sort -g | tail -1)
    c=$(printf '%s\n%s\n' "$c1" "$c2" | best_of); e=$(printf '%s\n%s\n' "$e1" "$e2" | best_of)
    read -r ct cm fpt <<<"$c"; read -r et em <<<"$e"
    echo "$cfg $prec $ct" >>"$OUT/tps"
    awk -v m="$cfg" -v p="$prec" -v pk="$pk" -v ct="$ct" -v et="$et" -v f="$fpt" -v cm="$cm" -v em="$em" \
      'BEGIN { printf "| %s | %s | %.0f | %.0f | %.0f | **%.2fx** | %.3f | %.1f%% | %.1f%% | %.2f / %.2f |\n",
               m, p, pk, et, ct, ct/et, ct*f/1e12, 100*ct*f/(pk*1e9), 100*et*f/(pk*1e9), em, cm }'
  done
done

echo
echo "## Sequence scaling (33M, bf16, 2048 tokens per step)"
echo
log "33M seq 2048"
# Both lengths measured here, alternately (512, 2048, 512, 2048), the better of two runs each:
# a ratio of runs minutes apart (the 512 figure of the first table) moves with the machine.
seq_run() { ctitan_run "seq$1_$2" "$3" bf16 | cut -d' ' -f1; }
a1=$(seq_run 512 a 33M); b1=$(seq_run 2048 a 33M_2048); a2=$(seq_run 512 b 33M); b2=$(seq_run 2048 b 33M_2048)
s512=$(printf '%s\n%s\n' "$a1" "$a2" | best_of)
s2048=$(printf '%s\n%s\n' "$b1" "$b2" | best_of)
echo "| seq × batch | ctitan tok/s | vs seq 512 |"
echo "|---|---:|---:|"
awk -v a="$s512" -v b="$s2048" 'BEGIN { printf "| 512 × 4 | %.0f | 1.00x |\n| 2048 × 1 | %.0f | **%.2fx** |\n", a, b, b/a }'

echo
echo "## FSDP: 2 ranks × 1 thread vs 1 rank × 2 threads (33M, bf16, global batch 4 × 512)"
echo
log "FSDP 2x1"
fsdp_run() {  # fsdp_run <tag> → tokens/s of 2 ranks × 1 thread (both ranks)
  local dir="$OUT/$1"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 NPROC=2 ./scripts/run_train.sh --job.config_file train_configs/debug_model.toml ${CT[33M]} \
    --training.local_batch_size 2 --training.mixed_precision_param bfloat16 --training.steps $((STEPS + WARMUP)) \
    --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 --job.dump_folder "$dir" --debug.seed 7 >"$dir.log" 2>&1 \
    || { log "FSDP run failed:"; tail -20 "$dir.log" >&2; exit 1; }
  read -r t _ _ <<<"$(ctitan_summary "$dir" 2)"
  echo "$t"
}
# Alternating, best of two each, as in the first table.
o1=$(THREADS=2 ctitan_run fsdp1x2_a 33M bf16 | cut -d' ' -f1); t1=$(fsdp_run fsdp2x1_a)
o2=$(THREADS=2 ctitan_run fsdp1x2_b 33M bf16 | cut -d' ' -f1); t2=$(fsdp_run fsdp2x1_b)
one=$(printf '%s\n%s\n' "$o1" "$o2" | sort -g | tail -1)
two=$(printf '%s\n%s\n' "$t1" "$t2" | sort -g | tail -1)
echo "| layout | tok/s | vs 1 × 2 |"
echo "|---|---:|---:|"
awk -v a="$one" -v b="$two" 'BEGIN { printf "| 1 rank × 2 threads | %.0f | 1.00x |\n| 2 ranks × 1 thread (FSDP) | %.0f | **%.2fx** |\n", a, b, b/a }'

echo
echo "## Data pipeline alone (one rank: read, tokenize, pack; no model)"
echo
log "data pipeline"
echo "| tokenizer | seq × batch | dataloader tok/s | training consumes (tok/s, bf16 above) | headroom |"
echo "|---|---|---:|---:|---:|"
for cfg in debug 33M; do
  if [[ $cfg == debug ]]; then tok=$CTITAN_DEFAULT_TOKENIZER; b=8; else tok=$TOK8K; b=4; fi
  dl=$("$CTITAN_BUILD_DIR/dataloader_bench" "$tok" "$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" 512 $b 5 2>"$OUT/dataloader_$cfg.log" \
    | tail -n 1 | $PY -c 'import json,sys; print(json.loads(sys.stdin.read())["tokens_per_s"])')
  tr=$(awk -v m="$cfg" '$1==m && $2=="bf16" {print $3}' "$OUT/tps")
  awk -v t="$(basename "$tok")" -v b=$b -v dl="$dl" -v tr="$tr" \
    'BEGIN { printf "| %s | 512 × %d | %.0f | %.0f | **%.0fx** |\n", t, b, dl, tr, dl/tr }'
done

echo
echo "## Loss parity (debug model, same initial weights, batches and learning rates)"
echo
log "loss parity"
par="$OUT/parity"
"$CTITAN_BUILD_DIR/train" --job.config_file train_configs/debug_model.toml ${CT[debug]} --job.dump_folder "$par/seed" \
  --checkpoint.enable --checkpoint.create_seed_checkpoint --debug.seed 7 >"$par.seed.log" 2>&1 \
  || { log "seed checkpoint failed:"; tail -5 "$par.seed.log" >&2; exit 1; }
"$CTITAN_BUILD_DIR/checkpoint_tool" export "$par/seed/checkpoint/step-0" "$par/init.pt" >/dev/null
echo "| precision | steps | max relative loss difference | ctitan losses | eager losses |"
echo "|---|---:|---:|---|---|"
for prec in fp32 bf16; do
  rm -f "$par.windows".*
  CTITAN_TRACE_WINDOWS="$par.windows" OMP_NUM_THREADS=$THREADS "$CTITAN_BUILD_DIR/train" \
    --job.config_file train_configs/debug_model.toml ${CT[debug]} --training.steps 5 --metrics.log_freq 1 \
    --training.mixed_precision_param "$(ctitan_prec "$prec")" --job.dump_folder "$par/$prec" --debug.seed 7 \
    >"$par.$prec.log" 2>&1 || { log "parity run failed:"; tail -5 "$par.$prec.log" >&2; exit 1; }
  lrs=$($PY -c 'import json,sys; print(",".join(repr(json.loads(l)["lr"]) for l in open(sys.argv[1])))' "$par/$prec/metrics.jsonl")
  # shellcheck disable=SC2086
  $PY bench/eager_llama.py ${EG[debug]} --dtype "$prec" --threads "$THREADS" --weights "$par/init.pt" \
    --windows "$par.windows.rank0" --lrs "$lrs" >"$par.$prec.eager.json"
  $PY - "$prec" "$par/$prec/metrics.jsonl" "$par.$prec.eager.json" <<'EOF'
import json, sys
c = [json.loads(l)["loss"] for l in open(sys.argv[2])]
e = [r["loss"] for r in json.load(open(sys.argv[3]))["losses"]]
rel = max(abs(a - b) / abs(b) for a, b in zip(c, e))
print(f"| {sys.argv[1]} | {len(c)} | {rel:.2e} | {' '.join(f'{v:.6f}' for v in c)} | {' '.join(f'{v:.6f}' for v in e)} |")
EOF
done
