#include "components/system.h"

#include "components/cpu_allocator.h"
#include "kernels/gemm.h"
#include "util/env.h"

#include <dlfcn.h>
#include <malloc.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

namespace ctitan {

BlasInfo detect_blas() {
  BlasInfo info;
  void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info dl{};
  if (sym && dladdr(sym, &dl) && dl.dli_fname) {
    char resolved[PATH_MAX];
    info.library = realpath(dl.dli_fname, resolved) ? resolved : dl.dli_fname;
  }
  // Debian installs netlib's reference BLAS as .../x86_64-linux-gnu/blas/libblas.so.3;
  // OpenBLAS, BLIS and MKL live in their own folders (openblas-pthread/, blis-.../).
  info.is_reference = info.library.find("/blas/libblas.so") != std::string::npos;
  return info;
}

BlasInfo check_blas_and_warn() {
  BlasInfo info = detect_blas();
  if (info.is_reference) {
    spdlog::warn(
        "BLAS: fp32 matmuls go through the reference BLAS ({}), ~60x slower than OpenBLAS. "
        "HINT: apt-get install libopenblas0-pthread (or: update-alternatives --config "
        "libblas.so.3-x86_64-linux-gnu)",
        info.library);
  } else {
    spdlog::info("BLAS: {}", info.library.empty() ? "(no sgemm_ symbol: LibTorch's own)" : info.library);
  }
  return info;
}

int configure_threads(int64_t local_world_size) {
  int n = 0;
  if (const std::string& env = runtime_env().omp_num_threads; !env.empty()) n = std::atoi(env.c_str());
  if (n <= 0) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    n = std::max(1, cores / static_cast<int>(std::max<int64_t>(1, local_world_size)));
  }
  torch::set_num_threads(n);
  // OpenBLAS sizes its own pool at load time; keep it in step with LibTorch's.
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(n);
  return n;
}

bool cpu_has_native_bf16() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream is(line);
    std::string flag;
    while (is >> flag)
      if (flag == "avx512_bf16" || flag == "amx_bf16") return true;
    return false;
  }
  return false;
}

static double read_status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) {
      std::istringstream is(line.substr(key.size()));
      double kib = 0;
      is >> kib;
      return kib;
    }
  }
  return 0.0;
}

double peak_rss_gib() { return read_status_kib("VmHWM") / (1024.0 * 1024.0); }
#ifdef CTITAN_SANITIZE
// AddressSanitizer's allocator replaces malloc (mallinfo2 then reports nothing); it keeps its
// own count (sanitizer/allocator_interface.h, which GCC 12 does not install).
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#endif

// Bytes malloc has handed out and not taken back (mmapped chunks included).
static double malloc_in_use_bytes() {
#ifdef CTITAN_SANITIZE
  return static_cast<double>(__sanitizer_get_current_allocated_bytes());
#else
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<double>(mi.uordblks + mi.hblkhd);
#endif
}

double heap_in_use_gib() {
  // Blocks the caching CPU allocator holds are malloc'ed but in no tensor.
  const double cached = static_cast<double>(cpu_allocator_stats().cached_bytes);
  return (malloc_in_use_bytes() - cached) / (1024.0 * 1024.0 * 1024.0);
}

double current_rss_gib() { return read_status_kib("VmRSS") / (1024.0 * 1024.0); }

int64_t process_rchar() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t v = 0;
  while (io >> key >> v)
    if (key == "rchar:") return v;
  return 0;
}

bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

double measure_matmul_peak_flops(const std::string& dtype) {
  torch::NoGradGuard no_grad;
  const auto st = dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat32;
  return gemm::best_product_rate(1024, [st](int64_t n) -> std::function<void()> {
    const auto a = torch::full({n, n}, 0.5).to(st), b = torch::full({n, n}, 0.5).to(st);  // no RNG drawn
    return [a, b] { torch::matmul(a, b); };
  });
}

}  // namespace ctitan
