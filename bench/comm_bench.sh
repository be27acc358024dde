#!/usr/bin/env bash
# Gloo collectives, native against LibTorch 1.13's workarounds (bench/comm_bench.cpp), on
# WORLD_SIZE ranks over loopback, one intra-op thread each. Prints a Markdown table.
#   bench/comm_bench.sh                      # 2 ranks, 4M-element buffers, 10 repetitions
#   WORLD_SIZE=4 NUMEL_M=16 REPS=5 bench/comm_bench.sh
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
ctitan_ensure_deps
ctitan_build comm_bench >&2
export WORLD_SIZE="${WORLD_SIZE:-2}" MASTER_ADDR=127.0.0.1
MASTER_PORT=$("$CTITAN_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
export MASTER_PORT
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
pids=()
for ((r = 0; r < WORLD_SIZE; ++r)); do
  RANK=$r "$CTITAN_BUILD_DIR/comm_bench" > "$OUT/rank$r.jsonl" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
"$CTITAN_PYTHON" - "$OUT/rank0.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{rows[0]['ranks']} ranks, {rows[0]['mib']:.0f} MiB fp32 unsharded buffer")
print("| collective | dtype | native ms (median / best) | 1.13 way ms (median / best) | 1.13 / native |")
print("|---|---|---:|---:|---:|")
by = {(r["op"], r["dtype"]): r for r in rows}
for op in ("all_gather", "reduce_scatter"):
    for dt in ("float32", "bfloat16"):
        n, o = by[(op + " native", dt)], by[(op + " 1.13", dt)]
        print(f"| {op} | {dt} | {n['median_ms']:.2f} / {n['best_ms']:.2f} | {o['median_ms']:.2f} / {o['best_ms']:.2f} | {o['median_ms'] / n['median_ms']:.2f}x |")
PY
