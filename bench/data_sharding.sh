#!/usr/bin/env bash
# Data sharding across ranks (not a test). For a generated JSONL corpus of SIZES_MB (default
# "2048 205": 2 GB and ~200 MB, one file each, so 4 ranks cut it into byte ranges):
#
# 1. Reading: 4 processes at once, each reading and JSON-parsing its share of one pass
#    (dataloader_bench scan, no tokenizing): the corpus bytes each parsed and what the
#    kernel counted it reading (/proc/self/io rchar), summed over the 4, against the file's
#    size; beside the same for the interleaved reading of builds before (every rank reads the
#    whole stream and keeps every 4th document), measured in the same run for corpora up to
#    INTERLEAVED_MAX_MB (default 256; it reads 4x the corpus).
# 2. Training: `train`, debug model, 4 ranks (scripts/run_train.sh), STEPS steps on that
#    corpus: per rank the time from process start to its first batch, and its peak RSS
#    (VmHWM from the model's build on, which is before any document is read), and the data's
#    part of the start-up (loading the tokenizer, opening the corpus, reading the first batch,
#    as the rank logs them); first the same
#    on Moby-Dick (1.2 MB) as the reference for what start-up costs without a large corpus.
# The corpora live under ${CTITAN_BENCH_DIR:-/tmp} and are deleted afterwards.
#
#   bench/data_sharding.sh          # prints Markdown tables (docs/performance.md: "Data sharding")
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim dataloader_bench >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d "${CTITAN_BENCH_DIR:-/tmp}/ctitan_shard_bench.XXXXXX")"
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$OUT"' EXIT
SIZES_MB="${SIZES_MB:-2048 205}"
STEPS="${STEPS:-3}"
W=4

# A JSONL corpus of about $2 MB: Moby-Dick's paragraphs, numbered, in records of 1 to 8 of
# them, written until the size is reached.
make_corpus() {
  "$CTITAN_PYTHON" - "$1" "$2" <<'PY'
import json, sys
path, mb = sys.argv[1], int(sys.argv[2])
text = open("data/moby_dick/moby_dick.txt", encoding="utf-8").read()
paras = [p.strip() for p in text.split("\n\n") if p.strip()]
target, n, i = mb * 1024 * 1024, 0, 0
with open(path, "w", encoding="utf-8") as f:
    while f.tell() < target:
        k = 1 + i % 8
        doc = "\n\n".join(paras[(i * 7 + j) % len(paras)] for j in range(k))
        f.write(json.dumps({"text": f"[{i}] " + doc, "id": i}) + "\n")
        i += 1
PY
}

scan_table() {  # scan_table <corpus> <mode>
  local corpus=$1 mode=$2 r
  for ((r = 0; r < W; ++r)); do
    "$CTITAN_BUILD_DIR/dataloader_bench" scan "$corpus" $r $W "$mode" >"$OUT/scan_$mode.$r.json" &
  done
  wait
  "$CTITAN_PYTHON" - "$corpus" "$mode" "$OUT"/scan_"$mode".*.json <<'PY'
import json, os, sys
corpus, mode, files = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = [json.load(open(f)) for f in files]
size = os.path.getsize(corpus)
parsed = sum(r["bytes_parsed"] for r in rows)
rchar = sum(r["rchar"] for r in rows)
docs = sum(r["documents"] for r in rows)
print(f"| {size / 2**20:.0f} MiB | {mode} | {' / '.join(str(r['bytes_parsed']) for r in rows)} | "
      f"{parsed / size:.4f} | {rchar / size:.4f} | {docs} | {max(r['seconds'] for r in rows):.1f} |")
PY
}

train_table() {  # train_table <corpus>
  local corpus=$1 name
  name="train_$(basename "$corpus" | tr . _)"
  NPROC=$W "$CTITAN_ROOT/scripts/run_train.sh" --training.steps "$STEPS" --training.dataset_path "$corpus" \
    --metrics.log_freq 1 --job.dump_folder "$OUT/$name" >"$OUT/$name.log" 2>&1 \
    || { echo "bench: train on $corpus failed:" >&2; tail -20 "$OUT/$name.log" >&2; exit 1; }
  "$CTITAN_PYTHON" - "$corpus" "$OUT/$name"/logs/rank*.log <<'PY'
import os, re, sys
corpus, log = sys.argv[1], "".join(open(f).read() for f in sys.argv[2:])  # every rank's own log file
first = {int(r): float(s) for r, s in re.findall(r"\[rank(\d+)\].*first batch ready ([0-9.]+) s after main started", log)}
part = {int(r): float(a) + float(b) for r, a, b in
        re.findall(r"\[rank(\d+)\].*the data's part: ([0-9.]+) s opening the tokenizer and corpus, ([0-9.]+) s reading", log)}
data = {int(r): (int(b), float(m)) for r, b, m in
        re.findall(r"\[rank(\d+)\].*data: dp rank \d+ read (\d+) bytes of the corpus .* peak RSS (\d+) MiB", log)}
ranks = sorted(first)
print(f"| {os.path.getsize(corpus) / 2**20:.0f} MiB | "
      + " / ".join(f"{first[r]:.2f}" for r in ranks) + " | "
      + " / ".join(f"{part[r]:.3f}" for r in ranks) + " | "
      + " / ".join(f"{data[r][1]:.0f}" for r in ranks) + " | "
      + " / ".join(str(data[r][0]) for r in ranks) + " |")
PY
}

echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start"
echo
echo "| corpus | start to first batch s (rank 0/1/2/3) | of which the data's s | peak RSS MiB | corpus bytes read in $STEPS steps |"
echo "|---|---|---|---|---|"
train_table data/moby_dick/moby_dick.txt
for mb in $SIZES_MB; do
  corpus="$OUT/corpus_${mb}mb.jsonl"
  make_corpus "$corpus" "$mb"
  sync
  echo
  echo "corpus $corpus: $(stat -c %s "$corpus") bytes"
  echo
  echo "| corpus | reading | bytes parsed per rank | parsed / size | rchar / size | documents | slowest rank s |"
  echo "|---|---|---|---|---|---|---|"
  scan_table "$corpus" ranges
  ((mb > ${INTERLEAVED_MAX_MB:-256})) || scan_table "$corpus" interleaved
  echo
  echo "| corpus | start to first batch s (rank 0/1/2/3) | of which the data's s | peak RSS MiB | corpus bytes read in $STEPS steps |"
  echo "|---|---|---|---|---|"
  train_table "$corpus"
  rm -f "$corpus"
done
echo
echo "load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
