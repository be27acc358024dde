// The process environment ctitan reads, read once (the first call of runtime_env(), which
// train_main makes at start-up) — every variable that changes what ctitan does is here.
// The launcher's contract (RANK, WORLD_SIZE, MASTER_ADDR, ... in parallelisms/launch_env.h)
// is read at the same point, by the code that owns it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace ctitan {

// A fault-injection hook "<kind>:<rank>:<step>[:<detail>]" (tests make one rank misbehave
// at one step): CTITAN_FAULT (train.cpp), CTITAN_CHECKPOINT_FAULT (checkpoint saves).
struct FaultHook {
  std::string kind;
  int64_t rank = -1, step = -1;
  std::string detail;  // what follows the step, e.g. the phase of "oom:<rank>:<step>:<phase>"
  std::string spec;    // the variable's text, for messages
  bool at(int64_t r, int64_t s) const { return r == rank && s == step; }
};
// nullopt for an empty or malformed spec (a hook that never fires, as before).
std::optional<FaultHook> parse_fault_hook(const std::string& spec);

struct RuntimeEnv {
  std::string data_dir;                      // CTITAN_DATA_DIR: root of the corpora fetched by scripts/fetch_data.sh
  std::string spm_shim;                      // CTITAN_SPM_SHIM: path of libctitan_spm_shim.so
  std::string gemm;                          // CTITAN_GEMM: aten | mkl | onednn (kernels/gemm.h)
  std::string gpu_kernels;                   // CTITAN_GPU_KERNELS: aten | ctitan (kernels/fused_cuda.h)
  std::string cpu_allocator;                 // CTITAN_CPU_ALLOCATOR: "system" turns the caching allocator off
  std::optional<int64_t> cpu_cache_max_mib;  // CTITAN_CPU_CACHE_MAX_MIB: its cache's cap
  std::string omp_num_threads;               // OMP_NUM_THREADS
  std::string omp_wait_policy;               // OMP_WAIT_POLICY (train_main sets it before this is read)
  int64_t restart_count = 0;                 // TORCHELASTIC_RESTART_COUNT: torchrun's restarts so far
  double mfu_peak_tflops = 0;                // CTITAN_PEAK_TFLOPS: where metrics.mfu_peak_tflops is 0
  // Test hooks.
  std::optional<FaultHook> fault;             // CTITAN_FAULT (train.cpp)
  std::optional<FaultHook> checkpoint_fault;  // CTITAN_CHECKPOINT_FAULT (checkpoint/checkpoint.cpp)
  std::string checkpoint_dump_loaded;         // CTITAN_CHECKPOINT_DUMP_LOADED: folder to re-save a load into
  std::string trace_windows;                  // CTITAN_TRACE_WINDOWS: prefix of per-rank batch traces
  std::string trace_host_reads;               // CTITAN_TRACE_HOST_READS: prefix of per-rank read counts
  bool sync_check = false;                    // CTITAN_SYNC_CHECK: a GPU sync in a quiet step throws
  int64_t data_delay_ms = 0;                  // CTITAN_DATA_DELAY_MS: each DataLoader::next() sleeps this long first
};

// Read on the first call, then the same object for the life of the process.
const RuntimeEnv& runtime_env();
// Reads the environment again: for tests that change a variable in-process (not thread-safe
// against concurrent runtime_env() readers; call it before starting threads).
void reload_runtime_env();

}  // namespace ctitan
