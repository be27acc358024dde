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
using UnitWrapper = std::function<at::Tensor(const std::string& unit, const UnitFn& fn, const at::Tensor& input)>;

// Turns a unit's function into another one (activation checkpointing: its checkpointed version).
using UnitTransform = std::function<UnitFn(const std::string& unit, const UnitFn& fn)>;

// The two places a transform applied from outside takes around a model's units, so that their
// nesting is fixed by construction, not by the order in which they are applied:
//   runner     runs each unit call (FSDP: gathers the unit's parameters first, reshards after,
//              hooks its backward);
//   transform  rewrites the function the runner calls (AC: the checkpointed version, whose
//              recompute in backward then finds the parameters FSDP gathered for it).
// The model's wrapper is runner(unit, transform(unit, fn), input): torchtitan's FSDP(AC(block)),
// whether AC or FSDP was applied first. Either slot may be empty.
struct UnitSlots {
  UnitWrapper runner;
  UnitTransform transform;

  UnitWrapper wrapper() const {
    if (!runner && !transform) return nullptr;
    return [runner = runner, transform = transform](const std::string& unit, const UnitFn& fn,
                                                    const at::Tensor& x) -> at::Tensor {
      const UnitFn f = transform ? transform(unit, fn) : fn;
      return runner ? runner(unit, f, x) : f(x);
    };
  }
};

// A unit's name and its parameters (fully qualified names, in a stable order).
struct ModelUnit {
  std::string name;
  std::vector<std::pair<std::string, at::Tensor>> params;
};

}  // namespace ctitan
