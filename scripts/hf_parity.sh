#!/usr/bin/env bash
# HF parity check of trained exports (not a unit test): train briefly on 2 FSDP ranks with
# checkpoint.last_save_in_hf, then compare ctitan's logits on a sentence of Moby-Dick with
# those of Hugging Face transformers' from_pretrained() of the export (scripts/hf_parity.py
# compare, the venv's transformers on PyTorch 2.13), and check that the consolidated .pt
# export, read by torch.load, holds the same tensors. Llama debug model, then Mixtral's.
# (Models saved by transformers itself, greedy generate and the export back:
# scripts/hf_parity.py roundtrip, run by test_checkpoint_hf's HFParity test.)
#
#   scripts/hf_parity.sh                # both models; exit 0 when every check passes
#   MODELS=llama3 scripts/hf_parity.sh  # one of them
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train checkpoint_tool ctitan_spm_shim >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
TOOL="$CTITAN_BUILD_DIR/checkpoint_tool"
TEXT="Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world."
TOKENS=$(echo "$TEXT" | spm_encode --model="$CTITAN_DEFAULT_TOKENIZER" --output_format=id | tr ' ' ',')

status=0
for model in ${MODELS:-llama3 mixtral}; do
  config=train_configs/debug_model.toml
  [[ $model == mixtral ]] && config=train_configs/mixtral_debug.toml
  dump="$OUT/$model"
  CONFIG_FILE=$config NPROC=2 "$CTITAN_ROOT/scripts/run_train.sh" --training.steps 20 --training.seq_len 64 \
    --training.local_batch_size 2 --lr_scheduler.warmup_steps 2 --metrics.log_freq 20 --debug.seed 3 \
    --checkpoint.enable --checkpoint.interval 1000 --checkpoint.last_save_in_hf \
    --job.dump_folder "$dump" >"$dump.log" 2>&1 \
    || { echo "hf_parity: training $model failed:" >&2; tail -20 "$dump.log" >&2; exit 1; }
  hf="$dump/checkpoint/step-20"
  "$TOOL" logits "$hf" "$TOKENS" "$OUT/$model.logits.safetensors" >/dev/null
  "$TOOL" convert "$hf" "$OUT/$model.pt" >/dev/null
  "$CTITAN_PYTHON" "$CTITAN_ROOT/scripts/hf_parity.py" compare --hf "$hf" --logits "$OUT/$model.logits.safetensors" \
    --pt "$OUT/$model.pt" || status=1
done
exit $status
