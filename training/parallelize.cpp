#include "training/parallelize.h"

#include <optional>
#include <vector>

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "kernels/fused_cuda.h"

namespace ctitan {
namespace {

// Whether a GPU run's AdamW is ctitan's kernel (CTITAN_GPU_KERNELS=ctitan; CUDA build only).
bool own_gpu_adamw() {
#ifdef CTITAN_WITH_CUDA
  return own_gpu_kernels();
#else
  return false;
#endif
}

// init_unit: for a model built with ModelInit::Deferred, what fills each unit before FSDP
// keeps this rank's rows (empty: the shards start as zeros for a checkpoint to fill).
// On a GPU the shards and the unsharded parameters live there, the units being initialised on
// the CPU first (the values a CPU run has).
std::shared_ptr<FSDP> maybe_apply_fsdp(TrainModel& model, const JobConfig& cfg, Parallelism& par, bool sharded,
                                       const DeviceChoice& device, const std::function<void(size_t)>& init_unit) {
  if (!sharded) return nullptr;
  if (par.dims.dp() <= 1) par.shard = par.fsdp_shard = Comm::single("local");
  const std::string reshard = fsdp_reshard_policy(cfg, par.dims.dp());
  auto opts = fsdp_options(reshard, cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce);
  opts.prefetch = cfg.parallelism.fsdp_prefetch;
  if (device.cuda) opts.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device.index));
  opts.keep_compute_grads = fsdp_keeps_compute_grads(cfg, device.cuda, own_gpu_adamw(), par.dims.tp_enabled());
  auto fsdp = std::make_shared<FSDP>(model.units(), par.fsdp_shard, par.fsdp_replicate, opts, init_unit);
  if (par.fsdp_reduce_scatter) fsdp->use_reduce_scatter_group(par.fsdp_reduce_scatter);
  model.set_unit_runner(fsdp->wrapper());
  if (par.dims.dp() <= 1)
    spdlog::info("mixed precision on one process: {} compute, float32 master weights and optimizer state, {}",
                 cfg.training.mixed_precision_param,
                 one_rank_keeps_bf16_grads(cfg, device.cuda, par.dims.tp_enabled(), 1)
                     ? "bfloat16 gradients as autograd makes them (float32 when a step has several micro-batches)"
                     : cfg.training.mixed_precision_reduce + " gradients");
  else
    spdlog::info("FSDP: {} units sharded over {} ranks (replicate {}), params {}, reduce {}, reshard_after_forward {}",
                 model.units().size(), par.dims.dp_shard, par.dims.dp_replicate, cfg.training.mixed_precision_param,
                 cfg.training.mixed_precision_reduce, cfg.parallelism.fsdp_reshard_after_forward);
  return fsdp;
}

// Activation checkpointing of the blocks, applied before FSDP as torchtitan does. AC installs
// a transform and FSDP a runner, each in its own slot of the model (models/unit_runner.h), so
// the model runs FSDP(AC(block)) in either order: FSDP's runner calls the unit function AC made
// checkpointed, and a recompute re-uses the parameters FSDP gathered for backward.
std::shared_ptr<ActivationCheckpoint> maybe_apply_ac(TrainModel& model, const JobConfig& cfg) {
  const auto& c = cfg.activation_checkpoint;
  if (c.mode == ACMode::None) return nullptr;
  const std::vector<ModelUnit> units = model.units();
  auto ac = std::make_shared<ActivationCheckpoint>(ac_options(c), units);
  model.set_unit_transform([ac](const std::string& u, const UnitFn& fn) { return ac->wrap(u, fn); });
  spdlog::info("activation checkpointing: {}{} on {} of {} blocks (preserve_rng_state {}, determinism_check {})",
               key_name(c.mode), c.mode == ACMode::Selective ? " " + c.selective_ac_option : "",
               ac->checkpointed_units(units), model.n_layers, c.preserve_rng_state, c.determinism_check);
  return ac;
}

// Tensor parallelism (torchtitan's apply_tp, before AC and FSDP): each parameter of the plan cut
// to this tp rank's share and the layers' collectives installed. A model built deferred (no
// storage) is initialised here one unit at a time, the full unit drawn from the seed as a one-
// process init draws it and then cut, so FSDP, after it, finds values and draws nothing more.
std::shared_ptr<TensorParallel> maybe_apply_tp(TrainModel& model, ParallelizeArgs& p) {
  if (!p.par.dims.tp_enabled()) return nullptr;
  std::optional<TPPlan> plan = model.tp_plan ? model.tp_plan() : std::nullopt;
  if (!plan)
    throw UserError("not supported yet: parallelism.tensor_parallel_degree = " + std::to_string(p.par.dims.tp) +
                    " for model.name = " + p.cfg.model.name + ": its blocks have no tensor-parallel plan (issue 35)");
  TPOptions o;
  o.loss_parallel = !p.cfg.parallelism.disable_loss_parallel;
  auto tp = std::make_shared<TensorParallel>(p.par.tp, o);
  tp->apply(model.units(), *plan, p.init_unit);
  p.init_unit = nullptr;  // drawn above (or left to a checkpoint): FSDP keeps rows of what is there
  if (o.loss_parallel)
    model.loss = [tp](const torch::Tensor& logits, const torch::Tensor& labels, double scale) {
      return tp->vocab_parallel_cross_entropy(logits, labels, scale);
    };
  spdlog::info(
      "tensor parallelism: {} ranks (tp rank {}): attention heads, FFN hidden units and the vocabulary split, the "
      "norms replicated ({} parameters), sequence parallel between blocks, loss parallel {}",
      tp->degree(), tp->rank(), tp->replicated().size(), o.loss_parallel ? "on" : "off");
  return tp;
}

}  // namespace

bool fsdp_keeps_compute_grads(const JobConfig& cfg, bool cuda, bool own_gpu_kernels, bool tensor_parallel) {
  return cfg.optimizer.name == "AdamW" && (!cuda || own_gpu_kernels) && !tensor_parallel;
}

bool one_rank_keeps_bf16_grads(const JobConfig& cfg, bool cuda, bool tensor_parallel, int64_t micro_batches) {
  const auto& t = cfg.training;
  return t.mixed_precision_param == "bfloat16" &&
         (t.mixed_precision_reduce == "float32" || t.mixed_precision_reduce == "bfloat16") && micro_batches == 1 &&
         fsdp_keeps_compute_grads(cfg, cuda, own_gpu_adamw(), tensor_parallel);
}

// FSDP's reshard_after_forward as it applies on dp ranks. One process: freeing the bf16
// copies after forward saves little and costs a second cast in backward, so "default" keeps
// them (explicit "always" still frees).
std::string fsdp_reshard_policy(const JobConfig& cfg, int64_t dp) {
  return dp <= 1 && cfg.parallelism.fsdp_reshard_after_forward == "default"
             ? "never"
             : cfg.parallelism.fsdp_reshard_after_forward;
}

void default_parallelize(TrainModel& model, ParallelizeArgs& p) {
  p.tp = maybe_apply_tp(model, p);
  p.ac = maybe_apply_ac(model, p.cfg);
  p.fsdp = maybe_apply_fsdp(model, p.cfg, p.par, p.sharded, p.device, p.init_unit);
}

void parallelize(const ModelSpec& spec, TrainModel& model, ParallelizeArgs& p) {
  if (spec.parallelize)
    spec.parallelize(model, p);
  else
    default_parallelize(model, p);
}

}  // namespace ctitan
