// Facts about the process and the machine that training reports or depends on.
#pragma once
#include <cstdint>
#include <string>

namespace ctitan {

struct BlasInfo {
  std::string library;        // resolved path of the library that provides sgemm_
  bool is_reference = false;  // netlib's reference BLAS: ~60x slower fp32 matmul
};

// Finds which BLAS LibTorch's fp32 matmuls go through (Debian's LibTorch calls the
// system libblas.so.3, an update-alternatives link).
BlasInfo detect_blas();

// Logs a warning with the fix when the reference BLAS is active. Returns the info.
BlasInfo check_blas_and_warn();

// Intra-op threads for this rank: $OMP_NUM_THREADS when set, else the cores of this node
// divided by the ranks on it (so ranks do not oversubscribe the cores). Applies it to
// LibTorch and to OpenBLAS (when that is the active BLAS) and returns it.
int configure_threads(int64_t local_world_size);

// True when the CPU computes bf16 matmuls natively (AVX512-BF16 or AMX-BF16 in
// /proc/cpuinfo): bf16 mixed precision then pays off on one process too.
bool cpu_has_native_bf16();

// Peak resident set size of this process so far, in GiB (VmHWM).
double peak_rss_gib();
// Current resident set size, in GiB (VmRSS).
double current_rss_gib();
// Bytes this process has read through read(2) and friends (/proc/self/io rchar), 0 if
// unknown. It counts what the process did before an exec and what its reaped children read.
int64_t process_rchar();
// Starts VmHWM over from the current RSS (writes 5 to /proc/self/clear_refs), so a later
// peak_rss_gib() is the peak of what came after. False where the kernel refuses.
bool reset_peak_rss();
// Bytes of heap in use (malloc'ed and not freed, mmapped chunks included, blocks the caching
// CPU allocator holds excluded), in GiB. The
// growth across a forward pass is the memory autograd keeps for backward.
double heap_in_use_gib();

// Measures the dense matmul throughput of this process's threads (FLOP/s) with a few
// square matmuls of the given dtype ("float32" or "bfloat16"); takes ~0.2-0.5 s.
double measure_matmul_peak_flops(const std::string& dtype);

}  // namespace ctitan
