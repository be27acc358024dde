#include "components/memory_estimate.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace ctitan {

// The matmul library's own memory: MKL's allocator keeps the packed operands of the GEMMs it
// has run (per thread, reused, never returned), and the first and largest of them are the MFU
// reference's 2048 × 2048 matrices (train.cpp measures the matmul peak before step 1). Their
// fp32 size, 3 · 2048² · 4 B = 48 MiB, matches what measured: the RSS after the measurement
// exceeds the RSS before by 44-50 MiB with MKL's allocator and by ~4 MiB with
// MKL_DISABLE_FAST_MM=1 (debug flavor, 1 and 2 ranks, bf16 and fp32).
constexpr double kMatmulWorkspaceBytes = 3.0 * 2048 * 2048 * 4;
// What training touches for the first time outside the heap: the pages of LibTorch's and
// MKL's code for backward and the optimizer, the worker threads' stacks and state. Measured:
// the RSS outside malloc's heap and mmapped blocks grows by 17-18 MiB from the model's build
// to the peak (debug and 150M flavors, one process; mallinfo2 against VmRSS).
constexpr double kKernelCodeBytes = 18.0 * 1024 * 1024;

MemoryEstimate estimate_memory(const MemoryModel& m, const MemoryRun& r, double base_bytes) {
  MemoryEstimate e;
  const double P = static_cast<double>(m.params), U = static_cast<double>(m.largest_unit);
  const double N = static_cast<double>(r.fsdp ? r.dp : 1), eb = static_cast<double>(r.compute_bytes);
  const double BT = static_cast<double>(r.batch) * static_cast<double>(r.seq);
  const double D = static_cast<double>(m.dim), Dkv = static_cast<double>(m.kv_dim), F = static_cast<double>(m.ffn);
  const double L = static_cast<double>(m.n_layers), V = static_cast<double>(m.vocab);
  e.base = base_bytes;
  e.workspace = kMatmulWorkspaceBytes + kKernelCodeBytes;
  // The training state: fp32 master weights, fp32 gradients, AdamW's two fp32 moments, each
  // this rank's 1/N of the rows. (zero_grad frees the gradients; backward makes them again
  // while the activations are being freed: counting both at once errs on the safe side.)
  e.params = 4 * P / N;
  e.grads = (r.compute_dtype_grads ? eb : 4.0) * P / N;
  e.optimizer = 8 * P / N;
  if (r.fsdp) {
    // Unsharded parameters in e bytes. A unit not resharded after forward keeps its copy
    // until its backward: "never" (one process's default) holds the whole model, "default"
    // the last unit (norm + output); besides those, the unit running and the one prefetched.
    const double kept = r.reshard_after_forward == "never"     ? P
                        : r.reshard_after_forward == "default" ? static_cast<double>(m.last_unit)
                                                               : 0.0;
    e.gathered = eb * kept + (r.reshard_after_forward == "never" ? 0.0 : 2 * eb * U);
    // Gradient reduction, per unit: its unsharded gradients (e·U; kept ones are the grads
    // above), and on N > 1 ranks the send buffer [N, S] and the received shard in fp32
    // (4U + 4U/N), two reductions in flight.
    e.gathered += (r.compute_dtype_grads ? 0.0 : eb * U) + (r.dp > 1 ? 2 * (4 * U + 4 * U / N) : 0.0);
  }
  // What one block keeps for backward, per token: its input and the two norms' outputs (3D),
  // q, k, v (D + 2·Dkv), the attention output (D), the FFN's w1, w3 and SwiGLU outputs (3F),
  // in e bytes; the residual sum (D) too. Full AC keeps each block's input only, plus one
  // block's activations while it is recomputed; selective keeps the matmul outputs of the
  // blocks it covers, about half.
  const double per_layer = BT * eb * (6 * D + 2 * Dkv + 3 * F);
  if (r.ac_mode == ACMode::Full)
    e.activations = L * BT * eb * D + per_layer;
  else if (r.ac_mode == ACMode::Selective)
    e.activations = 0.5 * L * per_layer + per_layer;
  else
    e.activations = L * per_layer;
  // The RoPE table (T·hd fp32) and the batch (two [B, T+1] int64) belong here too.
  e.activations += static_cast<double>(r.seq) * static_cast<double>(m.head_dim) * 4 + 2 * 8 * BT;
  e.logits = BT * V * (eb + 4);
  // A synchronous save writes each tensor from where it lives (measured: the peak RSS of a
  // debug and a 150M run saving every step equals the run's without checkpoints); an async
  // save first copies this rank's state, fp32 params and AdamW's moments, and keeps the copy.
  if (r.async_checkpoint) e.staging = 12 * P / N;
  return e;
}

static double meminfo_bytes(const char* key) {
  std::ifstream f("/proc/meminfo");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line))
    if (line.rfind(k, 0) == 0) return std::stod(line.substr(k.size())) * 1024.0;
  return 0;
}

double memory_available_per_rank(int64_t local_world_size, std::string* how) {
  const double ranks = static_cast<double>(local_world_size > 0 ? local_world_size : 1);
  double avail = meminfo_bytes("MemAvailable") / ranks;
  char buf[160];
  std::snprintf(buf, sizeof buf, "MemAvailable %.1f GiB / %lld rank(s) on this node", avail * ranks / (1 << 30),
                static_cast<long long>(ranks));
  std::string h = buf;
  std::ifstream cg("/sys/fs/cgroup/memory.max");
  std::string v;
  if (cg >> v && v != "max") {
    const double limit = std::stod(v) / ranks;
    if (limit < avail) {
      avail = limit;
      std::snprintf(buf, sizeof buf, "cgroup memory.max %.1f GiB / %lld rank(s)", limit * ranks / (1 << 30),
                    static_cast<long long>(ranks));
      h = buf;
    }
  }
  if (how) *how = h;
  return avail;
}

std::string describe(const MemoryEstimate& e) {
  const double G = 1024.0 * 1024.0 * 1024.0;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%.3f GiB (process %.2f + kernels' workspace and code %.2f + params %.2f + grads %.2f + AdamW %.2f + "
                "gathered units %.2f + activations "
                "%.2f + logits %.2f + checkpoint staging %.2f)",
                e.total() / G, e.base / G, e.workspace / G, e.params / G, e.grads / G, e.optimizer / G, e.gathered / G,
                e.activations / G, e.logits / G, e.staging / G);
  return buf;
}

}  // namespace ctitan
