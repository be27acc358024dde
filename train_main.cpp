// The train executable: process set-up, then ctitan::train_main (train.cpp).
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "components/cpu_allocator.h"
#include "kernels/gemm.h"
#include "train.h"
#include "util/env.h"

namespace {
// Whether the model's matmuls will run on a GEMM of oneDNN's or MKL's, on the OpenMP workers
// (a bad CTITAN_GEMM is reported by train_main; here it counts as "no").
bool gemm_on_openmp_workers() {
  try {
    return ctitan::gemm::backend() != ctitan::gemm::Backend::ATen;
  } catch (const std::exception&) {
    return false;
  }
}
}  // namespace

int main(int argc, char** argv) {
  // libgomp reads OMP_WAIT_POLICY when it is loaded, before main; unless the user chose a
  // policy, pick it by where the matmuls run (kernels/gemm.h) and start again, same pid:
  //  - oneDNN's or MKL's GEMM runs on the OpenMP workers themselves: libgomp's default (spin briefly,
  //    then sleep) saves a wake-up per back-to-back GEMM call (33M, 2 cores: +5-10% tok/s
  //    against PASSIVE, measured in fp32 and bf16);
  //  - on a LibTorch exporting neither (Debian's 1.13 sent fp32 matmuls to OpenBLAS), ATen's
  //    matmuls may run on a BLAS's own threads, which spinning OpenMP workers starve
  //    (OpenBLAS, debug model, 2 cores: 987 → 1,548 tokens/s with PASSIVE).
  if (ctitan::runtime_env().omp_wait_policy.empty() && !gemm_on_openmp_workers()) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
  }
  // A peer rank that dies closes its sockets; the next write to one (Gloo writes with plain
  // writev) would raise SIGPIPE, whose default action ends this rank silently, with no line
  // saying why (seen once: a surviving rank of a killed-during-save test exited with no
  // message). Ignored, the write fails with EPIPE and the collective's error names the rank,
  // as in PyTorch, whose interpreter ignores SIGPIPE for the same reason.
  signal(SIGPIPE, SIG_IGN);
  // Fixed mmap threshold: glibc otherwise raises it after large frees, so memory that
  // FSDP releases (full parameters after sharding, unsharded units after use) would stay
  // in the heap and in RSS instead of going back to the system.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // ...and the large blocks every step allocates again are cached instead of being mapped
  // and faulted in anew (components/cpu_allocator.h).
  ctitan::install_caching_cpu_allocator();
  const std::vector<std::string> args(argv + 1, argv + argc);
  return ctitan::train_main(args, std::cout, std::cerr);
}
