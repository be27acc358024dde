// The scheduler behind cuda_runtime.h here: a launch's blocks run one after another on the
// calling OS thread, each CUDA thread of a block a ucontext fiber with its own stack (after the
// first block, only if that block's threads reached a barrier). A fiber
// runs until it finishes or reaches a barrier (__syncthreads, or the two halves of a warp
// shuffle); when none can run, the scheduler releases a warp whose 32 lanes all wait at a
// shuffle, else the block when every thread waits at __syncthreads, else stops the process:
// some thread waits at a barrier that the others never reach (a barrier in divergent code).
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda_runtime.h"

uint3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
dim3 blockDim, gridDim;

// The bounds of the section every __shared__ variable is in (the linker's names for a section
// named like an identifier); weak: null when no kernel linked in has shared memory.
extern "C" char __start_ctitan_cuda_shared[] __attribute__((weak));
extern "C" char __stop_ctitan_cuda_shared[] __attribute__((weak));

namespace {

cudaError_t g_last_error = cudaSuccess;

// Before each block: shared memory holds no value a kernel may rely on.
void poison_shared_memory() {
  char* const begin = __start_ctitan_cuda_shared;
  char* const end = __stop_ctitan_cuda_shared;
  if (begin != nullptr && end > begin) std::memset(begin, 0xFF, static_cast<size_t>(end - begin));
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "[cuda_host] block %u, thread %u: %s\n", blockIdx.x, threadIdx.x, what);
  std::fflush(stderr);
  std::abort();
}

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  State state = State::Runnable;
};

constexpr size_t kStackBytes = 64 * 1024;

struct Grid {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  std::vector<std::array<uint64_t, 32>> lanes;  // a warp's shuffle values
  const std::function<void()>* body = nullptr;
  unsigned current = 0;
  bool barriers = false;  // a thread of this launch has reached a barrier
  bool direct = false;    // threads run straight through, without fibers
};

Grid* g_grid = nullptr;  // the grid being run (one at a time)

void fiber_entry() {
  Grid& g = *g_grid;
  (*g.body)();
  g.fibers[g.current].state = State::Done;  // uc_link switches back to the scheduler
}

// The calling fiber waits in state s until the scheduler releases it.
void wait_as(State s) {
  Grid* g = g_grid;
  if (g == nullptr) fail("a barrier outside a kernel");
  if (g->direct)
    fail(
        "a barrier in a block after the first, whose threads reached none: the host model runs such a launch's "
        "later blocks without fibers");
  g->barriers = true;
  Fiber& f = g->fibers[g->current];
  f.state = s;
  if (swapcontext(&f.context, &g->scheduler) != 0) fail("swapcontext failed");
}

unsigned warp_size_of(unsigned warp, unsigned threads) { return std::min(32u, threads - 32u * warp); }

// Nothing can run: release a warp at a shuffle or the block at __syncthreads, or stop.
void release_or_stop(Grid& g) {
  const unsigned n = static_cast<unsigned>(g.fibers.size());
  bool released = false;
  for (unsigned w = 0; w * 32 < n; ++w) {
    const unsigned first = 32 * w, size = warp_size_of(w, n);
    unsigned waiting = 0;
    for (unsigned t = first; t < first + size; ++t) waiting += g.fibers[t].state == State::AtWarpBarrier;
    if (waiting == 0) continue;
    if (waiting != size) {
      threadIdx.x = first;
      fail("a warp shuffle that not every lane of the warp reaches (divergent, or a lane has exited)");
    }
    for (unsigned t = first; t < first + size; ++t) g.fibers[t].state = State::Runnable;
    released = true;
  }
  if (released) return;
  unsigned at_block = 0, done = 0;
  for (const auto& f : g.fibers) {
    at_block += f.state == State::AtBlockBarrier;
    done += f.state == State::Done;
  }
  if (at_block == n) {
    for (auto& f : g.fibers) f.state = State::Runnable;
    return;
  }
  if (at_block > 0)
    fail("__syncthreads that not every thread of the block reaches (divergent, or a thread has exited)");
  if (done != n) fail("scheduler: no thread can run");  // unreachable: every other state is handled above
}

// Makes f start the kernel's body when next switched to.
__attribute__((noinline)) void start_fiber(Grid& g, Fiber& f) {
  f.state = State::Runnable;
  if (getcontext(&f.context) != 0) fail("getcontext failed");
  f.context.uc_stack.ss_sp = f.stack.get();
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = &g.scheduler;
  makecontext(&f.context, fiber_entry, 0);
}

// Runs thread t until it finishes or waits (its own function: the switch returns twice).
__attribute__((noinline)) void run_thread(Grid& g, unsigned t) {
  g.current = t;
  threadIdx = {t, 0, 0};
  if (swapcontext(&g.scheduler, &g.fibers[t].context) != 0) fail("swapcontext failed");
}

void run_block(Grid& g) {
  const unsigned n = static_cast<unsigned>(g.fibers.size());
  for (unsigned t = 0; t < n; ++t) start_fiber(g, g.fibers[t]);
  for (;;) {
    bool ran = false;
    for (unsigned t = 0; t < n; ++t) {
      if (g.fibers[t].state != State::Runnable) continue;
      run_thread(g, t);
      ran = true;
    }
    if (!ran) {
      bool all_done = true;
      for (const auto& f : g.fibers) all_done = all_done && f.state == State::Done;
      if (all_done) return;
      release_or_stop(g);
    }
  }
}

}  // namespace

cudaError_t cudaGetLastError() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  }
  return "unrecognized error code";
}

namespace ctitan::cuda_host {

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  static std::mutex one_grid_at_a_time;
  const std::lock_guard<std::mutex> lock(one_grid_at_a_time);
  // CUDA's limits: at most 1024 threads a block, grid.x below 2^31, y and z below 2^16. Only
  // one-dimensional launches are modelled.
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
      grid.y > 65535 || grid.z > 65535) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (block.y != 1 || block.z != 1 || grid.y != 1 || grid.z != 1) fail("only one-dimensional launches are modelled");
  Grid g;
  g.body = &body;
  g.fibers.resize(block.x);
  for (auto& f : g.fibers) f.stack = std::make_unique<char[]>(kStackBytes);
  g.lanes.resize((block.x + 31) / 32);
  blockDim = block;
  gridDim = grid;
  g_grid = &g;
  // The first block runs on fibers. When none of its threads reached a barrier (an element-wise
  // kernel), the other blocks run each thread straight through on this stack: the same order,
  // without the fibers' cost (a grid-stride launch has millions of threads).
  for (unsigned b = 0; b < grid.x; ++b) {
    blockIdx = {b, 0, 0};
    poison_shared_memory();
    if (!g.direct) {
      run_block(g);
      g.direct = !g.barriers;
      continue;
    }
    for (unsigned t = 0; t < block.x; ++t) {
      g.current = t;
      threadIdx = {t, 0, 0};
      body();
    }
  }
  g_grid = nullptr;
  threadIdx = {0, 0, 0};
  blockIdx = {0, 0, 0};
}

void sync_block() { wait_as(State::AtBlockBarrier); }

uint64_t shuffle_xor(unsigned mask, uint64_t bits, int lane_mask, int width) {
  if (g_grid == nullptr) fail("a warp shuffle outside a kernel");
  if (mask != 0xffffffffu || width != 32) fail("only full-warp shuffles (mask 0xffffffff, width 32) are modelled");
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const unsigned size = warp_size_of(warp, static_cast<unsigned>(g_grid->fibers.size()));
  const unsigned from = lane ^ static_cast<unsigned>(lane_mask & 31);
  if (size != 32 || from >= size) fail("a warp shuffle in a warp of fewer than 32 threads");
  g_grid->lanes[warp][lane] = bits;
  wait_as(State::AtWarpBarrier);  // every lane has written
  const uint64_t got = g_grid->lanes[warp][from];
  wait_as(State::AtWarpBarrier);  // every lane has read before any writes again
  return got;
}

}  // namespace ctitan::cuda_host
