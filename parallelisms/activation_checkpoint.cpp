#include "parallelisms/activation_checkpoint.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "config/errors.h"
#include "config/job_config.h"
#include "models/recompute.h"
#include "util/strings.h"

namespace ctitan {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

ACOptions ac_options(const config::ActivationCheckpoint& cfg) {
  ACOptions o;
  o.mode = cfg.mode;
  o.selective_ac_option = cfg.selective_ac_option;
  o.preserve_rng_state = cfg.preserve_rng_state;
  o.determinism_check = cfg.determinism_check;
  o.force_recompute_mm_fqns = cfg.per_op_sac_force_recompute_mm_shapes_by_fqns;
  return o;
}

// Immutable after construction; shared by every checkpointed call.
struct ActivationCheckpoint::Policy {
  bool op_sac = false;
  bool preserve_rng = true;
  bool check = true;
  std::set<std::vector<int64_t>> force_recompute_shapes;  // weight shapes [out, in]

  // Op SAC: whether the output of this matmul (weight w) is kept. `count` numbers the
  // block's matmuls that are not forced to recompute; odd ones (1st, 3rd, …) are kept.
  bool keep_matmul(const at::Tensor& w, int64_t& count) const {
    if (force_recompute_shapes.count(w.sizes().vec())) return false;
    return ++count % 2 == 1;
  }
};

namespace {

// ---- metadata of the tensors a unit produces (the determinism check) ---------------------
struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::Device device;
};

// Thread-local state of the RecordFunction observer: where op outputs go, and whether
// recording is suspended (inside a matmul site or a decision, whose ops a recompute
// may skip: the site's result is recorded instead).
struct Recorder {
  std::vector<TensorMeta>* sink = nullptr;
  int suspended = 0;
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
};
thread_local Recorder tl_recorder;

void record_tensor(const at::Tensor& t) {
  Recorder& r = tl_recorder;
  if (r.sink == nullptr || r.suspended > 0 || !t.defined()) return;
  r.sink->push_back(TensorMeta{t.sizes().vec(), t.scalar_type(), t.device()});
}

void record_ivalue(const c10::IValue& v) {
  if (v.isTensor()) {
    record_tensor(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) record_tensor(t);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) record_ivalue(e);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) record_ivalue(e);
  }
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction&) { return nullptr; }
void on_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (tl_recorder.sink == nullptr || tl_recorder.suspended > 0) return;
  for (const auto& v : fn.outputs()) record_ivalue(v);
}

// Records the metadata of every tensor the ops of this thread produce while alive.
class RecordingScope {
 public:
  explicit RecordingScope(std::vector<TensorMeta>* sink) : prev_(tl_recorder.sink) {
    tl_recorder.sink = sink;
    if (tl_recorder.handle == at::INVALID_CALLBACK_HANDLE) {
      tl_recorder.handle = at::addThreadLocalCallback(
          at::RecordFunctionCallback(on_op_start, on_op_end).needsOutputs(true).scopes({at::RecordScope::FUNCTION}));
      owner_ = true;
    }
  }
  ~RecordingScope() {
    tl_recorder.sink = prev_;
    if (owner_) {
      at::removeCallback(tl_recorder.handle);
      tl_recorder.handle = at::INVALID_CALLBACK_HANDLE;
    }
  }
  RecordingScope(const RecordingScope&) = delete;
  RecordingScope& operator=(const RecordingScope&) = delete;

 private:
  std::vector<TensorMeta>* prev_;
  bool owner_ = false;
};

struct SuspendRecording {
  SuspendRecording() { ++tl_recorder.suspended; }
  ~SuspendRecording() { --tl_recorder.suspended; }
};

// The first difference between what the forward and the recompute produced, as
// "layers.3: recomputed tensor 18 has shape [1,50,32,128] but the forward saved [1,25,32,128]"
// (positions count from 0, in the order the tensors were produced).
void check_same_metadata(const std::string& unit, const std::vector<TensorMeta>& fwd,
                         const std::vector<TensorMeta>& re) {
  const size_t n = std::min(fwd.size(), re.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string head = unit + ": recomputed tensor " + std::to_string(i);
    if (re[i].sizes != fwd[i].sizes)
      throw RuntimeFailure(head + " has shape " + shape_str(re[i].sizes, ",") + " but the forward saved " +
                           shape_str(fwd[i].sizes, ","));
    if (re[i].dtype != fwd[i].dtype)
      throw RuntimeFailure(head + " has dtype " + c10::toString(re[i].dtype) + " but the forward saved " +
                           c10::toString(fwd[i].dtype));
    if (re[i].device != fwd[i].device)
      throw RuntimeFailure(head + " has device " + re[i].device.str() + " but the forward saved " +
                           fwd[i].device.str());
  }
  if (fwd.size() != re.size())
    throw RuntimeFailure(unit + ": the recompute produced " + std::to_string(re.size()) +
                         " tensors but the forward saved " + std::to_string(fwd.size()));
}

// ---- the RNG: the CPU generator, and the GPU's where the unit runs on one --------------------
// The state of the CPU default generator and, when the unit's input is on a GPU, of that GPU's
// default generator (as torch.utils.checkpoint keeps the devices of its tensor inputs).
struct GeneratorStates {
  at::Tensor cpu;
  at::Tensor device;  // defined only for a unit on a GPU
  c10::Device where = c10::Device(c10::kCPU);
  bool defined() const { return cpu.defined(); }
};

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_generator_state(at::Generator gen, const at::Tensor& s) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

// `on`: the unit's input; its device's generator is kept too when it is not the CPU.
GeneratorStates rng_state(const at::Tensor& on) {
  GeneratorStates s;
  s.cpu = generator_state(at::detail::getDefaultCPUGenerator());
  if (on.defined() && !on.is_cpu()) {
    s.where = on.device();
    s.device = generator_state(at::globalContext().defaultGenerator(s.where));
  }
  return s;
}
void set_rng_state(const GeneratorStates& s) {
  set_generator_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  if (s.device.defined()) set_generator_state(at::globalContext().defaultGenerator(s.where), s.device);
}

// Plays the forward's RNG state for the recompute, then puts the outer stream back.
class RngReplay {
 public:
  RngReplay(const GeneratorStates& forward_state, const at::Tensor& on) {
    if (!forward_state.defined()) return;
    outer_ = rng_state(on);
    set_rng_state(forward_state);
  }
  ~RngReplay() {
    if (outer_.defined()) set_rng_state(outer_);
  }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  GeneratorStates outer_;
};

// ---- what a checkpointed call keeps between its forward and its backward ------------------
struct CheckpointRecord : torch::CustomClassHolder {
  std::string unit;
  UnitFn fn;
  std::shared_ptr<const ActivationCheckpoint::Policy> policy;
  std::shared_ptr<ACStats> stats;
  GeneratorStates rng;                             // RNG state before the forward (CPU, and its GPU)
  std::vector<TensorMeta> metas;                   // every tensor the forward produced
  std::vector<std::vector<at::Tensor>> decisions;  // recompute::decide results, in order
  std::vector<at::Tensor> kept;                    // op SAC: kept matmul outputs, in order
  std::vector<int64_t> kept_versions;              // ... and their version counters then
  bool recomputed = false;                         // backward ran (what was kept is freed)
};

// A kept matmul output put back into the recompute's graph: y = x W^T with y given.
// Its backward is gemm::linear_backward, the very function a recomputed gemm::linear's
// backward runs (so the same bits): grad_x = g W, grad_W = g^T x (x folded to 2-D).
// (kept is passed wrapped so that autograd does not count it as an input.)
struct Kept {
  at::Tensor t;
};
struct KeptLinear : public torch::autograd::Function<KeptLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, Kept kept) {
    ctx->save_for_backward({x, w});
    return kept.t;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [gx, gw] =
        gemm::linear_backward(grads[0], saved[0], saved[1], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {gx, gw, at::Tensor()};
  }
};

// The model-side hooks (models/recompute.h) during the forward: keep.
class ForwardContext final : public recompute::Context {
 public:
  explicit ForwardContext(CheckpointRecord& r) : r_(r) {}
  bool recomputing() const override { return false; }
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w) override {
    if (!r_.policy->op_sac) return gemm::linear(x, w);
    const bool keep = r_.policy->keep_matmul(w, matmuls_);
    at::Tensor y;
    {
      SuspendRecording s;
      y = gemm::linear(x, w);
    }
    record_tensor(y);
    if (keep) {
      // Detached: y's own graph (which holds x and the gathered weight) goes with the unit's.
      SuspendRecording s;  // the recompute does not detach
      r_.kept.push_back(y.detach());
      r_.kept_versions.push_back(y._version());
      ++r_.stats->kept_matmuls;
      r_.stats->kept_bytes += static_cast<int64_t>(y.nbytes());
    }
    return y;
  }
  std::vector<at::Tensor> decide(const std::function<std::vector<at::Tensor>()>& f) override {
    std::vector<at::Tensor> ts;
    {
      SuspendRecording s;
      for (const at::Tensor& t : f()) ts.push_back(t.defined() ? t.detach() : t);
    }
    for (const auto& t : ts) record_tensor(t);
    r_.decisions.push_back(ts);
    return ts;  // the very tensors the recompute gets back
  }
  void state_update(const std::function<void()>& f) override {
    SuspendRecording s;  // the recompute does not run it
    f();
  }

 private:
  CheckpointRecord& r_;
  int64_t matmuls_ = 0;
};

// ... and during the recompute: reuse.
class RecomputeContext final : public recompute::Context {
 public:
  explicit RecomputeContext(CheckpointRecord& r) : r_(r) {}
  bool recomputing() const override { return true; }
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w) override {
    if (!r_.policy->op_sac) return gemm::linear(x, w);
    at::Tensor y;
    if (r_.policy->keep_matmul(w, matmuls_)) {
      if (next_kept_ >= r_.kept.size())
        throw RuntimeFailure(r_.unit + ": the recompute reached kept matmul " + std::to_string(next_kept_) +
                             " but the forward kept " + std::to_string(r_.kept.size()));
      const size_t k = next_kept_++;
      const at::Tensor& kept = r_.kept[k];
      if (kept._version() != r_.kept_versions[k])
        throw RuntimeFailure(r_.unit + ": matmul output " + std::to_string(k) +
                             " kept by the forward was modified in place afterwards; op-level SAC "
                             "cannot reuse it (use mode full or selective N)");
      std::vector<int64_t> want = x.sizes().vec();
      want.back() = w.size(0);
      if (kept.sizes().vec() != want)
        throw RuntimeFailure(r_.unit + ": recomputed matmul output " + std::to_string(k) + " has shape " +
                             shape_str(want, ",") + " but the forward saved " + shape_str(kept.sizes().vec(), ","));
      y = KeptLinear::apply(x, w, Kept{kept});
      ++r_.stats->reused_matmuls;
    } else {
      SuspendRecording s;
      y = gemm::linear(x, w);
    }
    record_tensor(y);
    return y;
  }
  std::vector<at::Tensor> decide(const std::function<std::vector<at::Tensor>()>&) override {
    if (next_decision_ >= r_.decisions.size())
      throw RuntimeFailure(r_.unit + ": the recompute asked for decision " + std::to_string(next_decision_) +
                           " but the forward made " + std::to_string(r_.decisions.size()));
    const auto& ts = r_.decisions[next_decision_++];
    for (const auto& t : ts) record_tensor(t);
    return ts;
  }
  void state_update(const std::function<void()>&) override {}
  // Everything the forward kept was used again (else the recompute took another path).
  void check_consumed() const {
    if (next_decision_ != r_.decisions.size())
      throw RuntimeFailure(r_.unit + ": the recompute made " + std::to_string(next_decision_) +
                           " decisions but the forward made " + std::to_string(r_.decisions.size()));
    if (next_kept_ != r_.kept.size())
      throw RuntimeFailure(r_.unit + ": the recompute reused " + std::to_string(next_kept_) +
                           " matmul outputs but the forward kept " + std::to_string(r_.kept.size()));
  }

 private:
  CheckpointRecord& r_;
  int64_t matmuls_ = 0;
  size_t next_kept_ = 0, next_decision_ = 0;
};

// The unit's input as both of its runs see it: detached, needing a gradient as x does.
at::Tensor unit_input(const at::Tensor& x, bool needs_grad) {
  at::Tensor xd = x.detach();
  xd.requires_grad_(needs_grad);
  return xd;
}

// The checkpointed unit. Inputs: x (the unit's input), an anchor that requires grad (so
// the output is part of the graph even when x is not, and the parameters still get their
// gradients), and the record.
//
// Both runs of the unit run its ops the same way, with grad enabled, as PyTorch's
// non-reentrant checkpoint does: an op may produce other tensors when no gradient is needed
// (CUDA's memory-efficient attention returns an empty logsumexp then), and the forward must
// record what the recompute will produce. The forward's graph is dropped when the unit
// returns (autograd runs a custom function's forward with grad disabled; grad is enabled
// again inside, and the output detached), so what it saved lives only while the unit runs:
// the forward's peak grows by one unit's activations, which the recompute holds in backward
// anyway. (PyTorch drops them as they are saved, through saved-tensor hooks that LibTorch
// offers only to Python.)
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& anchor,
                            c10::intrusive_ptr<CheckpointRecord> rec) {
    if (rec->policy->preserve_rng) rec->rng = rng_state(x);
    const at::Tensor xd = unit_input(x, x.requires_grad());  // (before recording, as in backward)
    at::Tensor y;
    {
      torch::AutoGradMode grad_on(true);
      ForwardContext fctx(*rec);
      recompute::ContextGuard guard(&fctx);
      std::optional<RecordingScope> recording;
      if (rec->policy->check) recording.emplace(&rec->metas);
      y = rec->fn(xd);
      record_tensor(y);
    }
    y = y.detach();  // the unit's graph, and all it saved, goes
    ++rec->stats->checkpointed_forwards;
    rec->stats->kept_bytes += static_cast<int64_t>(x.nbytes());
    ctx->save_for_backward({x});
    ctx->saved_data["record"] = c10::IValue::make_capsule(rec);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto holder = ctx->saved_data["record"].toCapsule();  // keeps the record alive
    CheckpointRecord* rec = static_cast<CheckpointRecord*>(holder.get());
    if (rec->recomputed)
      throw RuntimeFailure(rec->unit +
                           ": backward ran twice through a checkpointed unit "
                           "(retain_graph is not supported with activation checkpointing)");
    rec->recomputed = true;
    const at::Tensor x = ctx->get_saved_variables()[0];
    const bool x_grad = ctx->needs_input_grad(0);
    at::Tensor xd = unit_input(x, x_grad);
    at::Tensor y;
    std::vector<TensorMeta> metas;
    {
      torch::AutoGradMode grad_on(true);
      RngReplay rng(rec->rng, x);
      RecomputeContext rctx(*rec);
      recompute::ContextGuard guard(&rctx);
      {
        std::optional<RecordingScope> recording;
        if (rec->policy->check) recording.emplace(&metas);
        y = rec->fn(xd);
        record_tensor(y);
      }
      if (rec->policy->check) rctx.check_consumed();
    }
    ++rec->stats->recomputes;
    if (rec->policy->check) check_same_metadata(rec->unit, rec->metas, metas);
    // Free what the forward kept now rather than when the whole graph goes.
    rec->kept.clear();
    rec->kept_versions.clear();
    rec->decisions.clear();
    rec->metas.clear();
    rec->rng = GeneratorStates();
    // Reentrant backward through the recomputed unit: parameter gradients accumulate
    // into their .grad (FSDP's accumulator hooks fire), the input's into xd.grad.
    if (y.requires_grad()) torch::autograd::backward({y}, {grads[0]});
    return {x_grad ? xd.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// "layers.<i>" → i, else -1.
int64_t block_index(const std::string& unit) {
  static const std::string prefix = "layers.";
  if (unit.compare(0, prefix.size(), prefix) != 0 || unit.size() == prefix.size()) return -1;
  int64_t i = 0;
  for (size_t k = prefix.size(); k < unit.size(); ++k) {
    if (unit[k] < '0' || unit[k] > '9') return -1;
    i = i * 10 + (unit[k] - '0');
  }
  return i;
}

}  // namespace

// ---------------------------------------------------------------------------------------
ActivationCheckpoint::ActivationCheckpoint(ACOptions options, const std::vector<ModelUnit>& units)
    : opt_(std::move(options)), stats_(std::make_shared<ACStats>()) {
  auto policy = std::make_shared<Policy>();
  if (opt_.mode == ACMode::None) {
    every_n_ = 0;
  } else if (opt_.mode == ACMode::Full) {
    every_n_ = 1;
  } else if (opt_.mode == ACMode::Selective) {
    if (opt_.selective_ac_option == "op") {
      every_n_ = 1;
      op_sac_ = true;
    } else if (is_positive_int_or_op(opt_.selective_ac_option)) {
      every_n_ = std::stol(opt_.selective_ac_option);
    } else {
      throw UserError("config error: activation_checkpoint.selective_ac_option = \"" + opt_.selective_ac_option +
                      "\" is not valid (expected a positive integer or \"op\")");
    }
  } else {
    throw UserError("not supported yet: activation_checkpoint.mode = \"" + std::string(key_name(opt_.mode)) +
                    "\" (ctitan supports: \"none\", \"full\", \"selective\")");
  }
  if (opt_.determinism_check != "default" && opt_.determinism_check != "none")
    throw UserError("config error: activation_checkpoint.determinism_check = \"" + opt_.determinism_check +
                    "\" is not one of: default, none");
  policy->op_sac = op_sac_;
  policy->preserve_rng = opt_.preserve_rng_state;
  policy->check = opt_.determinism_check == "default";
  // torchtitan: Linear modules whose fully qualified name contains one of the strings.
  for (const auto& u : units)
    for (const auto& [fqn, t] : u.params) {
      static const std::string suffix = ".weight";
      if (t.dim() != 2 || fqn.size() <= suffix.size() ||
          fqn.compare(fqn.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const std::string module = fqn.substr(0, fqn.size() - suffix.size());
      for (const auto& f : opt_.force_recompute_mm_fqns)
        if (!f.empty() && module.find(f) != std::string::npos) policy->force_recompute_shapes.insert(t.sizes().vec());
    }
  policy_ = std::move(policy);
}

ActivationCheckpoint::~ActivationCheckpoint() = default;

bool ActivationCheckpoint::applies_to(const std::string& unit) const {
  if (every_n_ == 0) return false;
  const int64_t i = block_index(unit);
  return i >= 0 && (i + 1) % every_n_ == 0;
}

int64_t ActivationCheckpoint::checkpointed_units(const std::vector<ModelUnit>& units) const {
  int64_t n = 0;
  for (const auto& u : units) n += applies_to(u.name);
  return n;
}

UnitFn ActivationCheckpoint::wrap(const std::string& unit, UnitFn fn) {
  if (!applies_to(unit)) return fn;
  std::shared_ptr<const Policy> policy = policy_;
  std::shared_ptr<ACStats> stats = stats_;
  return [unit, fn = std::move(fn), policy, stats](const at::Tensor& x) -> at::Tensor {
    if (!at::GradMode::is_enabled()) return fn(x);  // evaluation: nothing to recompute
    auto rec = c10::make_intrusive<CheckpointRecord>();
    rec->unit = unit;
    rec->fn = fn;
    rec->policy = policy;
    rec->stats = stats;
    const at::Tensor anchor = at::empty({0}, x.options().dtype(at::kFloat)).requires_grad_(true);
    return CheckpointFunction::apply(x, anchor, rec);
  };
}

UnitWrapper compose(UnitWrapper outer, UnitTransform inner) {
  return [outer = std::move(outer), inner = std::move(inner)](const std::string& unit, const UnitFn& fn,
                                                              const at::Tensor& x) -> at::Tensor {
    const UnitFn f = inner ? inner(unit, fn) : fn;
    return outer ? outer(unit, f, x) : f(x);
  };
}

}  // namespace ctitan
