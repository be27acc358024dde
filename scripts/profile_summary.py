#!/usr/bin/env python3
"""Sums a ctitan profiler trace (profiling.enable_profiling) by op name.

  scripts/profile_summary.py outputs/profile_traces/iteration_10/rank0_trace.json [top=25]

Prints, per op name, calls and total wall time, largest first. Times of nested ops are
counted in their parents too (aten::linear contains aten::mm), so read leaf ops (aten::mm,
aten::copy_, aten::mul, ...) for where the time goes.

A GPU run's trace (Kineto, with CUDA activity) also holds the kernels ("cat": "kernel"): then
a second table sums GPU time by kernel, with each kernel's share, and a line says how much of
the span from the first kernel's start to the last one's end the GPU was busy (the rest is
the GPU waiting for the host).
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
    kernels = collections.defaultdict(float)
    kernel_calls = collections.Counter()
    intervals = []
    begin = {}
    for e in events:  # complete events ("X") carry dur; B/E pairs are matched per thread
        ph = e.get("ph")
        if ph == "X" and e.get("cat") == "kernel":
            kernels[e["name"]] += float(e.get("dur", 0))
            kernel_calls[e["name"]] += 1
            intervals.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
        elif ph == "X":
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
    if kernels:
        print_kernels(kernels, kernel_calls, intervals, top)


def print_kernels(kernels, calls, intervals, top):
    busy, end = 0.0, None
    for b, e in sorted(intervals):  # the union of the kernels' intervals
        if end is None or b > end:
            busy += e - b
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = max(e for _, e in intervals) - min(b for b, _ in intervals)
    summed = sum(kernels.values())
    print(f"\nGPU: {len(intervals)} kernels, {summed / 1000:.1f} ms of kernel time; busy {busy / 1000:.1f} ms of "
          f"the {span / 1000:.1f} ms from the first kernel to the last ({100 * busy / max(span, 1e-9):.1f}%)")
    width = min(90, max(len(n) for n in kernels))
    print(f"{'kernel':<{width}}  {'calls':>6}  {'total ms':>10}  {'share':>6}")
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name[:width]:<{width}}  {calls[name]:>6}  {us / 1000:>10.2f}  {100 * us / summed:>5.1f}%")


if __name__ == "__main__":
    main()
