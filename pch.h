// Precompiled header for every translation unit that uses LibTorch.
// Parsing <torch/torch.h> costs ~30 s here; the PCH pays it once per build.
#pragma once
#include <torch/torch.h>
#include <spdlog/spdlog.h>
#include <string>
#include <vector>
#include <memory>
