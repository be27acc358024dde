// What a model tells activation checkpointing (AC) about its forward, without knowing AC.
//
// AC (parallelisms/activation_checkpoint.cpp) runs a checkpointed unit twice: once in the
// forward, without autograd, keeping only the unit's input; once more in backward (the
// "recompute"), with autograd, to get the gradients. Three things a forward does must not
// simply happen again in the recompute; models mark them with the calls below, which are
// plain calls (no cost beyond one thread-local read) when no checkpointed unit is running:
//
//  1. Decisions. Whatever the forward decided from data — a MoE router's expert indices
//     and tokens-per-expert counts — must be reused, not re-decided: logits that differ in
//     the last bit during the recompute could pick other experts and change shapes or,
//     worse, the gradients silently. decide() runs its function in the forward and hands
//     back the very same tensors, in the same order, in the recompute without running it.
//     Decide only tensors that need no gradient (indices, counts, masks); compute the
//     differentiable parts (e.g. the routing weights, gathered with the reused indices)
//     outside decide() so the recompute differentiates them.
//
//       auto idx = recompute::decide([&] { return std::get<1>(scores.topk(k, -1)); });
//
//  2. State updates. Counters, running statistics, caches, load-balancing bookkeeping:
//     apply them once per forward, not again in the recompute. They may use ATen ops (a
//     buffer on a GPU is updated by one): AC does not count what they produce among the
//     tensors the recompute must produce again.
//
//       recompute::unless_recomputing([&] { tokens_per_expert.add_(counts); });
//
//  3. Matmuls. Every projection goes through recompute::linear(x, w) (Linear does). With
//     op-level selective AC the forward keeps some of their outputs and the recompute
//     reuses them, with the same gradients, instead of multiplying again.
//
// Models never include parallelisms/: AC implements the Context below and installs it
// (thread-locally) around a checkpointed unit's forward and its recompute. Training-mode
// forwards keep no KV cache, so there is no cache state to guard.
#pragma once
#include <functional>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>
#include "kernels/gemm.h"

namespace ctitan::recompute {

// Implemented by activation checkpointing; active only while a checkpointed unit runs.
class Context {
 public:
  virtual ~Context() = default;
  // False in the unit's (no-grad) forward, true in its recompute during backward.
  virtual bool recomputing() const = 0;
  // y = x W^T for x [..., in], w [out, in] (the op-level SAC policy may keep/reuse y).
  virtual at::Tensor linear(const at::Tensor& x, const at::Tensor& w) = 0;
  // Forward: runs f and keeps its tensors. Recompute: returns the kept ones, f not run.
  virtual std::vector<at::Tensor> decide(const std::function<std::vector<at::Tensor>()>& f) = 0;
  // Forward: runs f, its ops left out of the determinism check. Recompute: nothing.
  virtual void state_update(const std::function<void()>& f) = 0;
};

// The context of the unit running on this thread, or nullptr.
inline Context*& current_context() {
  static thread_local Context* ctx = nullptr;
  return ctx;
}

// Installs a context for a scope (used by AC; nests).
class ContextGuard {
 public:
  explicit ContextGuard(Context* c) : prev_(current_context()) { current_context() = c; }
  ~ContextGuard() { current_context() = prev_; }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  Context* prev_;
};

// True while a checkpointed unit is being recomputed in backward.
inline bool in_recompute() {
  const Context* c = current_context();
  return c != nullptr && c->recomputing();
}

// Runs f (state updates) unless this is a recompute, so it happens once per forward.
template <class F>
void unless_recomputing(F&& f) {
  Context* c = current_context();
  if (c == nullptr)
    std::forward<F>(f)();
  else
    c->state_update(std::function<void()>(std::forward<F>(f)));
}

// Decisions made once in the forward and replayed, in order, by a recompute.
inline std::vector<at::Tensor> decide_all(const std::function<std::vector<at::Tensor>()>& f) {
  Context* c = current_context();
  return c ? c->decide(f) : f();
}
inline at::Tensor decide(const std::function<at::Tensor()>& f) {
  return decide_all([&f] { return std::vector<at::Tensor>{f()}; }).at(0);
}

// x [..., in], w [out, in] -> [..., out]: the matmul site of every projection.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  Context* c = current_context();
  return c ? c->linear(x, w) : gemm::linear(x, w);
}

}  // namespace ctitan::recompute
