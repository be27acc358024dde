// How a model lets transforms applied from outside (FSDP, activation checkpointing) act
// around its parts without knowing what they are. A model splits its forward into named
// units (Llama: "tok_embeddings", "layers.<i>", "norm_output") and runs each through
// its UnitRunner, if one is installed. The model itself never includes parallelisms/.
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

namespace ctitan {

using UnitFn = std::function<at::Tensor(const at::Tensor&)>;

struct UnitRunner {
  virtual ~UnitRunner() = default;
  // Must return fn(input), doing whatever it needs before, after and in backward.
  virtual at::Tensor run(const std::string& unit, const UnitFn& fn, const at::Tensor& input) = 0;
};

// A unit's name and its parameters (fully qualified names, in a stable order).
struct ModelUnit {
  std::string name;
  std::vector<std::pair<std::string, at::Tensor>> params;
};

}  // namespace ctitan
