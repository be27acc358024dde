#!/usr/bin/env python3
"""GEMM micro-benchmark (not a test): the 33M model's projection shapes in the three layouts a
linear layer multiplies in (forward Y = X·Wᵀ, dX = dY·W, dW = dYᵀ·X), through ATen (torch.mm)
and through the plain GEMM entry points of the MKL that PyTorch's wheel links and exports
(sgemm_ for fp32, cblas_gemm_bf16bf16f32 for bf16) and of the oneDNN that scripts/install_deps.sh
puts in the venv (PyPI's onednn-cpu-gomp: dnnl_sgemm, dnnl_gemm_bf16bf16f32) — the two libraries
kernels/gemm.h chooses between — side by side in one process, best of 5 rounds each. Prints a
Markdown table. The machine is shared: read rows of one run against each other, and run it twice.

    .venv/bin/python bench/gemm_bench.py [--threads N] [--tokens 2048]
"""
import argparse
import ctypes
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tokens", type=int, default=2048)  # 33M: batch 4 × seq 512
args = p.parse_args()
torch.set_num_threads(args.threads)

# The symbols live in libtorch_cpu.so, already loaded by `import torch`.
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
i32, f32, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
lib.cblas_gemm_bf16bf16f32.argtypes = [i32, i32, i32, i32, i32, i32, f32, ptr, i32, ptr, i32, f32, ptr, i32]
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
# oneDNN: <venv>/lib/libdnnl.so.3, on the libgomp.so.1 torch already loaded (same soname).
dnnl = ctypes.CDLL(os.path.join(sys.prefix, "lib", "libdnnl.so.3"))
i64, char = ctypes.c_int64, ctypes.c_char
for fn in (dnnl.dnnl_sgemm, dnnl.dnnl_gemm_bf16bf16f32):
    fn.argtypes = [char, char, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]


def mkl_sgemm(ta, tb, m, n, k, a, lda, b, ldb, c, ldc):
    # Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
    def ref(v, t):
        return ctypes.byref(t(v))
    lib.sgemm_(ref(b"T" if tb else b"N", ctypes.c_char), ref(b"T" if ta else b"N", ctypes.c_char),
               ref(n, i32), ref(m, i32), ref(k, i32), ref(1.0, f32), ptr(b), ref(ldb, i32), ptr(a), ref(lda, i32),
               ref(0.0, f32), ptr(c), ref(ldc, i32))


def mkl_bf16(ta, tb, m, n, k, a, lda, b, ldb, c, ldc):
    lib.cblas_gemm_bf16bf16f32(ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS, m, n, k, 1.0,
                               a, lda, b, ldb, 0.0, c, ldc)


def onednn(fn):
    def call(ta, tb, m, n, k, a, lda, b, ldb, c, ldc):
        rc = fn(b"T" if ta else b"N", b"T" if tb else b"N", m, n, k, 1.0, a, lda, b, ldb, 0.0, c, ldc)
        assert rc == 0, f"oneDNN gemm {m}x{n}x{k}: status {rc}"
    return call


def onednn_runs(fn, dt):
    """False where this oneDNN has no kernel for dt on this CPU (status 3, dnnl_unimplemented:
    its bf16 GEMM needs AVX-512, absent on e.g. an AMD EPYC of the Zen 3 generation)."""
    a = torch.ones(16, 16).to(dt)
    c = torch.empty(16, 16)
    rc = fn(b"N", b"N", 16, 16, 16, 1.0, a.data_ptr(), 16, a.data_ptr(), 16, 0.0, c.data_ptr(), 16)
    assert rc in (0, 3), f"oneDNN gemm 16x16x16 ({dt}): status {rc}"
    return rc == 0


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
print(f"| layer | layout | m×k×n | dtype | ATen GFLOP/s | MKL GFLOP/s | oneDNN GFLOP/s | MKL / ATen | oneDNN / MKL |")
print("|---|---|---|---|---:|---:|---:|---:|---:|")
for dt in (torch.float32, torch.bfloat16):
    libs = [mkl_sgemm, onednn(dnnl.dnnl_sgemm)] if dt == torch.float32 else [mkl_bf16, onednn(dnnl.dnnl_gemm_bf16bf16f32)]
    if dt == torch.bfloat16 and not onednn_runs(dnnl.dnnl_gemm_bf16bf16f32, dt):
        print(f"| (oneDNN has no bf16 GEMM on this CPU: its rows say —) | | | | | | | | |")
        libs = libs[:1]
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
            t_aten = best_seconds(lambda: torch.mm(opa, opb, out=out))
            ref = opa.double() @ opb.double()
            t_lib = []
            for gemm in libs:
                c = torch.empty(m, n)
                t_lib.append(best_seconds(lambda: gemm(ta, tb, m, n, k, a.data_ptr(), a.shape[1], b.data_ptr(),
                                                       b.shape[1], c.data_ptr(), n)))
                err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
                assert err < (1e-5 if dt == torch.float32 else 1e-2), f"{name} {label}: GEMM result off by {err:.1e}"
            flop = 2.0 * m * n * k
            dnn = (f"{flop / t_lib[1] / 1e9:.0f}", f"{t_lib[0] / t_lib[1]:.2f}x") if len(t_lib) > 1 else ("—", "—")
            print(f"| {name} | {label} | {m}×{k}×{n} | {str(dt)[6:]} | {flop / t_aten / 1e9:.0f} | "
                  f"{flop / t_lib[0] / 1e9:.0f} | {dnn[0]} | {t_aten / t_lib[0]:.2f}x | {dnn[1]} |")
