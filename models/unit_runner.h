// How a model lets transforms applied from outside (FSDP, activation checkpointing) act
// around its parts without knowing what they are. A model splits its forward into named
// units (Llama: "tok_embeddings", "layers.<i>", "output" = final norm + projection) and
// calls each through an optional UnitWrapper. The model itself never includes parallelisms/.
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Tensor.h>

namespace ctitan {

// One unit of the forward pass, callable again later (it owns what it captures, so an
// activation-checkpointing wrapper may re-run it during backward).
using UnitFn = std::function<at::Tensor(const at::Tensor&)>;

// Called instead of fn(input) for each unit. Must return fn(input) (or an equal tensor).
using UnitWrapper =
    std::function<at::Tensor(const std::string& unit, const UnitFn& fn, const at::Tensor& input)>;

// A unit's name and its parameters (fully qualified names, in a stable order).
struct ModelUnit {
  std::string name;
  std::vector<std::pair<std::string, at::Tensor>> params;
};

}  // namespace ctitan
