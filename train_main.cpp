// The train executable: process set-up, then ctitan::train_main (train.cpp).
#include <malloc.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "components/cpu_allocator.h"
#include "train.h"

int main(int argc, char** argv) {
  // libgomp reads OMP_WAIT_POLICY when it is loaded, before main. Its default lets idle
  // OpenMP workers spin, stealing the cores OpenBLAS's own threads need for the matmuls
  // (debug model, 2 cores: 987 → 1,548 tokens/s with PASSIVE). Set it and start again,
  // same pid, unless the user chose a policy.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
  }
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
