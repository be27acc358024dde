#include "util/env.h"

#include <cstdio>
#include <cstdlib>

namespace ctitan {
namespace {

std::string var(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

RuntimeEnv read_env() {
  RuntimeEnv e;
  e.data_dir = var("CTITAN_DATA_DIR");
  e.spm_shim = var("CTITAN_SPM_SHIM");
  e.gemm = var("CTITAN_GEMM");
  e.gpu_kernels = var("CTITAN_GPU_KERNELS");
  e.cpu_allocator = var("CTITAN_CPU_ALLOCATOR");
  if (const char* v = std::getenv("CTITAN_CPU_CACHE_MAX_MIB")) e.cpu_cache_max_mib = std::atoll(v);
  e.omp_num_threads = var("OMP_NUM_THREADS");
  e.omp_wait_policy = var("OMP_WAIT_POLICY");
  e.restart_count = std::atoll(var("TORCHELASTIC_RESTART_COUNT").c_str());
  e.mfu_peak_tflops = std::atof(var("CTITAN_PEAK_TFLOPS").c_str());
  e.fault = parse_fault_hook(var("CTITAN_FAULT"));
  e.checkpoint_fault = parse_fault_hook(var("CTITAN_CHECKPOINT_FAULT"));
  e.checkpoint_dump_loaded = var("CTITAN_CHECKPOINT_DUMP_LOADED");
  e.trace_windows = var("CTITAN_TRACE_WINDOWS");
  e.trace_host_reads = var("CTITAN_TRACE_HOST_READS");
  e.sync_check = !var("CTITAN_SYNC_CHECK").empty();
  e.data_delay_ms = std::atoll(var("CTITAN_DATA_DELAY_MS").c_str());
  return e;
}

RuntimeEnv& env_slot() {
  static RuntimeEnv e = read_env();
  return e;
}

}  // namespace

std::optional<FaultHook> parse_fault_hook(const std::string& spec) {
  char kind[16] = {0}, detail[64] = {0};
  long r = -1, s = -1;
  const int n = std::sscanf(spec.c_str(), "%15[^:]:%ld:%ld:%63[^\n]", kind, &r, &s, detail);
  if (n < 3) return std::nullopt;
  return FaultHook{kind, r, s, detail, spec};
}

const RuntimeEnv& runtime_env() { return env_slot(); }

void reload_runtime_env() { env_slot() = read_env(); }

}  // namespace ctitan
