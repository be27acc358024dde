#include "parallelisms/fsdp.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>

#include "config/errors.h"

namespace ctitan {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FSDP::Param {
  std::string fqn;
  at::Tensor full;             // the model's parameter: unsharded, compute dtype
  std::vector<int64_t> shape;  // global shape
  int64_t rows = 1, row_numel = 1, chunk_rows = 1;
  int64_t offset = 0;          // in the unit's flat shard, elements
  int64_t begin = 0, end = 0;  // global rows this rank holds
  at::Tensor shard;            // fp32 [chunk_rows, ...] leaf, the optimizer's parameter
  int64_t shard_numel() const { return chunk_rows * row_numel; }
  size_t full_nbytes() const { return static_cast<size_t>(rows * row_numel) * full.element_size(); }
};

struct FSDP::Unit {
  std::string name;
  std::vector<Param> params;
  int64_t S = 0;  // elements in this rank's flat shard (= every rank's)
  State state = State::Sharded;
  bool reshard_after_forward = true;
  at::Tensor gather_buf;  // [N·S] compute dtype, while gathering
  PendingCollective gather;
  int64_t grads_seen = 0;
  bool reduced = false;
  at::Tensor rs_out;  // [S] reduce dtype
  PendingCollective rs;
};

namespace {

// Identity on a unit's output whose backward fires before the unit's own backward.
struct PreBackwardFn : public torch::autograd::Function<PreBackwardFn> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t fsdp, int64_t unit) {
    ctx->saved_data["fsdp"] = fsdp;
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* f = reinterpret_cast<FSDP*>(ctx->saved_data["fsdp"].toInt());
    f->pre_backward(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// Runs after a parameter's gradient has been accumulated into its .grad.
struct GradReadyHook : public torch::autograd::FunctionPostHook {
  GradReadyHook(FSDP* f, size_t unit) : fsdp(f), unit(unit) {}
  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    fsdp->on_param_grad(unit);
    return outputs;
  }
  FSDP* fsdp;
  size_t unit;
};

// Gives the tensor's storage nbytes of fresh memory from the storage's own allocator (the CPU
// allocator, or CUDA's caching allocator on the current stream), or none: what resize_bytes_cpu
// does, without copying the old bytes (FSDP never keeps them) and for any device, so the CPU
// tests run the code a GPU runs.
void set_storage_bytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  TORCH_CHECK(s->resizable() && s->allocator(), "[fsdp] the storage of a parameter cannot be resized");
  s->set_data_ptr_noswap(nbytes ? s->allocator()->allocate(nbytes) : at::DataPtr(nullptr, s->device()));
  s->set_nbytes(nbytes);
}
void free_storage(const at::Tensor& t) { set_storage_bytes(t, 0); }
void alloc_storage(const at::Tensor& t, size_t nbytes) { set_storage_bytes(t, nbytes); }

}  // namespace

FSDP::FSDP(std::vector<ModelUnit> units, std::shared_ptr<Comm> shard, std::shared_ptr<Comm> replicate,
           FSDPOptions options, const std::function<void(size_t unit)>& init_unit)
    : shard_(std::move(shard)), replicate_(std::move(replicate)), opt_(std::move(options)) {
  TORCH_CHECK(shard_, "[fsdp] a shard group is required");
  reduce_scatter_ = shard_;
  if (opt_.reshard_after_forward != "default" && opt_.reshard_after_forward != "always" &&
      opt_.reshard_after_forward != "never")
    throw UserError("config error: parallelism.fsdp_reshard_after_forward = \"" + opt_.reshard_after_forward +
                    "\" is not one of: default, always, never");
  const int64_t N = shard_->size(), r = shard_->rank();
  torch::NoGradGuard no_grad;
  for (size_t ui = 0; ui < units.size(); ++ui) {
    auto u = std::make_unique<Unit>();
    u->name = units[ui].name;
    const bool last = ui + 1 == units.size();
    u->reshard_after_forward =
        opt_.reshard_after_forward == "always" || (opt_.reshard_after_forward == "default" && !last);
    // Deferred parameters (no storage yet): give them storage now, one unit at a time.
    bool deferred = false;
    for (auto& [fqn, t] : units[ui].params) deferred = deferred || (t.numel() > 0 && t.storage().nbytes() == 0);
    if (deferred && init_unit) {
      for (auto& [fqn, t] : units[ui].params) {
        TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "[fsdp] deferred ", fqn,
                    " must be a contiguous float32 tensor");
        if (t.storage().nbytes() == 0) alloc_storage(t, static_cast<size_t>(t.numel()) * sizeof(float));
      }
      init_unit(ui);
    }
    for (auto& [fqn, t] : units[ui].params) {
      TORCH_CHECK(t.dim() >= 1 && t.is_contiguous(), "[fsdp] ", fqn, " must be a contiguous tensor of rank >= 1");
      Param p;
      p.fqn = fqn;
      p.full = t;
      p.shape = t.sizes().vec();
      p.rows = t.size(0);
      p.row_numel = p.rows ? t.numel() / p.rows : 0;
      p.chunk_rows = (p.rows + N - 1) / N;
      p.begin = std::min(p.rows, r * p.chunk_rows);
      p.end = std::min(p.rows, p.begin + p.chunk_rows);
      p.offset = u->S;
      u->S += p.shard_numel();
      // This rank's rows in fp32, zero-padded to chunk_rows.
      std::vector<int64_t> shard_shape = p.shape;
      shard_shape[0] = p.chunk_rows;
      p.shard = at::zeros(shard_shape, t.options().dtype(at::kFloat).device(opt_.device));
      if (p.end > p.begin && !(deferred && !init_unit))
        p.shard.narrow(0, 0, p.end - p.begin).copy_(t.narrow(0, p.begin, p.end - p.begin));
      p.shard.requires_grad_(true);
      // The model's tensor becomes the unsharded parameter in the compute dtype, storage freed
      // (the full values first, so a deferred unit's fp32 and compute copies never coexist).
      free_storage(t);
      t.set_data(at::empty({0}, t.options().dtype(opt_.param_dtype).device(opt_.device)));
      t.unsafeGetTensorImpl()->set_sizes_contiguous(p.shape);
      fqns_.push_back(fqn);
      u->params.push_back(std::move(p));
    }
    unit_index_[u->name] = ui;
    units_.push_back(std::move(u));
  }
  // Post-accumulate hooks tell when a unit's gradients are complete.
  for (size_t ui = 0; ui < units_.size(); ++ui)
    for (auto& p : units_[ui]->params) {
      auto acc = torch::autograd::impl::grad_accumulator(p.full);
      acc->add_post_hook(std::make_unique<GradReadyHook>(this, ui));
      accumulators_.push_back(acc);
    }
}

FSDP::~FSDP() = default;

void FSDP::use_reduce_scatter_group(std::shared_ptr<Comm> group) {
  TORCH_CHECK(group && group->size() == shard_->size() && group->rank() == shard_->rank(),
              "[fsdp] the reduce-scatter group must have the shard group's ranks, in its order");
  reduce_scatter_ = std::move(group);
}

size_t FSDP::index_of(const std::string& unit) const {
  auto it = unit_index_.find(unit);
  TORCH_CHECK(it != unit_index_.end(), "[fsdp] unknown unit ", unit);
  return it->second;
}

void FSDP::wait(PendingCollective& p) {
  if (!p.pending()) return;
  const auto t0 = std::chrono::steady_clock::now();
  p.wait();
  stats_.comm_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void FSDP::start_gather(Unit& u) {
  if (u.state != State::Sharded) return;
  RECORD_FUNCTION("ctitan::fsdp_start_gather", std::vector<c10::IValue>());
  torch::NoGradGuard no_grad;
  if (shard_->size() == 1) {
    // A shard group of one (mixed precision on one process, or pure HSDP replication): the
    // shard is the whole parameter, so cast it straight into place — one pass instead of
    // concatenate, cast, "gather" and copy. Same rounding (fp32 → compute dtype, nearest even).
    for (auto& p : u.params) {
      alloc_storage(p.full, p.full_nbytes());
      p.full.data().copy_(p.shard.detach());
    }
    u.state = State::Unsharded;
    ++stats_.all_gathers;
    return;
  }
  std::vector<at::Tensor> pieces;
  for (auto& p : u.params) pieces.push_back(p.shard.detach().reshape({-1}));
  auto send = at::cat(pieces).to(opt_.param_dtype);  // [S]; gathers move the compute dtype
  u.gather_buf = at::empty({shard_->size() * u.S}, send.options());
  u.gather = shard_->all_gather_flat(send, u.gather_buf, u.name);
  u.state = State::Gathering;
  ++stats_.all_gathers;
}

void FSDP::finish_gather(Unit& u) {
  RECORD_FUNCTION("ctitan::fsdp_finish_gather", std::vector<c10::IValue>());
  wait(u.gather);
  torch::NoGradGuard no_grad;
  const int64_t N = shard_->size();
  auto buf = u.gather_buf.view({N, u.S});
  for (auto& p : u.params) {
    alloc_storage(p.full, p.full_nbytes());
    // .data(): writes that do not bump the version autograd saved.
    auto dst = p.full.data().view({p.rows, p.row_numel});
    for (int64_t r = 0; r < N; ++r) {
      const int64_t b = std::min(p.rows, r * p.chunk_rows), e = std::min(p.rows, b + p.chunk_rows);
      if (e > b)
        dst.narrow(0, b, e - b).copy_(buf[r].narrow(0, p.offset, (e - b) * p.row_numel).view({e - b, p.row_numel}));
    }
  }
  u.gather_buf = at::Tensor();
  u.state = State::Unsharded;
}

void FSDP::ensure_unsharded(Unit& u) {
  if (u.state == State::Sharded) start_gather(u);
  if (u.state == State::Gathering) finish_gather(u);
}

void FSDP::reshard(Unit& u) {
  if (u.state == State::Gathering) wait(u.gather);
  if (u.state == State::Sharded) return;
  for (auto& p : u.params) free_storage(p.full);
  u.gather_buf = at::Tensor();
  u.state = State::Sharded;
}

at::Tensor FSDP::run(const std::string& unit, const UnitFn& fn, const at::Tensor& input) {
  const size_t i = index_of(unit);
  Unit& u = *units_[i];
  ensure_unsharded(u);
  if (opt_.prefetch && i + 1 < units_.size()) start_gather(*units_[i + 1]);
  at::Tensor y = fn(input);
  if (torch::GradMode::is_enabled() && y.requires_grad()) {
    u.grads_seen = 0;
    u.reduced = false;
    y = PreBackwardFn::apply(y, reinterpret_cast<int64_t>(this), static_cast<int64_t>(i));
  }
  if (u.reshard_after_forward) reshard(u);
  return y;
}

void FSDP::reshard_all() {
  for (auto& u : units_) reshard(*u);
}

void FSDP::pre_backward(size_t i) {
  in_backward_ = true;
  ensure_unsharded(*units_[i]);
  if (opt_.prefetch && i > 0) start_gather(*units_[i - 1]);
}

void FSDP::on_param_grad(size_t i) {
  Unit& u = *units_[i];
  if (++u.grads_seen == static_cast<int64_t>(u.params.size())) reduce_grads(u);
}

// Whether the one-rank path makes g the shard's gradient as it is (FSDPOptions::keep_compute_grads):
// the first micro-batch's gradient (nothing to add it to), not a view (optimizers may detach
// gradients in place), contiguous and of the shard's shape (the fused AdamW's and the norm's
// loops read it flat), float32 or bf16, and not rounded by the reduce dtype.
bool FSDP::keeps_as_is(const at::Tensor& g, const at::Tensor& shard) const {
  if (!opt_.keep_compute_grads || shard.grad().defined() || g.is_view() || !g.is_contiguous() ||
      g.sizes() != shard.sizes())
    return false;
  if (g.scalar_type() != at::kFloat && g.scalar_type() != at::kBFloat16) return false;
  return opt_.reduce_dtype == at::kFloat || opt_.reduce_dtype == g.scalar_type();
}

void FSDP::reduce_grads(Unit& u) {
  if (u.reduced) return;
  RECORD_FUNCTION("ctitan::fsdp_reduce_grads", std::vector<c10::IValue>());
  torch::NoGradGuard no_grad;
  const int64_t N = shard_->size();
  if (N == 1 && !(replicate_ && replicate_->size() > 1)) {
    // One data-parallel rank in all: the reduction is the identity. Accumulate the gradient
    // into the fp32 shard gradient directly (rounded through the reduce dtype, as the
    // general path does; the mean over one rank divides by 1) — one pass instead of five.
    for (auto& p : u.params) {
      const at::Tensor g = p.full.grad();
      if (g.defined() && keeps_as_is(g, p.shard)) {
        p.shard.mutable_grad() = g;  // opt_.keep_compute_grads: the compute dtype's gradient itself
      } else if (g.defined()) {
        // Reshaped first, so that a cast makes a tensor of its own, not a view of one.
        const auto gr = g.reshape(p.shard.sizes()).to(opt_.reduce_dtype);
        if (p.shard.grad().defined() && p.shard.grad().scalar_type() != p.shard.scalar_type())
          p.shard.mutable_grad() = p.shard.grad().to(p.shard.scalar_type()).add_(gr);  // a kept one, widened
        else if (p.shard.grad().defined())
          p.shard.mutable_grad().add_(gr);  // computed in fp32, as fp32 + fp32 would be
        else if (gr.scalar_type() == p.shard.scalar_type() && !gr.is_alias_of(g))
          p.shard.mutable_grad() = gr;  // the cast's own result (bf16 compute, fp32 reduce): no copy
        else                            // a tensor of its own (not a view: optimizers detach_ gradients in place)
          p.shard.mutable_grad() = at::empty(p.shard.sizes(), p.shard.options()).copy_(gr);
      }
      p.full.mutable_grad() = at::Tensor();
    }
    reshard(u);
    u.grads_seen = 0;  // nothing in flight: complete_reduction has nothing to do
    ++stats_.reduce_scatters;
    return;
  }
  u.reduced = true;
  // [N, S]: row r holds, for every parameter, the rows rank r owns (zero-padded).
  auto send = at::zeros({N, u.S}, at::TensorOptions().dtype(opt_.reduce_dtype).device(opt_.device));
  for (auto& p : u.params) {
    const at::Tensor g = p.full.grad();
    if (g.defined()) {
      auto gv = g.view({p.rows, p.row_numel});
      for (int64_t r = 0; r < N; ++r) {
        const int64_t b = std::min(p.rows, r * p.chunk_rows), e = std::min(p.rows, b + p.chunk_rows);
        if (e > b)
          send[r].narrow(0, p.offset, (e - b) * p.row_numel).view({e - b, p.row_numel}).copy_(gv.narrow(0, b, e - b));
      }
    }
    p.full.mutable_grad() = at::Tensor();  // the unsharded gradient is not kept
  }
  reshard(u);
  // At most one reduction in flight besides this one: each holds two [N·S] buffers, and
  // letting them pile up until the end of backward would hold two copies of the model.
  while (!pending_reductions_.empty()) {
    complete_reduction(*units_[pending_reductions_.front()]);
    pending_reductions_.pop_front();
  }
  u.rs_out = at::empty({u.S}, send.options());
  u.rs = reduce_scatter_->reduce_scatter_sum(send, u.rs_out, u.name);
  pending_reductions_.push_back(index_of(u.name));
  ++stats_.reduce_scatters;
}

// Completes one unit's gradient reduction: waits for its reduce-scatter (HSDP: then the
// all-reduce over the replicate group), takes the mean over the dp ranks and accumulates
// into the shards' .grad. Frees the unit's reduction buffers.
void FSDP::complete_reduction(Unit& u) {
  if (!u.reduced) return;
  RECORD_FUNCTION("ctitan::fsdp_complete_reduction", std::vector<c10::IValue>());
  torch::NoGradGuard no_grad;
  wait(u.rs);
  if (replicate_ && replicate_->size() > 1) {
    auto pending = replicate_->all_reduce_sum(u.rs_out, u.name);
    wait(pending);
  }
  const double dp = static_cast<double>(shard_->size() * (replicate_ ? replicate_->size() : 1));
  u.rs_out.div_(dp);  // mean over the data-parallel ranks
  for (auto& p : u.params) {
    auto g = u.rs_out.narrow(0, p.offset, p.shard_numel()).view(p.shard.sizes()).to(at::kFloat);
    if (p.shard.grad().defined())
      p.shard.mutable_grad().add_(g);
    else
      p.shard.mutable_grad() = g.clone();
  }
  u.rs_out = at::Tensor();
  u.reduced = false;
  u.grads_seen = 0;
}

void FSDP::finish_backward() {
  // Units some of whose parameters received no gradient (unused in this step).
  for (auto& up : units_)
    if (up->grads_seen > 0 && !up->reduced) reduce_grads(*up);
  for (auto& up : units_) complete_reduction(*up);
  pending_reductions_.clear();
  for (auto& up : units_) reshard(*up);
  in_backward_ = false;
}

std::vector<at::Tensor> FSDP::sharded_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_)
    for (const auto& p : u->params) out.push_back(p.shard);
  return out;
}

const FSDP::Param& FSDP::param(const std::string& fqn) const {
  for (const auto& u : units_)
    for (const auto& p : u->params)
      if (p.fqn == fqn) return p;
  TORCH_CHECK(false, "[fsdp] unknown parameter ", fqn);
}

at::Tensor FSDP::local_shard(const std::string& fqn) const { return param(fqn).shard; }
std::vector<int64_t> FSDP::global_shape(const std::string& fqn) const { return param(fqn).shape; }
std::pair<int64_t, int64_t> FSDP::local_rows(const std::string& fqn) const {
  const auto& p = param(fqn);
  return {p.begin, p.end};
}

std::map<std::string, at::Tensor> FSDP::gather_full_parameters() {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  const int64_t N = shard_->size();
  for (auto& u : units_)
    for (auto& p : u->params) {
      auto send = p.shard.detach().reshape({-1}).contiguous();
      auto buf = at::empty({N * p.shard_numel()}, send.options());
      auto pending = shard_->all_gather_flat(send, buf, "gather_full:" + p.fqn);
      wait(pending);
      out[p.fqn] = buf.narrow(0, 0, p.rows * p.row_numel).view(p.shape).clone();
    }
  return out;
}

int64_t FSDP::sharded_param_bytes() const {
  int64_t b = 0;
  for (const auto& u : units_)
    for (const auto& p : u->params) b += p.shard.numel() * p.shard.element_size();
  return b;
}

int64_t FSDP::sharded_grad_bytes() const {
  int64_t b = 0;
  for (const auto& u : units_)
    for (const auto& p : u->params)
      if (p.shard.grad().defined()) b += p.shard.grad().numel() * p.shard.grad().element_size();
  return b;
}

static at::ScalarType dtype_named(const std::string& key, const std::string& v) {
  if (v == "float32") return at::kFloat;
  if (v == "bfloat16") return at::kBFloat16;
  throw UserError("config error: " + key + " = \"" + v + "\" is not one of: bfloat16, float32");
}

FSDPOptions fsdp_options(const std::string& reshard_after_forward, const std::string& param_dtype,
                         const std::string& reduce_dtype) {
  FSDPOptions o;
  o.reshard_after_forward = reshard_after_forward;
  o.param_dtype = dtype_named("training.mixed_precision_param", param_dtype);
  o.reduce_dtype = dtype_named("training.mixed_precision_reduce", reduce_dtype);
  return o;
}

}  // namespace ctitan
