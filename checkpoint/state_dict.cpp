// The state dict's entries and the dtype names of the metadata; see state_dict.h.
#include "checkpoint/state_dict.h"

#include <torch/torch.h>

namespace ctitan {

using ckpt::Rule;

namespace ckpt {

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    default: break;
  }
  TORCH_CHECK(false, "[checkpoint] unsupported dtype ", t);
}

at::ScalarType scalar_type_of(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16") return at::kHalf;
  if (s == "float64") return at::kDouble;
  if (s == "int64") return at::kLong;
  if (s == "int32") return at::kInt;
  if (s == "uint8") return at::kByte;
  TORCH_CHECK(false, "[checkpoint] unsupported dtype ", s);
}

}  // namespace ckpt

bool is_model_key(const std::string& k) {
  for (const char* p : {"optimizer.", "lr_scheduler.", "train_state.", "dataloader.", "rng."})
    if (k.rfind(p, 0) == 0) return false;
  return true;
}

void StateDict::sharded(const std::string& key, const at::Tensor& local, std::vector<int64_t> global_shape,
                        int64_t row_begin, int64_t row_end, bool save_here) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::Sharded;
  e.tensor = local.detach();
  e.global_shape = std::move(global_shape);
  e.row_begin = row_begin;
  e.row_end = row_end;
  // A rank whose shard has no real rows (more ranks than rows) stores nothing.
  e.save_here = save_here && row_end > row_begin;
  entries_.push_back(std::move(e));
}

void StateDict::replicated(const std::string& key, const at::Tensor& value) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::Replicated;
  e.tensor = value.detach();
  e.global_shape = value.sizes().vec();
  entries_.push_back(std::move(e));
}

void StateDict::replicated_int(const std::string& key, int64_t value) {
  replicated(key, torch::tensor(value, torch::kInt64));
}

void StateDict::python_object(const std::string& key, pickle::Ptr value) {
  StateEntry e;
  e.key = key;
  e.rule = Rule::Replicated;
  e.is_bytes = true;
  e.object = std::move(value);
  entries_.push_back(std::move(e));
}

void StateDict::per_rank_bytes(const std::string& key, std::string bytes, bool save_here) {
  StateEntry e;
  e.save_here = save_here;
  e.key = key;
  e.rule = Rule::PerRank;
  e.is_bytes = true;
  e.bytes = std::move(bytes);
  entries_.push_back(std::move(e));
}

}  // namespace ctitan
