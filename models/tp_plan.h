// How a model lets tensor parallelism, applied from outside, split its layers: torchtitan's
// parallelize_module plan (module name → ColwiseParallel, RowwiseParallel, …) as data. The
// model names each layer's style and exposes the layer's hooks; parallelisms/tensor_parallel
// cuts the parameters and fills the hooks with its collectives. The model never includes
// parallelisms/ (the third seam beside unit_runner.h and recompute.h, headers only).
//
// The plan is Megatron's with sequence parallelism, as torchtitan's apply_tp lays it out:
// between blocks every tp rank holds 1/tp of the sequence (the residual stream and the norms);
// a block's attention and feed-forward gather the whole sequence first, compute on their share
// of the heads / hidden units, and reduce-scatter the sum back to sequence shards.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

namespace ctitan {

// Code run around one layer's forward by a transform applied from outside; either may be empty.
struct LayerHooks {
  // Rewrites the layer's input before it computes.
  std::function<at::Tensor(const at::Tensor& input)> input;
  // Rewrites its result; `input` is the input as the layer was called with it (before `input`).
  std::function<at::Tensor(const at::Tensor& input, const at::Tensor& output)> output;

  at::Tensor pre(const at::Tensor& x) const { return input ? input(x) : x; }
  at::Tensor post(const at::Tensor& x, const at::Tensor& y) const { return output ? output(x, y) : y; }
};

enum class TPStyle {
  // A projection y = x W^T, W [out, in], whose output units are split: rank r holds rows
  // [r·out/tp, (r+1)·out/tp) of W. Input: the whole sequence; output: r's share of the units.
  Colwise,
  // Its input units split: columns [r·in/tp, …) of W. The outputs are partial sums, summed
  // over the tp group and scattered over the sequence (a reduce-scatter).
  Rowwise,
  // The token embedding, W [V, D], its rows (the vocabulary) split; tokens outside a rank's
  // rows look up zeros, and the sum over ranks is scattered over the sequence.
  VocabEmbedding,
  // A module that needs the whole sequence (attention, feed-forward): its input, sequence
  // shards, is all-gathered over the tp group first. No parameters of its own.
  GatherInput,
  // The output projection W [V, D]: input gathered over the sequence, rows (vocabulary) split.
  // With loss parallelism the logits stay split over the vocabulary; without, they are gathered.
  OutputColwise,
  // Parameters every tp rank holds whole (the norms, which run on sequence shards; a MoE
  // router): their gradients are partial and summed over the tp group after backward.
  Replicated,
  // A module that needs the whole sequence and returns partial sums (a mixture of experts,
  // whose experts are split): input all-gathered over the sequence, output reduce-scattered.
  GatherInputScatterOutput,
  // Grouped experts [E, out, in] (one projection per expert): split as Colwise / Rowwise are,
  // on the output units (dim 1) or the input units (dim 2) of every expert.
  GroupedColwise,
  GroupedRowwise,
};

struct TPEntry {
  TPEntry(std::string module_, TPStyle style_, LayerHooks* hooks_, std::vector<std::string> params_,
          std::function<void(int64_t)> applied_ = {})
      : module(std::move(module_)),
        style(style_),
        hooks(hooks_),
        params(std::move(params_)),
        applied(std::move(applied_)) {}

  std::string module;  // "layers.0.attention.wq"
  TPStyle style = TPStyle::Replicated;
  LayerHooks* hooks = nullptr;      // the module's hooks (null for Replicated)
  std::vector<std::string> params;  // its parameters' FQNs (none for GatherInput)
  // Called once with the tp degree when the plan is applied (may be empty): what the module must
  // know beyond its hooks (a MoE: its auxiliary loss's gradient is computed on every tp rank and
  // summed over them, so each contributes 1/tp of it).
  std::function<void(int64_t tp)> applied;
};
using TPPlan = std::vector<TPEntry>;

}  // namespace ctitan
