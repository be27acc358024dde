// The registered families as checkpoint/ sees them for Hugging Face interop
// (hf_types/hf_adapter.h): what train, checkpoint_tool and generate hand to checkpoint/.
#pragma once
#include "hf_types/hf_adapter.h"

namespace ctitan {

// Built from models/registry.cpp's list, once.
const HFAdapter& hf_adapter();

}  // namespace ctitan
