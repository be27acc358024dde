#!/usr/bin/env bash
# Tokenizer encode speed, one thread: ctitan's HfTokenizer (bench/tokenizer_bench.cpp) beside
# Hugging Face tokenizers' own encode (bench/tokenizer_bench.py, RAYON_NUM_THREADS=1, one
# encode call per document, no encode_batch) on the same documents, with the same ids (the token
# totals must agree). Tokenizers: those scripts/make_hf_tokenizers.py trains (Llama 3 style,
# GPT-2 style, NFC). Each side runs twice, alternating; the better run is kept. Prints a
# Markdown table (docs/performance.md: "Tokenizer encode speed").
#
#   bench/tokenizer_bench.sh               # Moby-Dick and SOTU, 3 passes each
#   PASSES=5 CORPORA=sotu bench/tokenizer_bench.sh
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps >&2
ctitan_build tokenizer_bench >&2
"$CTITAN_ROOT/scripts/fetch_data.sh" all >&2
HF_DIR="${CTITAN_HF_TOKENIZERS_DIR:-$CTITAN_BUILD_DIR/hf_tokenizers}"
"$CTITAN_PYTHON" scripts/make_hf_tokenizers.py --out "$HF_DIR" --data "$CTITAN_DATA_DIR" >&2
PASSES="${PASSES:-3}"
CORPORA="${CORPORA:-moby_dick sotu}"

# The run (JSON line) with the higher steady tokens/s, its cold rate the better of the runs'.
best() {
  "$CTITAN_PYTHON" -c '
import json, sys
runs = [json.loads(l) for l in sys.argv[1].splitlines() if l.strip()]
top = max(runs, key=lambda r: r["tokens_per_s"])
top["cold_tokens_per_s"] = max(r["cold_tokens_per_s"] for r in runs)
print(json.dumps(top))' "$1"
}
field() { "$CTITAN_PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }

echo "| tokenizer | corpus | tokens | ctitan tok/s (cold / steady) | tokenizers tok/s (cold / steady) | ratio cold | ratio steady |"
echo "|---|---|---:|---:|---:|---:|---:|"
for corpus in $CORPORA; do
  case "$corpus" in
    moby_dick) src="$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" ;;
    sotu) src="$CTITAN_DATA_DIR/sotu" ;;
    *) echo "unknown corpus $corpus" >&2; exit 2 ;;
  esac
  for tok in llama3 gpt2 nfc; do
    # The sides alternate (ctitan, tokenizers, ctitan, tokenizers) and the better run of each
    # is kept: the machine may be shared, and load then hits both alike.
    c="" p=""
    for _ in 1 2; do
      c="$c$(OMP_NUM_THREADS=1 "$CTITAN_BUILD_DIR/tokenizer_bench" "$HF_DIR/$tok" "$src" "$PASSES")"$'\n'
      p="$p$(RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false "$CTITAN_PYTHON" bench/tokenizer_bench.py "$HF_DIR/$tok" "$src" "$PASSES")"$'\n'
    done
    c="$(best "$c")"; p="$(best "$p")"
    ct="$(field "$c" tokens)"; pt="$(field "$p" tokens)"
    if [[ "$ct" != "$pt" ]]; then
      echo "token totals differ for $tok on $corpus: ctitan $ct, tokenizers $pt" >&2
      exit 1
    fi
    "$CTITAN_PYTHON" - "$tok" "$corpus" "$c" "$p" <<'PY'
import json, sys
tok, corpus, c, p = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
m = lambda x: f"{x / 1e6:.2f} M"
print(f"| {tok} | {corpus} | {c['tokens']:,} | {m(c['cold_tokens_per_s'])} / {m(c['tokens_per_s'])} | "
      f"{m(p['cold_tokens_per_s'])} / {m(p['tokens_per_s'])} | "
      f"{c['cold_tokens_per_s'] / p['cold_tokens_per_s']:.1f}x | {c['tokens_per_s'] / p['tokens_per_s']:.1f}x |")
PY
  done
done
