// FSDP's two collectives on Gloo (LibTorch 2.x), each done two ways in one run:
//   native — Gloo's flat all-gather (_allgather_base) and reduce-scatter (_reduce_scatter_base),
//            bf16 on the wire as bf16 (what parallelisms/comm.cpp uses);
//   1.13   — what LibTorch 1.13's Gloo forced: a list all-gather into views of one buffer,
//            and alltoall_base plus a local sum of the N received chunks; bf16 moved as a
//            16-bit type Gloo knew (fp16 bits; the sum then needs bf16 arithmetic after it).
// Prints one JSON line per (collective, dtype, way) on rank 0: median and best ms of REPS.
//
//   bench/comm_bench.sh   (starts WORLD_SIZE ranks of this program on loopback)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

namespace {

using Backend = c10::intrusive_ptr<c10d::Backend>;

int env_int(const char* name, int def) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : def;
}

// ms per call: median and best of `reps` (after one warm-up), all ranks in step.
template <class F>
std::pair<double, double> time_it(const Backend& pg, int reps, F f) {
  f();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    std::vector<at::Tensor> sync{at::zeros({1})};
    pg->allreduce(sync)->wait();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

void all_gather_native(const Backend& pg, at::Tensor in, at::Tensor out) { pg->_allgather_base(out, in)->wait(); }

void all_gather_113(const Backend& pg, at::Tensor in, at::Tensor out, int64_t n) {
  const bool bf16 = in.scalar_type() == at::kBFloat16;
  auto flat = (bf16 ? out.view(at::kHalf) : out).view({n, in.numel()});
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int64_t r = 0; r < n; ++r) outs[0].push_back(flat[r]);
  std::vector<at::Tensor> ins{bf16 ? in.view(at::kHalf) : in};
  pg->allgather(outs, ins)->wait();
}

void reduce_scatter_native(const Backend& pg, at::Tensor in, at::Tensor out) {
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  pg->_reduce_scatter_base(out, in, o)->wait();
}

void reduce_scatter_113(const Backend& pg, at::Tensor in, at::Tensor out, int64_t n) {
  const bool bf16 = in.scalar_type() == at::kBFloat16;
  auto recv = at::empty_like(in);
  std::vector<int64_t> splits(n, out.numel());
  auto r = bf16 ? recv.view(at::kHalf) : recv;
  auto s = bf16 ? in.view(at::kHalf) : in;
  pg->alltoall_base(r, s, splits, splits)->wait();
  at::sum_out(out, recv.view({n, out.numel()}), {0});
}

}  // namespace

int main() {
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 2);
  const int reps = env_int("REPS", 10);
  const int64_t numel = int64_t{env_int("NUMEL_M", 4)} << 20;  // elements per unsharded buffer
  at::set_num_threads(1);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env_int("MASTER_PORT", 29500));
  so.isServer = rank == 0;
  so.numWorkers = world;
  auto store =
      c10::make_intrusive<c10d::TCPStore>(std::getenv("MASTER_ADDR") ? std::getenv("MASTER_ADDR") : "127.0.0.1", so);
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->threads = 2;
  Backend pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);

  const int64_t shard = numel / world;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const char* dn = dtype == at::kFloat ? "float32" : "bfloat16";
    auto full = at::randn({shard * world}).to(dtype), part = at::randn({shard}).to(dtype);
    auto out_full = at::empty_like(full), out_part = at::empty_like(part);
    // The two ways must agree before they are timed (the sum order may differ: tolerance).
    reduce_scatter_native(pg, full, out_part);
    auto ref = out_part.clone();
    reduce_scatter_113(pg, full, out_part, world);
    // fp32: the same sum up to ordering; bf16: each way rounds its partial sums to bf16.
    const double tol = dtype == at::kFloat ? 1e-5 : 0.1;
    const double diff = (ref.to(at::kFloat) - out_part.to(at::kFloat)).abs().max().item<double>();
    TORCH_CHECK(diff <= tol, "reduce-scatter ways differ by ", diff, " (", dn, ")");
    all_gather_native(pg, part, out_full);
    ref = out_full.clone();
    all_gather_113(pg, part, out_full, world);
    TORCH_CHECK(at::equal(ref, out_full), "all-gather ways differ");

    const std::pair<std::string, std::pair<double, double>> rows[] = {
        {"all_gather native", time_it(pg, reps, [&] { all_gather_native(pg, part, out_full); })},
        {"all_gather 1.13", time_it(pg, reps, [&] { all_gather_113(pg, part, out_full, world); })},
        {"reduce_scatter native", time_it(pg, reps, [&] { reduce_scatter_native(pg, full, out_part); })},
        {"reduce_scatter 1.13", time_it(pg, reps, [&] { reduce_scatter_113(pg, full, out_part, world); })},
    };
    if (rank == 0)
      for (const auto& [what, t] : rows)
        std::printf(
            "{\"op\": \"%s\", \"dtype\": \"%s\", \"ranks\": %d, \"mib\": %.1f, \"median_ms\": %.2f, \"best_ms\": "
            "%.2f}\n",
            what.c_str(), dn, world, numel * full.element_size() / 1048576.0, t.first, t.second);
  }
  return 0;
}
