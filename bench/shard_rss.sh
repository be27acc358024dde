#!/usr/bin/env bash
# Peak RSS while reading pre-tokenized shards (not a test): a synthetic .ctok shard of 1 GiB
# of token ids and one of ~96 MiB (random ids below 2048, documents of 1000 tokens, the header
# of a shard that `tokenize` made from Moby-Dick with the default tokenizer, so the hash
# check passes), each read for SECONDS (default 20) by dataloader_bench (seq 2048, batch 8:
# several passes), under /usr/bin/time. The loader maps shards and hands back the pages it has
# left 64 MiB behind; without that, the whole file would count in RSS once read. The files are
# deleted afterwards.
#
#   bench/shard_rss.sh        # prints a Markdown table (docs/performance.md: "Data sharding")
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build tokenize dataloader_bench ctitan_spm_shim >&2
ctitan_ensure_default_corpus
OUT="$(mktemp -d "${CTITAN_BENCH_DIR:-/tmp}/ctitan_shard_rss.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
TOK=data/tokenizers/moby_dick_2048.model
"$CTITAN_BUILD_DIR/tokenize" --tokenizer "$TOK" --output "$OUT/md" data/moby_dick/moby_dick.txt >&2
"$CTITAN_PYTHON" - "$OUT/md/moby_dick.txt.ctok" "$OUT" <<'PY'
import os, random, struct, sys
header = bytearray(open(sys.argv[1], "rb").read(128))
rnd = random.Random(1)
chunk = bytearray(rnd.getrandbits(8) for _ in range(1 << 20))
for i in range(1, len(chunk), 2):
    chunk[i] &= 0x07  # little-endian uint16 ids below 2048
for name, tokens in (("big", 512 << 20), ("small", 48 << 20)):
    os.makedirs(f"{sys.argv[2]}/{name}")
    offs, total = [0], 0
    with open(f"{sys.argv[2]}/{name}/{name}.ctok", "wb") as f:
        f.write(bytes(128))
        while total < tokens:
            f.write(chunk)
            offs += [total + k for k in range(1000, len(chunk) // 2 + 1, 1000)]
            total += len(chunk) // 2
            if offs[-1] != total:
                offs.append(total)
        f.write(struct.pack(f"<{len(offs)}Q", *offs))
        struct.pack_into("<QQ", header, 32, len(offs) - 1, total)
        f.seek(0)
        f.write(header)
PY
echo "| shard | size MiB | passes in ${SECONDS_RUN:=20} s | tokens/s | peak RSS MiB |"
echo "|---|---|---|---|---|"
for name in big small; do
  f="$OUT/$name/$name.ctok"
  /usr/bin/time -f "%M" -o "$OUT/rss" "$CTITAN_BUILD_DIR/dataloader_bench" "$TOK" "$OUT/$name" 2048 8 "$SECONDS_RUN" >"$OUT/out"
  "$CTITAN_PYTHON" -c '
import json, os, sys
name, out, path, rss = sys.argv[1:5]
r = json.loads([l for l in open(out) if l.startswith("{")][-1])
kib = int(open(rss).read())
print("| %s | %.0f | %d | %.3g | %.0f |" % (name, os.path.getsize(path) / 2**20, r["epochs"], r["tokens_per_s"], kib / 1024))' \
    "$name" "$OUT/out" "$f" "$OUT/rss"
done
