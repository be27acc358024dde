#!/usr/bin/env bash
# Training-speed benchmark (not a test): ctitan against PyTorch 2.13 (the venv's, whose LibTorch
# ctitan is built on) running the same model (bench/eager_llama.py: torchtitan's layout, SDPA,
# fused AdamW) eagerly and under torch.compile, side by side in one run, same config, same
# threads. The machine is shared and noisy, so every number is read next to a reference measured
# in the same run, and the sides alternate (ctitan, eager, compile, ctitan, eager, compile; the
# best of the REPS (2) runs of each is kept, against the best of the matmul peaks measured before
# each round and after the last).
#
#   bench/perf.sh            # everything below, prints Markdown tables (docs/performance.md)
#   STEPS=6 bench/perf.sh    # timed steps per run (after 2 untimed warm-up steps)
#   REPS=4 bench/perf.sh     # alternating runs per cell of tables 1 and 7 (default 2, the best kept)
#   PARTS="speed fsdp" bench/perf.sh   # some tables only: speed seq fsdp data parity kernels
#   PARTS=speed PRECS=bf16 MODELS=33M bench/perf.sh   # some cells of the first table only
#
# Tables:
#  1. tokens/s, TFLOP/s, MFU against the matmul peak measured here (2048³ torch.mm, same
#     threads), peak RSS, ctitan / eager and ctitan / compile — debug (dim 256, 6 layers,
#     16 heads, 8 kv heads, vocab 2048, seq 512, batch 8) and 33M (dim 512, 8 layers, 8 heads,
#     4 kv heads, vocab 8192, seq 512, batch 4), fp32 and bf16 (ctitan: bf16 mixed precision;
#     PyTorch: autocast).
#  2. sequence scaling: 33M bf16 at seq 2048 × batch 1 against seq 512 × batch 4.
#  3. FSDP, 33M bf16, 2 ranks × 1 thread: ctitan against PyTorch 2.13's FSDP2 (fully_shard
#     over Gloo, started by torchrun) and against ctitan 1 rank × 2 threads.
#  4. data pipeline alone: tokens/s of the dataloader (no model).
#  5. loss parity: ctitan's first losses and eager's from ctitan's initial weights, the same
#     batches and learning rates, fp32 (and bf16 for information).
#  6. kernels: each of ctitan's own kernels against the ATen op that
#     does the same job in LibTorch 2.13 (bench/kernel_bench.cpp), forward + backward.
#  7. `ab` (only when asked for, with BASELINE=<another build folder>): this build's `train`
#     against another build's (an older commit's), the cells of table 1, alternating, best of 2
#     — "did a change slow the CPU path down":
#       git worktree add /tmp/old <commit> && (cd /tmp/old && scripts/test.sh -R none)
#       PARTS=ab BASELINE=/tmp/old/build bench/perf.sh
#     against the LibTorch 1.13 build (e41dd51, Debian's LibTorch with its shared oneDNN), built
#     in a prefix of its own so that nothing of 1.13 reaches this tree's build:
#       bench/build_baseline_113.sh && PARTS=ab BASELINE=/tmp/ctitan-e41dd51/build bench/perf.sh
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps >&2
ctitan_build train checkpoint_tool ctitan_spm_shim dataloader_bench kernel_bench >&2
ctitan_ensure_default_corpus
TOK8K="$CTITAN_DATA_DIR/tokenizers/moby_dick_8192.model"
if [[ ! -s "$TOK8K" ]]; then
  "$CTITAN_ROOT/scripts/train_tokenizer.sh" "$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" "$TOK8K" 8192 >&2
fi

PY=$CTITAN_PYTHON
PARTS="${PARTS:-speed seq fsdp data parity kernels}"
part() { [[ " $PARTS " == *" $1 "* ]]; }
STEPS="${STEPS:-6}"
REPS="${REPS:-2}"  # alternating runs per cell (tables 1 and 7), the best kept
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
  OMP_NUM_THREADS=$THREADS "${TRAIN_BIN:-$CTITAN_BUILD_DIR/train}" --job.config_file train_configs/debug_model.toml ${CT[$cfg]} \
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

# eager_run <config> <prec> [--compile | --fsdp ...] → prints "tokens/s peak_rss_gib"
eager_run() {
  local cfg=$1 prec=$2; shift 2
  # shellcheck disable=SC2086
  $PY bench/eager_llama.py ${EG[$cfg]} --dtype "$prec" --threads "$THREADS" --steps "$STEPS" --warmup $WARMUP "$@" \
    2>"$OUT/eager.err" | $PY -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["tokens_per_s"], r["peak_rss_gib"])' \
    || { log "eager run failed ($cfg $prec $*):"; tail -20 "$OUT/eager.err" >&2; exit 1; }
}

# matmul peak of this process's threads, GFLOP/s: the best of six 2048³ torch.mm, or of those
# that fit 5 s after the first (bf16 emulated on a CPU without native bf16 matmuls takes ~20 s a
# product: six of them, before each round, made a bf16 cell take many minutes).
peak() {
  $PY - "$1" "$THREADS" <<'EOF'
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
dt = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
n = 2048
a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
best = 0
a @ b
start = time.perf_counter()
for i in range(6):
    if i > 0 and time.perf_counter() - start > 5:
        break
    t = time.perf_counter(); a @ b; best = max(best, 2 * n**3 / (time.perf_counter() - t))
print(best / 1e9)
EOF
}

best_of() { sort -g -k1,1 | tail -1; }

if part speed; then
echo
echo "## ctitan vs PyTorch $($PY -c 'import torch; print(torch.__version__)') eager and torch.compile ($(nproc) cores, $THREADS threads, $STEPS timed steps after $WARMUP warm-up, best of $REPS alternating runs)"
echo
echo "| model | precision | matmul peak (GFLOP/s) | eager tok/s | compile tok/s | ctitan tok/s | ctitan / eager | ctitan / compile | ctitan MFU | eager MFU | compile MFU | peak RSS eager / compile / ctitan (GiB) |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for cfg in ${MODELS:-debug 33M}; do
  for prec in ${PRECS:-fp32 bf16}; do
    log "$cfg $prec"
    # REPS rounds of ctitan, eager, compile, each after a peak measurement, and a last peak:
    # the best of each side, against the best peak (a busy moment only slows things down).
    # Without native bf16 matmuls (no avx512_bf16 / amx_bf16) the bf16 peak is not measured: an
    # emulated 2048³ bf16 torch.mm took 63 s on a Zen 3 (0.27 GFLOP/s), a meaningless reference.
    pprec=$prec
    [[ $prec == bf16 ]] && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && pprec=fp32
    pks="" cs="" es="" ks=""
    for ((r = 1; r <= REPS; r++)); do
      pks+="$(peak "$pprec")"$'\n'
      cs+="$(ctitan_run "${cfg}_${prec}_$r" "$cfg" "$prec")"$'\n'
      es+="$(eager_run "$cfg" "$prec")"$'\n'
      ks+="$(eager_run "$cfg" "$prec" --compile)"$'\n'
    done
    pks+="$(peak "$pprec")"$'\n'
    pk=$(printf '%s' "$pks" | sort -g | tail -1)
    c=$(printf '%s' "$cs" | best_of); e=$(printf '%s' "$es" | best_of); k=$(printf '%s' "$ks" | best_of)
    read -r ct cm fpt <<<"$c"; read -r et em <<<"$e"; read -r kt km <<<"$k"
    echo "$cfg $prec $ct" >>"$OUT/tps"
    log "runs: peak $(echo $pks); ctitan ${cs//$'\n'/ | }eager ${es//$'\n'/ | }compile ${ks//$'\n'/ | }"
    # On a CPU without native bf16 matmuls one ctitan process trains bf16 requests in fp32 (it
    # says so in its log): its MFU is then taken against the fp32 peak, and the row is marked;
    # PyTorch's bf16 matmuls run emulated there, with no peak to compare them with ("—").
    p=$prec
    if [[ $pprec != "$prec" ]]; then
      p="$prec (ctitan: fp32 ¹)"; fallback=1
      grep -q "one process trains in float32" "$OUT/${cfg}_${prec}_1.log" ||
        { log "ctitan did not say it trains in float32 on this CPU without native bf16"; exit 1; }
    fi
    awk -v m="$cfg" -v p="$p" -v pk="$pk" -v emul="$([[ $pprec != "$prec" ]] && echo 1 || echo 0)" -v ct="$ct" -v et="$et" -v kt="$kt" -v f="$fpt" -v cm="$cm" -v em="$em" -v km="$km" \
      'function mfu(t) { return emul ? "—" : sprintf("%.1f%%", 100*t*f/(pk*1e9)) }
       BEGIN { printf "| %s | %s | %.0f | %.0f | %.0f | %.0f | **%.2fx** | **%.2fx** | %.1f%% | %s | %s | %.2f / %.2f / %.2f |\n",
               m, p, pk, et, kt, ct, ct/et, ct/kt, 100*ct*f/(pk*1e9), mfu(et), mfu(kt), em, km, cm }'
  done
done
if [[ -n "${fallback:-}" ]]; then
  echo
  echo "¹ This CPU has no native bf16 matmul (no avx512_bf16 / amx_bf16 in /proc/cpuinfo): asked for bf16"
  echo "mixed precision, one ctitan process trains in fp32 (the peak column is the fp32 peak), while"
  echo "PyTorch's autocast runs bf16 matmuls in emulation (no MFU given for them)."
fi
fi

if part seq; then
echo
echo "## Sequence scaling (33M, bf16 asked, 2048 tokens per step)"
grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo || { echo; echo "(one ctitan process trains in fp32 here: this CPU has no native bf16 matmul)"; }
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
fi

if part fsdp; then
echo
# bf16 where the CPU multiplies it natively; elsewhere fp32 for all three rows (bf16 would be
# emulated on the two FSDP sides while one ctitan process falls back to fp32: no comparison).
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then FP=bf16; else FP=fp32; fi
echo "## FSDP: 2 ranks × 1 thread (33M, $FP, global batch 4 × 512): ctitan, PyTorch FSDP2, ctitan 1 rank × 2 threads"
[[ $FP == fp32 ]] && { echo; echo "(fp32: this CPU has no native bf16 matmul, where bf16 is emulated and 4-6x slower.)"; }
echo
log "FSDP 2x1"
fsdp_run() {  # fsdp_run <tag> → tokens/s of 2 ranks × 1 thread (both ranks)
  local dir="$OUT/$1"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 NPROC=2 ./scripts/run_train.sh --job.config_file train_configs/debug_model.toml ${CT[33M]} \
    --training.local_batch_size 2 --training.mixed_precision_param "$(ctitan_prec $FP)" --training.steps $((STEPS + WARMUP)) \
    --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 --job.dump_folder "$dir" --debug.seed 7 >"$dir.log" 2>&1 \
    || { log "FSDP run failed:"; tail -20 "$dir.log" >&2; exit 1; }
  read -r t _ _ <<<"$(ctitan_summary "$dir" 2)"
  echo "$t"
}
fsdp2_run() {  # PyTorch's FSDP2 (fully_shard) on the same 2 ranks × 1 thread, started by torchrun
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 "$CTITAN_VENV/bin/torchrun" --standalone --nproc-per-node 2 bench/eager_llama.py ${EG[33M]} \
    --batch 2 --dtype $FP --threads 1 --steps "$STEPS" --warmup $WARMUP --fsdp 2>"$OUT/fsdp2.err" \
    | $PY -c 'import json,sys; print(json.loads(sys.stdin.read())["tokens_per_s"])' \
    || { log "FSDP2 run failed:"; tail -20 "$OUT/fsdp2.err" >&2; exit 1; }
}
# Alternating, best of two each, as in the first table.
o1=$(THREADS=2 ctitan_run fsdp1x2_a 33M $FP | cut -d' ' -f1); t1=$(fsdp_run fsdp2x1_a); f1=$(fsdp2_run)
o2=$(THREADS=2 ctitan_run fsdp1x2_b 33M $FP | cut -d' ' -f1); t2=$(fsdp_run fsdp2x1_b); f2=$(fsdp2_run)
one=$(printf '%s\n%s\n' "$o1" "$o2" | best_of)
two=$(printf '%s\n%s\n' "$t1" "$t2" | best_of)
ref=$(printf '%s\n%s\n' "$f1" "$f2" | best_of)
log "runs: ctitan 1x2 $o1 | $o2; ctitan FSDP $t1 | $t2; FSDP2 $f1 | $f2"
echo "| layout | tok/s | ctitan FSDP / this |"
echo "|---|---:|---:|"
awk -v a="$one" -v b="$two" -v r="$ref" 'BEGIN { printf "| ctitan, 2 ranks × 1 thread (FSDP) | %.0f | 1.00x |\n| PyTorch FSDP2, 2 ranks × 1 thread | %.0f | **%.2fx** |\n| ctitan, 1 rank × 2 threads | %.0f | **%.2fx** |\n", b, r, b/r, a, b/a }'
fi

if part data; then
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
  tr=$(awk -v m="$cfg" '$1==m && $2=="bf16" {print $3}' "$OUT/tps" 2>/dev/null || true)
  [[ -n "$tr" ]] || tr=$(ctitan_run "data_$cfg" "$cfg" bf16 | cut -d' ' -f1)  # without the speed table
  awk -v t="$(basename "$tok")" -v b=$b -v dl="$dl" -v tr="$tr" \
    'BEGIN { printf "| %s | 512 × %d | %.0f | %.0f | **%.0fx** |\n", t, b, dl, tr, dl/tr }'
done

fi

if part parity; then
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
fi

if part kernels; then
echo
echo "## ctitan's kernels against LibTorch 2.13's own ops"
echo
log "kernels"
OMP_NUM_THREADS=$THREADS "$CTITAN_BUILD_DIR/kernel_bench" 7
fi

if part ab; then
[[ -x "${BASELINE:-}/train" ]] || { log "PARTS=ab needs BASELINE=<build folder with a train binary>"; exit 2; }
echo
echo "## this build's train against $BASELINE/train ($(nproc) cores, $THREADS threads, $STEPS timed steps after $WARMUP warm-up, best of $REPS alternating runs)"
echo
echo "| model | precision | baseline tok/s | this build tok/s | this / baseline |"
echo "|---|---|---|---|---|"
for cfg in ${MODELS:-debug 33M}; do
  for prec in ${PRECS:-fp32 bf16}; do
    os="" ns=""
    for ((r = 1; r <= REPS; r++)); do
      os+="$(TRAIN_BIN="$BASELINE/train" ctitan_run "ab_old_${cfg}_${prec}_$r" "$cfg" "$prec")"$'\n'
      ns+="$(ctitan_run "ab_new_${cfg}_${prec}_$r" "$cfg" "$prec")"$'\n'
    done
    o=$(printf '%s' "$os" | best_of | cut -d' ' -f1); n=$(printf '%s' "$ns" | best_of | cut -d' ' -f1)
    log "ab runs: baseline ${os//$'\n'/ | }this build ${ns//$'\n'/ | }"
    awk -v c="$cfg" -v p="$prec" -v o="$o" -v n="$n" 'BEGIN { printf "| %s | %s | %.0f | %.0f | %.3f |\n", c, p, o, n, n / o }'
  done
done
fi
