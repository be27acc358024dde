#include "training/checkpointing.h"

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "training/adapters.h"

namespace ctitan {
namespace {

// The loader's own state string (datasets/sharding.h owns its format and redistribution), as
// of the batches trained on.
std::unique_ptr<DataLoaderState> dataloader_state(const CheckpointOptions& options, const Parallelism& par,
                                                  BatchPrefetcher& batches) {
  BatchPrefetcher* l = &batches;
  return std::make_unique<DataLoaderState>(
      [l] { return l->state_dict(); }, [l](const std::string& s) { l->load_state_dict(s); }, par.dp_rank, par.dims.dp(),
      options.dataloader_reshard,
      [l](const std::vector<std::string>& saved, int64_t, int64_t) { return l->redistributed_state(saved); },
      par.dims.tp_index(par.env.rank) == 0);  // a dp rank's tp ranks read the same batches: one stores them
}

}  // namespace

std::unique_ptr<Checkpointing> build_checkpointing(const CheckpointOptions& options, const HFAdapter& families,
                                                   const Parallelism& par, TrainModel& model, FSDP* fsdp,
                                                   torch::optim::Optimizer& opt, LRScheduler& lr,
                                                   BatchPrefetcher& batches, TrainState& ts, uint64_t seed,
                                                   const TensorParallel* tp) {
  auto c = std::make_unique<Checkpointing>();
  CheckpointComm comm = par.dist ? checkpoint_comm(par.dist->world, par.dist->store) : CheckpointComm::single_process();
  comm.dp_replicate = par.dims.dp_replicate;
  comm.dp_shard = par.dims.dp_shard;
  c->manager = std::make_unique<CheckpointManager>(options, std::move(comm));
  c->manager->set_hf_adapter(families);
  // HSDP replicas hold the same rows: the first replica stores them.
  const bool first_replica = par.dims.replicate_index(par.env.rank) == 0;
  const std::vector<ShardedParam> sp = sharded_params(*model.module, fsdp, tp);
  c->model = std::make_unique<ModelState>(sp, first_replica);
  c->optimizer = std::make_unique<OptimizerState>(opt, sp, first_replica);
  c->lr_scheduler = std::make_unique<ScalarsState>(
      "lr_scheduler", std::vector<std::pair<std::string, int64_t*>>{{"last_step", &lr.last_step}});
  c->train_state = std::make_unique<ScalarsState>(
      "train_state",
      std::vector<std::pair<std::string, int64_t*>>{{"step", &ts.step}, {"ntokens_seen", &ts.ntokens_seen}});
  c->dataloader = dataloader_state(options, par, batches);
  c->rng = std::make_unique<RngState>(par.env.rank, seed);
  std::vector<std::string> fqns;
  for (const auto& p : sp) fqns.push_back(p.fqn);
  c->manager->set_dcp_extras(torchtitan_dcp_extras(opt, fqns, lr));
  c->manager->add("model", c->model.get());
  c->manager->add("optimizer", c->optimizer.get());
  c->manager->add("lr_scheduler", c->lr_scheduler.get());
  c->manager->add("dataloader", c->dataloader.get());
  c->manager->add("train_state", c->train_state.get());
  c->manager->add("rng", c->rng.get());
  return c;
}

void maybe_save(CheckpointManager& manager, int64_t step, bool last_step, SaveFailurePolicy on_failure) {
  try {
    manager.save(step, last_step);
  } catch (const CollectiveFailure&) {
    throw;
  } catch (const RuntimeFailure& e) {
    if (on_failure != SaveFailurePolicy::Continue || last_step) throw;
    spdlog::warn("{}; training continues (checkpoint.on_save_failure = \"continue\")", e.what());
  }
}

}  // namespace ctitan
