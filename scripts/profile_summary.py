#!/usr/bin/env python3
"""Sums a ctitan profiler trace (profiling.enable_profiling) by op name.

  scripts/profile_summary.py outputs/profile_traces/iteration_10/rank0_trace.json [top=25]

Prints, per op name, calls and total wall time, largest first. Times of nested ops are
counted in their parents too (aten::linear contains aten::mm), so read leaf ops (aten::mm,
aten::copy_, aten::mul, ...) for where the time goes.
"""
import collections
import json
import sys


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(sys.argv[1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total = collections.defaultdict(float)
    calls = collections.Counter()
    begin = {}
    for e in events:  # complete events ("X") carry dur; B/E pairs are matched per thread
        ph = e.get("ph")
        if ph == "X":
            total[e["name"]] += float(e.get("dur", 0))
            calls[e["name"]] += 1
        elif ph == "B":
            begin.setdefault((e.get("tid"), e["name"]), []).append(float(e["ts"]))
        elif ph == "E":
            stack = begin.get((e.get("tid"), e["name"]))
            if stack:
                total[e["name"]] += float(e["ts"]) - stack.pop()
                calls[e["name"]] += 1
    width = max((len(n) for n in total), default=10)
    print(f"{'op':<{width}}  {'calls':>6}  {'total ms':>10}")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name:<{width}}  {calls[name]:>6}  {us / 1000:>10.1f}")


if __name__ == "__main__":
    main()
