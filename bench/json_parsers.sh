#!/usr/bin/env bash
# JSON parser choice (issue 15: "keep whichever is faster on the dataloader benchmark"): the
# per-document JSONL parse of the DataLoader, with ctitan's parser (util/json.h) and with
# nlohmann-json, over the same records (dataloader_bench json: both must extract the same
# "text"), best of REPEATS each, alternating. The corpus: the State of the Union addresses
# (data/sotu, one JSONL record per address, as scripts/fetch_data.sh writes them), their
# lines repeated to about SIZE_MB.
#
#   bench/json_parsers.sh        # prints one Markdown table row
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build dataloader_bench >&2
[[ -d "$CTITAN_DATA_DIR/sotu" ]] || "$CTITAN_ROOT/scripts/fetch_data.sh" sotu >&2
OUT="$(mktemp -d "${CTITAN_BENCH_DIR:-/tmp}/ctitan_json_bench.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
"$CTITAN_PYTHON" - "$CTITAN_DATA_DIR/sotu" "$OUT/corpus.jsonl" "${SIZE_MB:-64}" <<'PY'
import os, sys
src, path, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = [l for f in sorted(os.listdir(src)) for l in open(os.path.join(src, f), "rb") if l.strip()]
with open(path, "wb") as out:
    i = 0
    while out.tell() < mb << 20:
        out.write(lines[i % len(lines)].rstrip(b"\n") + b"\n")
        i += 1
PY
r=$("$CTITAN_BUILD_DIR/dataloader_bench" json "$OUT/corpus.jsonl" "${REPEATS:-3}")
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| corpus | records | ctitan util/json s | nlohmann-json s | nlohmann / ctitan |"
echo "|---|---|---|---|---|"
"$CTITAN_PYTHON" -c 'import json,sys; r=json.loads(sys.argv[1]); print("| sotu JSONL, %.0f MiB | %d | %.3f | %.3f | %.2f |" % (r["bytes"] / 2**20, r["lines"], r["ctitan_s"], r["nlohmann_s"], r["nlohmann_over_ctitan"]))' "$r"
