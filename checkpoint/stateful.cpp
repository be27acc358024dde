// The standard Stateful components; see stateful.h.
#include "checkpoint/stateful.h"

#include <cstring>
#include <mutex>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "checkpoint/hf.h"
#include "config/errors.h"

namespace ctitan {
namespace {

template <class S>
S& adam_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  // The key LibTorch's Adam/AdamW use for a parameter's state.
  void* const key = p.unsafeGetTensorImpl();
  auto& st = opt.state();
  auto it = st.find(key);
  if (it == st.end()) {
    // What Adam(W)::step creates on a parameter's first step: step 0, zero moments.
    auto s = std::make_unique<S>();
    s->step(0);
    s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
    st[key] = std::move(s);
    it = st.find(key);
  }
  return static_cast<S&>(*it->second);
}

struct AdamRefs {
  at::Tensor exp_avg, exp_avg_sq;
  std::function<int64_t()> get_step;
  std::function<void(int64_t)> set_step;
};

AdamRefs adam_refs(torch::optim::Optimizer& opt, const at::Tensor& p) {
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) {
    auto& s = adam_state<torch::optim::AdamWParamState>(opt, p);
    return {s.exp_avg(), s.exp_avg_sq(), [&s] { return s.step(); }, [&s](int64_t v) { s.step(v); }};
  }
  if (dynamic_cast<torch::optim::Adam*>(&opt)) {
    auto& s = adam_state<torch::optim::AdamParamState>(opt, p);
    return {s.exp_avg(), s.exp_avg_sq(), [&s] { return s.step(); }, [&s](int64_t v) { s.step(v); }};
  }
  TORCH_CHECK(false, "[checkpoint] only Adam and AdamW optimizer state can be checkpointed");
}

}  // namespace

// ---- ModelState ----------------------------------------------------------------------------

namespace {
// The rows [begin, end) the checkpoint holds of a local tensor: itself, or under tensor
// parallelism with its columns split, the tp group's columns gathered (a collective).
at::Tensor saved_rows(const ShardedParam& p, const at::Tensor& local) {
  return p.whole_rows ? p.whole_rows(local.detach()) : local.detach();
}

// Reads rows [begin, end) of `key` into `local`; with split columns, whole rows into a buffer
// first and this rank's columns from it.
void read_own(const ShardedParam& p, const std::function<void(const at::Tensor&)>& read_rows, const at::Tensor& local) {
  if (!p.own_columns) return read_rows(local);
  auto shape = p.global_shape;  // whole rows: every dimension after the first whole
  shape.at(0) = local.size(0);
  auto whole = at::empty(shape, local.options());
  read_rows(whole);
  local.copy_(p.own_columns(whole));
}
}  // namespace

void ModelState::state_dict(StateDict& sd) {
  for (const auto& p : params_) {
    at::Tensor t = saved_rows(p, p.local);
    if (!export_dtype_.empty() && ckpt::scalar_type_of(export_dtype_) != t.scalar_type())
      t = t.narrow(0, 0, p.end - p.begin).to(ckpt::scalar_type_of(export_dtype_));
    sd.sharded(p.fqn, t, p.global_shape, p.begin, p.end, save_here_ && p.save_here);
  }
}

void ModelState::check_load(const CheckpointReader& ckpt) const {
  for (const auto& p : params_) {
    if (!ckpt.has(p.fqn))
      throw UserError("checkpoint " + ckpt.path() + " has no model parameter " + p.fqn + " (another model?)");
    ckpt.require_tensor(p.fqn, p.global_shape);
  }
}

void ModelState::load_state_dict(const CheckpointReader& ckpt) {
  for (const auto& p : params_)
    read_own(
        p, [&](const at::Tensor& d) { ckpt.read_rows(p.fqn, p.begin, p.end, d); }, p.local.detach());
}

void ModelState::check_load_hf(const HFCheckpoint& hf) const {
  for (const auto& p : params_) hf.check_param(p.fqn, p.global_shape);
}

void ModelState::load_hf(const HFCheckpoint& hf) {
  for (const auto& p : params_)
    read_own(
        p, [&](const at::Tensor& d) { hf.read_param_rows(p.fqn, p.global_shape, p.begin, p.end, d); },
        p.local.detach());
}

int64_t ModelState::vocab_size() const {
  for (const auto& p : params_)
    if (p.fqn == "tok_embeddings.weight") return p.global_shape.at(0);
  return 0;
}

// ---- OptimizerState ------------------------------------------------------------------------

OptimizerState::OptimizerState(torch::optim::Optimizer& opt, std::vector<ShardedParam> params, bool save_here)
    : opt_(&opt), params_(std::move(params)), save_here_(save_here) {
  TORCH_CHECK(dynamic_cast<torch::optim::AdamW*>(&opt) || dynamic_cast<torch::optim::Adam*>(&opt),
              "[checkpoint] only Adam and AdamW optimizer state can be checkpointed");
}

void OptimizerState::state_dict(StateDict& sd) {
  for (const auto& p : params_) {
    const std::string k = "optimizer.state." + p.fqn + ".";
    AdamRefs a = adam_refs(*opt_, p.local);
    sd.sharded(k + "exp_avg", saved_rows(p, a.exp_avg), p.global_shape, p.begin, p.end, save_here_ && p.save_here);
    sd.sharded(k + "exp_avg_sq", saved_rows(p, a.exp_avg_sq), p.global_shape, p.begin, p.end,
               save_here_ && p.save_here);
    sd.replicated_int(k + "step", a.get_step());
  }
}

void OptimizerState::check_load(const CheckpointReader& ckpt) const {
  for (const auto& p : params_) {
    const std::string k = "optimizer.state." + p.fqn + ".";
    if (!ckpt.has(k + "exp_avg") || !ckpt.has(k + "exp_avg_sq") || !ckpt.has(k + "step"))
      throw UserError("checkpoint " + ckpt.path() + " has no optimizer state for " + p.fqn +
                      " (HINT: checkpoint.exclude_from_loading = [\"optimizer\"] starts a fresh optimizer)");
    ckpt.require_tensor(k + "exp_avg", p.global_shape);
    ckpt.require_tensor(k + "exp_avg_sq", p.global_shape);
  }
}

void OptimizerState::load_state_dict(const CheckpointReader& ckpt) {
  for (const auto& p : params_) {
    const std::string k = "optimizer.state." + p.fqn + ".";
    AdamRefs a = adam_refs(*opt_, p.local);
    read_own(
        p, [&](const at::Tensor& d) { ckpt.read_rows(k + "exp_avg", p.begin, p.end, d); }, a.exp_avg);
    read_own(
        p, [&](const at::Tensor& d) { ckpt.read_rows(k + "exp_avg_sq", p.begin, p.end, d); }, a.exp_avg_sq);
    a.set_step(ckpt.read_int(k + "step"));
  }
}

// ---- ScalarsState --------------------------------------------------------------------------

void ScalarsState::state_dict(StateDict& sd) {
  for (const auto& [name, ptr] : fields_) sd.replicated_int(prefix_ + "." + name, *ptr);
}

void ScalarsState::check_load(const CheckpointReader& ckpt) const {
  for (const auto& f : fields_)
    if (!ckpt.has(prefix_ + "." + f.first))
      throw UserError("checkpoint " + ckpt.path() + " has no " + prefix_ + "." + f.first +
                      " (HINT: checkpoint.exclude_from_loading = [\"" + prefix_ + "\"] starts it fresh)");
}

void ScalarsState::load_state_dict(const CheckpointReader& ckpt) {
  for (const auto& [name, ptr] : fields_) *ptr = ckpt.read_int(prefix_ + "." + name);
}

// ---- RngState ------------------------------------------------------------------------------

void RngState::state_dict(StateDict& sd) {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor st;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    st = gen.get_state();
  }
  sd.per_rank_bytes("rng.rank_" + std::to_string(rank_),
                    std::string(static_cast<const char*>(st.data_ptr()), st.numel()));
}

void RngState::load_state_dict(const CheckpointReader& ckpt) {
  auto gen = at::detail::getDefaultCPUGenerator();
  const std::string key = "rng.rank_" + std::to_string(rank_);
  if (!ckpt.has(key)) {
    spdlog::warn("checkpoint {} has no RNG state for rank {} (saved on {} ranks): seeding it from seed {} + rank",
                 ckpt.path(), rank_, ckpt.meta().world_size, seed_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed_ + static_cast<uint64_t>(rank_));
    return;
  }
  std::string bytes = ckpt.read_bytes(key);
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

// ---- DataLoaderState -----------------------------------------------------------------------

void DataLoaderState::state_dict(StateDict& sd) {
  sd.per_rank_bytes("dataloader.dp_rank_" + std::to_string(dp_rank_), get_(), save_here_);
  sd.replicated_int("dataloader.world_size", dp_world_);
}

void DataLoaderState::check_load(const CheckpointReader& ckpt) const {
  if (!ckpt.has("dataloader.world_size"))
    throw UserError("checkpoint " + ckpt.path() +
                    " has no dataloader state (HINT: checkpoint.exclude_from_loading = "
                    "[\"dataloader\"] starts a fresh data order)");
  const int64_t saved = ckpt.read_int("dataloader.world_size");
  if (saved == dp_world_) {
    ckpt.entry("dataloader.dp_rank_" + std::to_string(dp_rank_));
    return;
  }
  if (reshard_ != "redistribute")
    throw UserError("checkpoint " + ckpt.path() + " was saved with data-parallel degree " + std::to_string(saved) +
                    " and this run has data-parallel degree " + std::to_string(dp_world_) +
                    ": the data loader position cannot be restored as saved; choose "
                    "checkpoint.exclude_from_loading = [\"dataloader\"] (start a fresh data order) or "
                    "checkpoint.dataloader_reshard = \"redistribute\" (continue the document stream where the "
                    "saved ranks had reached; the setting for elastic runs, torchrun --nnodes MIN:MAX, whose "
                    "restarts may change the world size)");
  for (int64_t r = 0; r < saved; ++r) ckpt.entry("dataloader.dp_rank_" + std::to_string(r));
}

void DataLoaderState::load_state_dict(const CheckpointReader& ckpt) {
  const int64_t saved = ckpt.read_int("dataloader.world_size");
  if (saved == dp_world_) {
    set_(ckpt.read_bytes("dataloader.dp_rank_" + std::to_string(dp_rank_)));
    return;
  }
  TORCH_CHECK(redistribute_, "[checkpoint] dataloader redistribution requested but not available");
  std::vector<std::string> states;
  for (int64_t r = 0; r < saved; ++r) states.push_back(ckpt.read_bytes("dataloader.dp_rank_" + std::to_string(r)));
  set_(redistribute_(states, dp_rank_, dp_world_));
}

}  // namespace ctitan
