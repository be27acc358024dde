// The mixtral family's ModelSpec (models/model_spec.h): the shared decoder with MoE blocks;
// HF: MixtralForCausalLM.
#pragma once
#include "models/model_spec.h"

namespace ctitan::mixtral {

ModelSpec mixtral_spec();

}  // namespace ctitan::mixtral
