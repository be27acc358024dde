#!/usr/bin/env bash
# ctitan on one GPU, checked against the CPU (issues 17, 32): first run at eb6f842 on an H200
# (PyTorch 2.11.0+cu130); docs/gpus.md has what each run printed.
#
# From a fresh clone, two steps:
#   1. on the CPU machine (Debian 12, network):   scripts/gpu_check.sh --prepare
#      makes everything the GPU machine lacks: build-deps/ (scripts/vendor_build_deps.sh: the
#      libraries Debian would give), data/moby_dick/moby_dick.txt and the two sentencepiece
#      tokenizers data/tokenizers/moby_dick_{2048,8192}.model (Debian's spm_train);
#   2. on the GPU machine, with build-deps/ and data/ copied along (the device tool: carry
#      ["build-deps", "data"]):                   scripts/gpu_check.sh
# The GPU machine needs only PyTorch with CUDA on the `python3` on PATH and nvcc (for
# kernels/*_cuda.cu: on PATH, in CUDA_HOME or /usr/local/cuda; the device image: PyTorch 2.11 +
# CUDA 13 with nvcc 13.0, CMake, ninja, g++; no Debian packages, no network).
#
# It builds ctitan against that PyTorch (build-gpu/) and checks on cuda:0:
#   (a) 20 steps of the debug model in float32, GPU against CPU (the same binary with
#       CUDA_VISIBLE_DEVICES=), same seed, TF32 off: every loss within 1e-4 relative;
#   (b) activation checkpointing none / full / selective op / selective layer (every 2nd
#       block) on the GPU in float32 with debug.deterministic: losses and gradient norms
#       bitwise equal to AC none;
#   (c) checkpoints across devices, every run with debug.deterministic: a GPU run saving at
#       step 10 and going on to 20; a GPU resume from that step 10 must give its steps 11-20
#       bitwise (losses and gradient norms); a CPU resume from it must give them within 1e-4
#       relative; a GPU resume from the CPU run's step-15 checkpoint must give the CPU run's
#       steps 16-20 within 1e-4 relative;
#   (e) bf16 mixed precision on the GPU (FSDP's machinery over a group of one: bf16 compute,
#       float32 master weights), debug.deterministic: AC full / op / layer bitwise equal to AC
#       none, and the losses within 5e-2 relative of (a)'s float32 GPU run;
#   (d) bench/gpu_bench.sh (issue 33's table): the Llama-3-8B shape with 8 and 16 layers at seq
#       8192 and the 150M flavor at seq 2048 × 8 (CTITAN_GPU_BENCH_SHAPES picks), ctitan against
#       PyTorch eager and torch.compile (bench/eager_llama.py, the same PyTorch), bf16, MFU by
#       torchtitan's formula, peak memory; a shape that does not fit is a row of dashes;
#   (f) the host-synchronisation rule (issue 33): 12 steps logging every 6th, float32 and bf16,
#       with CTITAN_SYNC_CHECK=1 (CUDA's sync debug mode as errors in steps 2-5 and 7-11, which
#       log and save nothing: a synchronising operation fails the run, naming it) and
#       CTITAN_TRACE_HOST_READS (those steps read nothing back);
#   (g) ctitan's own CUDA kernels (kernels/fused_cuda.h: SwiGLU, RoPE, the cross-entropy; their
#       source also runs on the CPU in CI, tests/test_cuda_kernels_on_host.cpp):
#       build-gpu/gpu_kernel_check checks each against ATen's route (forward and backward,
#       float32 and bf16, odd and misaligned shapes, the 150M and 8B shapes) and times both;
#       then the debug model with CTITAN_GPU_KERNELS=ctitan, 20 steps: float32 within 1e-4
#       relative of (a)'s GPU run (the start-up line saying the kernels ran), bf16 within 1e-2
#       of (e)'s AC-none run;
#   (h) Mixtral (the MoE debug flavor), float32: 20 steps on the GPU against the CPU within
#       1e-4 relative, and AC full bitwise equal to AC none on the GPU (debug.deterministic);
#       bf16 mixed precision within 5e-2 of that float32 run;
#   (i) training.cuda_graphs (training/step_graph.h: the step captured at step 3, replayed from
#       then on), debug.deterministic, 20 steps, ctitan's kernels on both sides
#       (CTITAN_GPU_KERNELS=ctitan: the graph's AdamW is ctitan's kernel): float32 bitwise equal
#       to the eager run, bf16 (FSDP over a group of one) with AC none and AC full bitwise equal
#       to bf16 eager; ATen's other kernels with graphs within 1e-4 of (a); and (f)'s rule on
#       the replayed steps (float32 and bf16, 12 steps logging every 6th);
# Each part prints PASS or FAIL with its numbers, a failed run one line naming the part, the
# run and its last log line; the last line sums up. The runs' folders and logs go to
# outputs/gpu_check/ (git-ignored). Exit 0 only when (a)-(c), (e)-(i) pass and (d) ran.
#   scripts/gpu_check.sh --prepare                # step 1, on the CPU machine
#   scripts/gpu_check.sh                          # everything (parts a b c e f g h i d)
#   CTITAN_GPU_PARTS="a b" scripts/gpu_check.sh   # some parts
#   CTITAN_GPU_CONFIGURE_ONLY=1 scripts/gpu_check.sh  # configure the build and stop (no GPU needed)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEPS="${CTITAN_BUILD_DEPS:-$ROOT/build-deps}"
BUILD="${CTITAN_GPU_BUILD_DIR:-$ROOT/build-gpu}"
OUT="${CTITAN_GPU_OUT:-$ROOT/outputs/gpu_check}"
PARTS="${CTITAN_GPU_PARTS:-a b c e f g h i d}"
log() { echo "[gpu_check] $*" >&2; }
die() { log "$*"; exit 1; }

# The two sentencepiece tokenizers the checks read: 2048 pieces for (a)-(c), (e) (the debug
# model), 8192 for (d).
TOKENIZERS=(2048 8192)
if [[ "${1:-}" == --prepare ]]; then
  source "$ROOT/scripts/common.sh"
  ctitan_ensure_deps
  "$ROOT/scripts/vendor_build_deps.sh" || die "--prepare: scripts/vendor_build_deps.sh failed"
  ctitan_ensure_default_corpus || die "--prepare: the Moby-Dick corpus or its tokenizer could not be made"
  for v in "${TOKENIZERS[@]}"; do
    tok="$CTITAN_DATA_DIR/tokenizers/moby_dick_$v.model"
    [[ -s "$tok" ]] || "$ROOT/scripts/train_tokenizer.sh" "$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" "$tok" "$v" ||
      die "--prepare: training $tok failed"
  done
  log "ready: carry build-deps and data ($(du -sh "$ROOT/build-deps" | cut -f1) and $(du -sh "$CTITAN_DATA_DIR" | cut -f1)) to the GPU machine"
  exit 0
fi

# ---- the PyTorch on PATH, and a GPU ------------------------------------------------------
TORCH_ROOT="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || die "no torch in $PY"
"$PY" - <<'EOF' >&2 || [[ -n "${CTITAN_GPU_CONFIGURE_ONLY:-}" ]] || die "this PyTorch has no CUDA, or no GPU is visible"
import sys, torch, torch.distributed as dist
print(f"[gpu_check] torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL available {dist.is_nccl_available()}, "
      f"GPUs {torch.cuda.device_count()}" + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)
EOF

# ---- build against it, with build-deps/ ----------------------------------------------------
[[ -d "$DEPS/usr/include" ]] || die "$DEPS is missing: run scripts/gpu_check.sh --prepare on the CPU machine and carry build-deps/"
LIBS="$DEPS/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$LIBS:$DEPS/usr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$LIBS/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$DEPS"
# Where Debian's /usr/include and /usr/lib would be: searched after everything CMake names.
export CPLUS_INCLUDE_PATH="$DEPS/usr/include" C_INCLUDE_PATH="$DEPS/usr/include" LIBRARY_PATH="$LIBS"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCTITAN_WITH_CUDA=ON \
    -DCTITAN_TORCH_ROOT="$TORCH_ROOT" -DCTITAN_USE_CCACHE=OFF \
    -DCMAKE_PREFIX_PATH="$DEPS/usr" -DCMAKE_LIBRARY_ARCHITECTURE=x86_64-linux-gnu \
    -Dtoml11_DIR="$DEPS/usr/share/cmake/toml11" -Dspdlog_DIR="$LIBS/cmake/spdlog" -Dfmt_DIR="$LIBS/cmake/fmt" \
    -DGTest_DIR="$LIBS/cmake/GTest" -DICU_ROOT="$DEPS/usr" -DZLIB_ROOT="$DEPS/usr" \
    -DSENTENCEPIECE_LIB="$LIBS/libsentencepiece.so" ||
    die "configure failed"
fi
[[ -z "${CTITAN_GPU_CONFIGURE_ONLY:-}" ]] || exit 0
cmake --build "$BUILD" -j"$(nproc)" --target train checkpoint_tool test_gpu_plan gpu_kernel_check || die "build failed"
TRAIN="$BUILD/train"
"$BUILD/test_gpu_plan" --gtest_brief=1 || die "test_gpu_plan failed on the GPU machine"

# The corpus and tokenizers, made by --prepare on the CPU machine and carried.
need=(data/moby_dick/moby_dick.txt)
for v in "${TOKENIZERS[@]}"; do need+=("data/tokenizers/moby_dick_$v.model"); done
for f in "${need[@]}"; do
  [[ -s "$f" ]] || die "$f is missing: run scripts/gpu_check.sh --prepare on the CPU machine and carry data/"
done
mkdir -p "$OUT"
status=0
failed=""  # the parts with a FAIL line, for the summary at the end
# fail_line "(x) FAIL: why": prints the line and notes part (x) as failed
fail_line() {
  echo "$*"
  [[ " $failed " == *" ${1%% *} "* ]] || failed+="${1%% *} "
  status=1
}
debug=(--job.config_file train_configs/debug_model.toml --training.mixed_precision_param float32
       --debug.seed 42 --metrics.log_freq 1 --metrics.enable_tensorboard false --lr_scheduler.warmup_steps 5)
mixtral=(--job.config_file train_configs/mixtral_debug.toml "${debug[@]:2}")  # (h): the same, for Mixtral

# losses FILE [FIRST] [LAST] → "step loss grad_norm" lines from a metrics.jsonl
losses() {
  "$PY" -c '
import json, sys
lo, hi = int(sys.argv[2]), int(sys.argv[3])
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "loss" in m and lo <= m["step"] <= hi:
        print(m["step"], repr(m["loss"]), repr(m["grad_norm"]))' "$1" "${2:-1}" "${3:-100000}"
}
# compare A B TOL → PASS/FAIL line; TOL 0 means bitwise (the repr of each double)
compare() {
  "$PY" -c '
import sys
a = [l.split() for l in open(sys.argv[1]) if l.strip()]
b = [l.split() for l in open(sys.argv[2]) if l.strip()]
tol = float(sys.argv[3])
if not a or [r[0] for r in a] != [r[0] for r in b]:
    print(f"FAIL: steps differ ({len(a)} vs {len(b)} lines)"); sys.exit(1)
worst = max(abs(float(x[1]) - float(y[1])) / abs(float(y[1])) for x, y in zip(a, b))
same = all(x[1:] == y[1:] for x, y in zip(a, b))
ok = same if tol == 0 else worst <= tol
print(("PASS" if ok else "FAIL") + f": {len(a)} steps, largest relative loss difference {worst:.3e}"
      + (", bitwise equal" if same else ", not bitwise equal"))
sys.exit(0 if ok else 1)' "$1" "$2" "$3"
}
# report LABEL A B TOL → "LABEL: PASS/FAIL ..." and compare's exit status
report() {
  local label=$1 line rc
  shift
  line="$(compare "$@")"
  rc=$?
  if ((rc == 0)); then echo "$label: $line"; else fail_line "$label: $line"; fi
  return $rc
}
run() {  # run NAME [env...] -- args: a train run whose log is $OUT/NAME.log ($RUN_BASE: the
         # array of base arguments, debug unless set)
  local name=$1; shift
  local -n base="${RUN_BASE:-debug}"
  local envs=()
  while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  rm -rf "$OUT/$name"
  env "${envs[@]}" "$TRAIN" "${base[@]}" --job.dump_folder "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -m1 "device:" "$OUT/$name.log" >&2
  ((rc == 0)) || { fail_line "(${name%%_*}) FAIL: run $name exited $rc: $(tail -1 "$OUT/$name.log")"; return 1; }
}
# run_vs REF TOL LABEL NAME [env...] -- args: a run (as run) whose losses are then reported
# against the file REF, when an earlier part wrote it.
run_vs() {
  local ref=$1 tol=$2 label=$3 name=$4
  shift 4
  run "$name" "$@" || { status=1; return 1; }
  [[ -s "$ref" ]] || return 0
  losses "$OUT/$name/metrics.jsonl" >"$OUT/$name.losses"
  report "$label" "$OUT/$name.losses" "$ref" "$tol" || status=1
}
# AC modes by name → their train arguments.
ac_args() {
  case $1 in
    none) echo "--activation_checkpoint.mode none" ;;
    full) echo "--activation_checkpoint.mode full" ;;
    op) echo "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op" ;;
    layer) echo "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2" ;;
  esac
}
# ac_part PART PRECISION: AC none / full / op / layer under debug.deterministic, each against none.
ac_part() {
  local p=$1 precision=$2 ok=1 mode
  for mode in none full op layer; do
    # shellcheck disable=SC2046
    run "${p}_$mode" -- --training.steps 20 --debug.deterministic true --training.mixed_precision_param "$precision" \
      $(ac_args "$mode") && losses "$OUT/${p}_$mode/metrics.jsonl" >"$OUT/${p}_$mode.losses" || ok=0
  done
  ((ok)) || return 1
  for mode in full op layer; do
    report "($p) $precision, AC $mode vs none" "$OUT/${p}_$mode.losses" "$OUT/${p}_none.losses" 0 || return 1
  done
}
# sync_rule PART PRECISION WHAT [args...]: 12 steps logging every 6th, with CUDA's sync debug mode
# as errors (CTITAN_SYNC_CHECK=1) in the steps that log and save nothing (a synchronising
# operation fails the run, naming it) and the host reads traced: those steps must read nothing.
sync_rule() {
  local p=$1 precision=$2 what=$3 name="${1}_sync_$2" quiet
  shift 3
  run "$name" CTITAN_SYNC_CHECK=1 CTITAN_TRACE_HOST_READS="$OUT/$name.reads" -- --training.steps 12 \
    --metrics.log_freq 6 --training.mixed_precision_param "$precision" "$@" || return 1
  quiet=$(awk '$1 != 1 && $1 % 6 != 0 && $2 != 0' "$OUT/$name.reads.rank0" | wc -l)
  if ((quiet == 0)); then
    echo "($p) $precision: PASS: $what made no GPU synchronisation and read nothing back"
  else
    fail_line "($p) $precision FAIL: $quiet quiet steps read values back ($OUT/$name.reads.rank0)"
    return 1
  fi
}
part() { [[ " $PARTS " == *" $1 "* ]]; }

if part a; then
  log "(a) debug model, float32, 20 steps: GPU against CPU"
  run a_gpu -- --training.steps 20 && run a_cpu CUDA_VISIBLE_DEVICES= -- --training.steps 20 &&
    losses "$OUT/a_gpu/metrics.jsonl" >"$OUT/a_gpu.losses" && losses "$OUT/a_cpu/metrics.jsonl" >"$OUT/a_cpu.losses" &&
    report "(a) float32, GPU vs CPU" "$OUT/a_gpu.losses" "$OUT/a_cpu.losses" 1e-4 || status=1
fi

if part b; then
  log "(b) activation checkpointing none / full / op / layer on the GPU, float32, debug.deterministic"
  ac_part b float32 || status=1
fi

if part c; then
  log "(c) checkpoints: GPU → GPU (bitwise), GPU → CPU, CPU → GPU, debug.deterministic"
  ck=(--checkpoint.enable true --checkpoint.interval 5 --debug.deterministic true)
  if run c_gpu -- --training.steps 20 "${ck[@]}"; then
    losses "$OUT/c_gpu/metrics.jsonl" 11 20 >"$OUT/c_gpu.11-20"
    for dest in c_gpu_resume c_cpu_resume; do  # a copy of the GPU run's folder cut back to step 10
      rm -rf "$OUT/$dest.seed" && mkdir -p "$OUT/$dest.seed/checkpoint" &&
        cp -a "$OUT/c_gpu/checkpoint/step-10" "$OUT/$dest.seed/checkpoint/"
    done
    resume() { local name=$1; shift; rm -rf "$OUT/$name"; mkdir -p "$OUT/$name"; cp -a "$OUT/$name.seed/checkpoint" "$OUT/$name/";
               env "$@" "$TRAIN" "${debug[@]}" --job.dump_folder "$OUT/$name" --training.steps 20 "${ck[@]}" >"$OUT/$name.log" 2>&1; }
    if resume c_gpu_resume; then
      losses "$OUT/c_gpu_resume/metrics.jsonl" 11 20 >"$OUT/c_gpu_resume.11-20"
      report "(c) GPU step-10 → GPU" "$OUT/c_gpu_resume.11-20" "$OUT/c_gpu.11-20" 0 || status=1
    else fail_line "(c) FAIL: GPU resume: $(tail -1 "$OUT/c_gpu_resume.log")"; fi
    if resume c_cpu_resume CUDA_VISIBLE_DEVICES=; then
      losses "$OUT/c_cpu_resume/metrics.jsonl" 11 20 >"$OUT/c_cpu_resume.11-20"
      report "(c) GPU step-10 → CPU" "$OUT/c_cpu_resume.11-20" "$OUT/c_gpu.11-20" 1e-4 || status=1
      rm -rf "$OUT/c_back.seed" && mkdir -p "$OUT/c_back.seed/checkpoint" &&
        cp -a "$OUT/c_cpu_resume/checkpoint/step-15" "$OUT/c_back.seed/checkpoint/"
      if resume c_back; then
        losses "$OUT/c_back/metrics.jsonl" 16 20 >"$OUT/c_back.16-20"
        losses "$OUT/c_cpu_resume/metrics.jsonl" 16 20 >"$OUT/c_cpu_resume.16-20"
        report "(c) CPU step-15 → GPU" "$OUT/c_back.16-20" "$OUT/c_cpu_resume.16-20" 1e-4 || status=1
      else fail_line "(c) FAIL: GPU resume of the CPU checkpoint: $(tail -1 "$OUT/c_back.log")"; fi
    else fail_line "(c) FAIL: CPU resume: $(tail -1 "$OUT/c_cpu_resume.log")"; fi
  else
    fail_line "(c) FAIL: the GPU run"
  fi
fi

if part e; then
  log "(e) bf16 mixed precision on one GPU (FSDP's machinery over a group of one): AC none / full / op / layer, and against (a)"
  if ac_part e bfloat16; then
    if ! grep -q "mixed precision on one process: bfloat16" "$OUT/e_none.log"; then
      fail_line "(e) FAIL: e_none did not train in bf16: $(grep -m1 'mixed_precision\|mixed precision' "$OUT/e_none.log")"
    elif [[ -s "$OUT/a_gpu.losses" ]]; then
      report "(e) bf16 vs float32 (a), 20 steps" "$OUT/e_none.losses" "$OUT/a_gpu.losses" 5e-2 || status=1
    fi
  else
    status=1
  fi
fi

if part f; then
  log "(f) no host synchronisation inside a step: CUDA's sync debug mode as errors on steps that log and save nothing"
  for precision in float32 bfloat16; do
    sync_rule f "$precision" "steps 2-5, 7-11" || status=1
  done
fi

if part g; then
  log "(g) ctitan's own CUDA kernels against ATen's route: checked and timed, then 20 training steps with them"
  "$BUILD/gpu_kernel_check" >"$OUT/g_kernels.log" 2>&1
  rc=$?
  cat "$OUT/g_kernels.log"
  ((rc == 0)) || fail_line "(g) FAIL: gpu_kernel_check exited $rc: $(tail -1 "$OUT/g_kernels.log")"
  if run g_f32 CTITAN_GPU_KERNELS=ctitan -- --training.steps 20; then
    if ! grep -q "SwiGLU, RoPE, cross-entropy and AdamW: ctitan's own CUDA kernels" "$OUT/g_f32.log"; then
      fail_line "(g) FAIL: g_f32 did not say it ran ctitan's kernels: $(grep -m1 'SwiGLU, RoPE, cross-entropy and AdamW' "$OUT/g_f32.log")"
    elif [[ -s "$OUT/a_gpu.losses" ]]; then
      losses "$OUT/g_f32/metrics.jsonl" >"$OUT/g_f32.losses"
      report "(g) float32, ctitan's kernels vs ATen's (a)" "$OUT/g_f32.losses" "$OUT/a_gpu.losses" 1e-4 || status=1
    fi
  else
    status=1
  fi
  # bf16, as (e)'s AC-none run: the precision the kernels are for.
  # shellcheck disable=SC2046
  run_vs "$OUT/e_none.losses" 1e-2 "(g) bf16, ctitan's kernels vs ATen's (e, AC none)" g_bf16 CTITAN_GPU_KERNELS=ctitan -- \
    --training.steps 20 --debug.deterministic true --training.mixed_precision_param bfloat16 $(ac_args none)
fi

if part h; then
  log "(h) Mixtral (MoE) on the GPU, float32: against the CPU, and AC full against none"
  # The experts' split reads each block's counts on the host (models/mixtral/model.h): one copy
  # per block. A routing tie decided differently on the two devices would show here as a
  # jump in the loss, not as last-bit noise.
  if RUN_BASE=mixtral run h_gpu -- --training.steps 20 && RUN_BASE=mixtral run h_cpu CUDA_VISIBLE_DEVICES= -- --training.steps 20; then
    losses "$OUT/h_gpu/metrics.jsonl" >"$OUT/h_gpu.losses" && losses "$OUT/h_cpu/metrics.jsonl" >"$OUT/h_cpu.losses"
    report "(h) Mixtral float32, GPU vs CPU" "$OUT/h_gpu.losses" "$OUT/h_cpu.losses" 1e-4 || status=1
  else
    status=1
  fi
  ok=1
  for mode in none full; do
    # shellcheck disable=SC2046
    RUN_BASE=mixtral run "h_$mode" -- --training.steps 20 --debug.deterministic true $(ac_args "$mode") &&
      losses "$OUT/h_$mode/metrics.jsonl" >"$OUT/h_$mode.losses" || ok=0
  done
  if ((ok)); then
    report "(h) Mixtral float32, AC full vs none" "$OUT/h_full.losses" "$OUT/h_none.losses" 0 || status=1
  else
    status=1
  fi
  # bf16 mixed precision (FSDP's machinery over a group of one, as (e)), against float32.
  # shellcheck disable=SC2046
  RUN_BASE=mixtral run_vs "$OUT/h_none.losses" 5e-2 "(h) Mixtral bf16 vs float32, 20 steps" h_bf16 -- \
    --training.steps 20 --debug.deterministic true --training.mixed_precision_param bfloat16 $(ac_args none)
fi

if part i; then
  log "(i) training.cuda_graphs: the captured step replayed, against eager steps"
  graphs=(--training.cuda_graphs true)
  det=(--training.steps 20 --debug.deterministic true)
  captured() {  # NAME: the run said it captured its step, else a FAIL line
    grep -q "captured as a CUDA graph" "$OUT/$1.log" ||
      { fail_line "(i) FAIL: $1 did not capture its step: $(grep -m1 -i 'cuda graph' "$OUT/$1.log")"; return 1; }
  }
  # shellcheck disable=SC2046
  if run i_f32_eager CTITAN_GPU_KERNELS=ctitan -- "${det[@]}" &&
    losses "$OUT/i_f32_eager/metrics.jsonl" >"$OUT/i_f32_eager.losses"; then
    run_vs "$OUT/i_f32_eager.losses" 0 "(i) float32, graphs vs eager (ctitan's kernels)" i_f32_graphs \
      CTITAN_GPU_KERNELS=ctitan -- "${det[@]}" "${graphs[@]}" && captured i_f32_graphs
  else
    status=1
  fi
  # shellcheck disable=SC2046
  if run i_bf16_eager CTITAN_GPU_KERNELS=ctitan -- "${det[@]}" --training.mixed_precision_param bfloat16 \
    $(ac_args none) && losses "$OUT/i_bf16_eager/metrics.jsonl" >"$OUT/i_bf16_eager.losses"; then
    for mode in none full; do
      # shellcheck disable=SC2046
      run_vs "$OUT/i_bf16_eager.losses" 0 "(i) bf16, AC $mode, graphs vs eager AC none (ctitan's kernels)" \
        "i_bf16_graphs_$mode" CTITAN_GPU_KERNELS=ctitan -- "${det[@]}" --training.mixed_precision_param bfloat16 \
        $(ac_args "$mode") "${graphs[@]}" && captured "i_bf16_graphs_$mode"
    done
  else
    status=1
  fi
  # ATen's SwiGLU, RoPE and loss with the graph (its AdamW is ctitan's), against (a)'s float32.
  run_vs "$OUT/a_gpu.losses" 1e-4 "(i) float32, graphs with ATen's kernels vs (a)" i_aten_graphs -- \
    --training.steps 20 "${graphs[@]}" && captured i_aten_graphs
  for precision in float32 bfloat16; do
    sync_rule i "$precision" "replayed steps 4-5, 7-11" "${graphs[@]}" && captured "i_sync_$precision" || status=1
  done
fi

if part d; then
  log "(d) bench/gpu_bench.sh: ctitan against PyTorch eager and torch.compile (same PyTorch), bf16"
  TRAIN="$TRAIN" PY="$PY" CTITAN_BENCH_SHAPES="${CTITAN_GPU_BENCH_SHAPES:-8B_8L 8B_16L 150M}" \
    bench/gpu_bench.sh "$OUT/d" >"$OUT/d_table.md" 2>"$OUT/d.log"
  cat "$OUT/d_table.md"
  grep -E "device:|matmul peak" "$OUT/d/8B_8L.ctitan.log" >&2 2>/dev/null
  # Per shape: the attention kernel chosen (with each backend's timing) and how busy the GPU
  # was in the profiled step (bench/gpu_bench.sh's <shape>.ctitan.profile.txt).
  for f in "$OUT"/d/*.ctitan.log; do
    [[ -f $f ]] || continue
    shape=$(basename "$f" .ctitan.log)
    echo "(d) $shape: $(grep -m1 -o 'attention: .*' "$f"); $(grep -m1 '^GPU:' "$OUT/d/$shape.ctitan.profile.txt" 2>/dev/null)"
  done
  # (d) ran when the first shape has a ctitan number.
  awk -F'|' 'NR == 3 && $3 !~ /—/ {ok = 1} END {exit !ok}' "$OUT/d_table.md" ||
    fail_line "(d) FAIL: no ctitan number for the first shape: $(tail -1 "$OUT/d.log")"
fi
if ((status == 0)); then
  echo "gpu_check: PASS (parts $PARTS)"
else
  echo "gpu_check: FAIL in ${failed:-a part above} (each FAIL line above says why)"
fi
exit $status
