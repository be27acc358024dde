#!/usr/bin/env bash
# What a refactor must not change, written to one folder so that two builds can be compared
# with `diff -r`: the 17-digit losses of a deterministic 2-rank fp32 debug run that saves at
# step 10 and resumes to 20 (Llama and Mixtral), and the bytes of its HF and .pt exports.
#
#   scripts/behaviour_fingerprint.sh BUILD_DIR OUT_DIR
#   diff -r OUT_OLD/fingerprint OUT_NEW/fingerprint   # empty: behaviour unchanged
#
# BUILD_DIR's binaries run as they are (nothing is rebuilt), so an older build can be kept in
# a copied folder. OUT_DIR/runs keeps the checkpoint folders, so a newer build can be pointed at an older
# build's folders (checkpoints written before a change must load after it).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="$(realpath "${1:?build dir}")"
OUT="$(realpath -m "${2:?output dir}")"
mkdir -p "$OUT/fingerprint" "$OUT/runs"

run() {  # config name steps [extra overrides...]
  local cfg="$1" name="$2" steps="$3"
  shift 3
  CTITAN_BUILD_DIR="$BUILD" CTITAN_NO_BUILD=1 NPROC=2 ./scripts/run_train.sh >"$OUT/runs/$name.$steps.log" 2>&1 \
    --job.config_file "train_configs/$cfg.toml" --job.dump_folder "$OUT/runs/$name" \
    --training.steps "$steps" --training.deterministic --training.seed 7 \
    --training.mixed_precision_param float32 --checkpoint.enable --checkpoint.interval 10 \
    --checkpoint.last_save_model_only false \
    --metrics.log_freq 1 "$@"
}
losses() {  # every step's loss as printed in metrics.jsonl (17 digits)
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "loss" in r: print(r["step"], "%.17g" % r["loss"])' "$1"
}

for cfg in debug_model mixtral_debug; do
  rm -rf "$OUT/runs/$cfg"
  run "$cfg" "$cfg" 10
  run "$cfg" "$cfg" 20  # resumes from step-10
  metrics=$(find "$OUT/runs/$cfg" -name metrics.jsonl | head -1)
  losses "$metrics" >"$OUT/fingerprint/$cfg.losses"
  step=$(find "$OUT/runs/$cfg" -maxdepth 3 -type d -name step-20 | head -1)
  "$BUILD/checkpoint_tool" convert "$step" "$OUT/runs/$cfg.hf" --to hf >/dev/null
  "$BUILD/checkpoint_tool" export "$step" "$OUT/runs/$cfg.pt" >/dev/null
  (cd "$OUT/runs" && sha256sum "$cfg.pt" $(cd "$OUT/runs" && find "$cfg.hf" -type f | sort)) \
    >"$OUT/fingerprint/$cfg.exports.sha256"
done
wc -l "$OUT/fingerprint"/*
