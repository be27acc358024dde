#!/usr/bin/python3
"""GEMM micro-benchmark (not a test): the 33M model's projection shapes in the three layouts a
linear layer multiplies in (forward Y = X·Wᵀ, dX = dY·W, dW = dYᵀ·X), through ATen (torch.mm:
OpenBLAS for fp32, oneDNN's matmul primitive for bf16) and through the plain GEMM of the
libdnnl that LibTorch links (dnnl_sgemm / dnnl_gemm_bf16bf16f32, what models/gemm.h calls),
side by side in one process, best of 5 rounds each. Prints a Markdown table.

    /usr/bin/python3 bench/gemm_bench.py [--threads N] [--tokens 2048]
"""
import argparse
import ctypes
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tokens", type=int, default=2048)  # 33M: batch 4 × seq 512
args = p.parse_args()
torch.set_num_threads(args.threads)

dnnl = ctypes.CDLL("libdnnl.so.2")
i64, f32, ptr, ch = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_char
for fn in (dnnl.dnnl_sgemm, dnnl.dnnl_gemm_bf16bf16f32):
    fn.argtypes = [ch, ch, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]


def best_seconds(f, reps=10, rounds=5):
    f()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


M = args.tokens
# (name, in, out) of the 33M model's projections (dim 512, 4 kv heads of 64, FFN 1536, vocab 8192)
layers = [("wq/wo", 512, 512), ("wk/wv", 512, 256), ("w1/w3", 512, 1536), ("w2", 1536, 512), ("output", 512, 8192)]
print(f"| layer | layout | m×k×n | dtype | ATen GFLOP/s | oneDNN GEMM GFLOP/s | GEMM / ATen |")
print("|---|---|---|---|---:|---:|---:|")
for dt in (torch.float32, torch.bfloat16):
    gemm = dnnl.dnnl_sgemm if dt == torch.float32 else dnnl.dnnl_gemm_bf16bf16f32
    for name, fin, fout in layers:
        x = torch.randn(M, fin).to(dt)
        w = torch.randn(fout, fin).to(dt)
        g = torch.randn(M, fout).to(dt)
        # layout: (label, A, transA, B, transB, m, k, n); A and B are the stored row-major tensors
        cases = [("Y = X·Wᵀ", x, False, w, True, M, fin, fout),
                 ("dX = dY·W", g, False, w, False, M, fout, fin),
                 ("dW = dYᵀ·X", g, True, x, False, fout, M, fin)]
        for label, a, ta, b, tb, m, k, n in cases:
            opa, opb = (a.t() if ta else a), (b.t() if tb else b)
            out = torch.empty(m, n, dtype=dt)
            c = torch.empty(m, n)
            t_aten = best_seconds(lambda: torch.mm(opa, opb, out=out))
            t_gemm = best_seconds(lambda: gemm(b"T" if ta else b"N", b"T" if tb else b"N", m, n, k, 1.0,
                                               a.data_ptr(), a.shape[1], b.data_ptr(), b.shape[1], 0.0,
                                               c.data_ptr(), n))
            flop = 2.0 * m * n * k
            print(f"| {name} | {label} | {m}×{k}×{n} | {str(dt)[6:]} | {flop / t_aten / 1e9:.0f} | "
                  f"{flop / t_gemm / 1e9:.0f} | {t_aten / t_gemm:.2f}x |")
