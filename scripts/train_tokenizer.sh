#!/usr/bin/env bash
# Trains a sentencepiece tokenizer for ctitan with Debian's spm_train.
#
#   scripts/train_tokenizer.sh <corpus file or folder> <output.model> [vocab_size=2048]
#
# The corpus is read like training.dataset_path: a .txt file (blank-line-separated
# paragraphs), a .jsonl file (records with a "text" field), or a folder of them
# (non-recursive, sorted by name). Writes <output.model> and <output>.vocab.
#
# Settings (Llama-2-like): BPE, byte_fallback (any UTF-8 text encodes, nothing maps to
# <unk>), identity normalisation and no whitespace folding (decode(encode(x)) == x),
# digits split, character_coverage 1.0, ids unk=0 bos=1 eos=2, no pad piece (ctitan packs,
# it never pads). At most 2M lines are sampled with a fixed seed and one thread, so two
# runs on the same corpus give byte-identical models; the script is idempotent (it
# retrains and replaces the output atomically).
set -euo pipefail

log() { echo "[train_tokenizer] $*" >&2; }
die() { echo "[train_tokenizer] error: $*" >&2; exit 1; }

if [[ $# -lt 2 || $# -gt 3 || "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  echo "usage: $0 <corpus file or folder> <output.model> [vocab_size=2048]" >&2
  exit 2
fi
CORPUS="$1"
OUTPUT="$2"
VOCAB="${3:-2048}"

[[ "$VOCAB" =~ ^[0-9]+$ ]] || die "vocab_size '$VOCAB' is not a positive integer"
# 3 special pieces + 256 byte pieces are always there.
((VOCAB >= 300)) || die "vocab_size $VOCAB is too small: byte_fallback alone takes 259 pieces (use >= 300)"
[[ -e "$CORPUS" ]] || die "corpus $CORPUS does not exist (scripts/fetch_data.sh fetches moby_dick / sotu)"
[[ "$OUTPUT" == *.model ]] || die "output '$OUTPUT' should end in .model"
command -v spm_train >/dev/null 2>&1 || die "spm_train not found; run scripts/install_deps.sh (Debian package sentencepiece)"
command -v python3 >/dev/null 2>&1 || die "python3 not found (needed to read the corpus); apt-get install python3"

OUT_DIR="$(dirname "$OUTPUT")"
mkdir -p "$OUT_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# spm_train reads one "sentence" per line and skips lines longer than
# --max_sentence_length, so documents become lines, and long lines (an SOTU address is a
# single 30 KB line) are cut after sentence ends into pieces of at most ~2000 characters.
python3 - "$CORPUS" "$TMP/sentences.txt" <<'PY'
import json, os, re, sys

src, out_path = sys.argv[1], sys.argv[2]
if os.path.isdir(src):
    files = sorted(f for f in os.listdir(src)
                   if not f.startswith(".") and f.endswith((".txt", ".jsonl"))
                   and os.path.isfile(os.path.join(src, f)))
    files = [os.path.join(src, f) for f in files]
    if not files:
        sys.exit(f"[train_tokenizer] error: folder {src} holds no .txt or .jsonl files")
elif src.endswith((".txt", ".jsonl")):
    files = [src]
else:
    sys.exit(f"[train_tokenizer] error: {src} is neither a .txt/.jsonl file nor a folder")

MAX = 2000
def pieces(line):
    while len(line) > MAX:
        window = line[:MAX]
        cut = max(window.rfind(". "), window.rfind("? "), window.rfind("! "), window.rfind("; "))
        if cut < MAX // 4:
            cut = window.rfind(" ")
        if cut < MAX // 4:
            cut = MAX - 1
        yield line[:cut + 1]
        line = line[cut + 1:].lstrip(" ")
    if line.strip():
        yield line

lines = 0
with open(out_path, "w", encoding="utf-8", newline="\n") as out:
    for path in files:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            if path.endswith(".jsonl"):
                for n, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        text = json.loads(raw)["text"]
                        assert isinstance(text, str)
                    except Exception:
                        sys.exit(f"[train_tokenizer] error: {path}:{n}: not a JSON record with a string \"text\" field")
                    for l in text.replace("\r\n", "\n").split("\n"):
                        for p in pieces(l):
                            out.write(p + "\n"); lines += 1
            else:
                for l in f.read().replace("\r\n", "\n").split("\n"):
                    for p in pieces(l):
                        out.write(p + "\n"); lines += 1
if lines == 0:
    sys.exit(f"[train_tokenizer] error: {src} holds no text")
print(f"[train_tokenizer] {len(files)} file(s), {lines} lines of training text", file=sys.stderr)
PY

log "training BPE, vocab_size=$VOCAB (log: spm_train.log beside the model on failure)"
# Relative paths: the model records its training flags, and a temp folder's random name
# would make two runs differ.
if ! (cd "$TMP" && spm_train \
    --input=sentences.txt \
    --model_prefix=tok \
    --model_type=bpe \
    --vocab_size="$VOCAB" \
    --byte_fallback=true \
    --character_coverage=1.0 \
    --normalization_rule_name=identity \
    --remove_extra_whitespaces=false \
    --split_digits=true \
    --allow_whitespace_only_pieces=true \
    --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 \
    --max_sentence_length=16384 \
    --input_sentence_size=2000000 \
    --shuffle_input_sentence=true \
    --random_seed=1234 \
    --num_threads=1 \
    >spm_train.log 2>&1); then
  cp "$TMP/spm_train.log" "$OUT_DIR/spm_train.log"
  die "spm_train failed; last lines: $(tail -n 3 "$TMP/spm_train.log" | tr '\n' ' ') (full log: $OUT_DIR/spm_train.log)"
fi

VOCAB_OUT="${OUTPUT%.model}.vocab"
mv -f "$TMP/tok.vocab" "$VOCAB_OUT.partial"
mv -f "$TMP/tok.model" "$OUTPUT.partial"
mv -f "$VOCAB_OUT.partial" "$VOCAB_OUT"
mv -f "$OUTPUT.partial" "$OUTPUT"
log "wrote $OUTPUT ($(wc -l < "$VOCAB_OUT") pieces) and $VOCAB_OUT"
