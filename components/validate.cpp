// Validation loop; see validate.h.
#include "components/validate.h"

#include <chrono>

#include "config/errors.h"
#include "datasets/dataloader.h"
#include "kernels/fused_ops.h"

namespace ctitan {
namespace {

std::unique_ptr<DataLoader> open_loader(const Tokenizer& tok, const ValidationSpec& s, int64_t rank, int64_t world) {
  auto loader =
      std::make_unique<DataLoader>(tok, s.source, s.seq_len, s.local_batch_size, rank, world, "validation:" + s.source);
  // steps = -1 reads the set once; a fixed number of steps repeats it when it is short.
  loader->set_repeat(s.steps != -1);
  return loader;
}

}  // namespace

Validator::Validator(const Tokenizer& tokenizer, ValidationSpec spec, int64_t dp_rank, int64_t dp_world)
    : tokenizer_(&tokenizer), spec_(std::move(spec)), dp_rank_(dp_rank), dp_world_(dp_world) {
  auto probe = open_loader(tokenizer, spec_, dp_rank, dp_world);
  probe->set_repeat(false);
  if (!probe->has_next_batch())
    throw UserError("validation: " + spec_.source + " gives dp rank " + std::to_string(dp_rank) + " of " +
                    std::to_string(dp_world) + " less than one batch of validation.local_batch_size (" +
                    std::to_string(spec_.local_batch_size) + ") x validation.seq_len + 1 (" +
                    std::to_string(spec_.seq_len + 1) + ") tokens; use a larger set or a smaller batch");
}

ValidationMetrics Validator::validate(int64_t step, const Forward& forward, const SumOverRanks& sum_over_ranks,
                                      const Loss& loss) const {
  const auto t0 = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const int64_t B = spec_.local_batch_size, T = spec_.seq_len;
  auto loader = open_loader(*tokenizer_, spec_, dp_rank_, dp_world_);
  double loss_sum = 0;  // Σ token CE on this rank
  int64_t batches = 0;
  for (;;) {
    if (spec_.steps != -1 && batches >= spec_.steps) break;
    if (spec_.steps == -1) {  // every rank goes on only while every rank has a whole batch
      std::vector<double> ready = {loader->has_next_batch() ? 1.0 : 0.0};
      sum_over_ranks(ready);
      if (ready[0] < static_cast<double>(dp_world_)) break;
    }
    Batch batch = loader->next();
    auto inputs = torch::from_blob(batch.inputs.data(), {B, T}, torch::kInt64);   // [B, T]
    auto labels = torch::from_blob(batch.labels.data(), {B * T}, torch::kInt64);  // [B·T]
    auto logits = forward(inputs);                                                // [B, T, V]
    const auto flat = logits.reshape({B * T, -1});
    const auto on_device = labels.to(logits.device());
    loss_sum += (loss ? loss(flat, on_device, 1.0) : fused_cross_entropy(flat, on_device, 1.0)).item<double>();
    ++batches;
  }
  const double local_tokens = static_cast<double>(batches * B * T);
  std::vector<double> totals = {loss_sum, local_tokens};
  sum_over_ranks(totals);
  ValidationMetrics v;
  v.step = step;
  v.loss = totals[0] / totals[1];
  v.tokens = totals[1];
  v.batches = static_cast<double>(batches);
  v.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  v.tps = local_tokens / v.seconds;
  return v;
}

}  // namespace ctitan
