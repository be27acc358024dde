// Glue between the checkpoint manager and the trainer's objects (FSDP, process groups, the
// data loader). Header-only and included by train.cpp alone: it uses the parallelisms and
// datasets libraries, which the checkpoint library itself does not link.
#pragma once
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.h"
#include "components/lr_scheduler.h"
#include "config/errors.h"
#include "datasets/json_lite.h"
#include "datasets/text_source.h"
#include "datasets/tokenizer.h"
#include "models/llama/model.h"
#include "parallelisms/comm.h"
#include "parallelisms/fsdp.h"

namespace ctitan {

// The parameters as this rank holds them: FSDP's fp32 shards (the optimizer's tensors), or
// the model's own full parameters on one process.
inline std::vector<ShardedParam> sharded_params(const torch::nn::Module& model, FSDP* fsdp) {
  std::vector<ShardedParam> out;
  if (fsdp) {
    for (const auto& fqn : fsdp->fqns()) {
      const auto rows = fsdp->local_rows(fqn);
      out.push_back({fqn, fsdp->local_shard(fqn), fsdp->global_shape(fqn), rows.first, rows.second});
    }
    return out;
  }
  for (const auto& kv : model.named_parameters()) {
    const auto& t = kv.value();
    out.push_back({kv.key(), t, t.sizes().vec(), 0, t.dim() ? t.size(0) : 1});
  }
  return out;
}

// The checkpoint manager's collectives over the world group: strings are all-gathered as
// their lengths, then as bytes padded to the longest. arrive/missing use the rendezvous
// store to name the ranks that never reached a point (a killed rank cannot say so itself).
inline CheckpointComm checkpoint_comm(const std::shared_ptr<Comm>& world, c10::intrusive_ptr<c10d::Store> store) {
  if (!world) return CheckpointComm::single_process();
  CheckpointComm c;
  c.rank = world->rank();
  c.world_size = world->size();
  c.all_gather = [world](const std::string& mine, const std::string& tag) {
    const int64_t N = world->size();
    auto len = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64);
    auto lens = torch::empty({N}, torch::kInt64);
    world->all_gather_flat(len, lens, tag + ":len").wait();
    int64_t mx = 1;
    for (int64_t r = 0; r < N; ++r) mx = std::max(mx, lens[r].item<int64_t>());
    auto buf = torch::zeros({mx}, torch::kUInt8);
    std::memcpy(buf.data_ptr(), mine.data(), mine.size());
    auto all = torch::empty({N * mx}, torch::kUInt8);
    world->all_gather_flat(buf, all, tag).wait();
    std::vector<std::string> out;
    const char* base = static_cast<const char*>(all.data_ptr());
    for (int64_t r = 0; r < N; ++r) out.emplace_back(base + r * mx, static_cast<size_t>(lens[r].item<int64_t>()));
    return out;
  };
  auto counts = std::make_shared<std::map<std::string, int64_t>>();
  auto key = [counts](const std::string& tag, int64_t r) {
    return "ctitan_ckpt/" + tag + "#" + std::to_string((*counts)[tag]) + "/" + std::to_string(r);
  };
  const int64_t rank = c.rank, N = c.world_size;
  c.arrive = [store, counts, key, rank](const std::string& tag) {
    ++(*counts)[tag];
    try {
      store->set(key(tag, rank), std::vector<uint8_t>{'1'});
    } catch (const std::exception&) {
      // The store host is gone; the collective that follows reports it.
    }
  };
  c.missing = [store, key, N](const std::string& tag) {
    std::vector<int64_t> out;
    for (int64_t r = 0; r < N; ++r)
      if (!store->check({key(tag, r)})) out.push_back(r);
    return out;
  };
  return c;
}

// ---- torchtitan's extra DCP keys -----------------------------------------------------------
//
// checkpoint.format = "dcp": beside ctitan's entries, what torchtitan's flattened state dict
// holds and its dcp.load asks for: the optimizer's param group per parameter
// (get_optimizer_state_dict(..., flatten_optimizer_state_dict=True): lr, betas, eps,
// weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused,
// decoupled_weight_decay, initial_lr, as PyTorch 2.13's AdamW has them) and LambdaLR's state
// (base_lrs, last_epoch, _step_count, _is_initial, _get_lr_called_within_step, _last_lr).
// The LR is the one the next step uses, as PyTorch's group holds it after scheduler.step().
inline std::function<void(StateDict&)> torchtitan_dcp_extras(torch::optim::Optimizer& opt,
                                                             std::vector<std::string> fqns,
                                                             const LRScheduler& lr) {
  return [&opt, fqns, &lr](StateDict& sd) {
    using K = pickle::Value::Kind;
    auto val = [](K k) {
      auto v = std::make_shared<pickle::Value>();
      v->kind = k;
      return v;
    };
    auto num = [&](double x) {
      auto v = val(K::Float);
      v->f = x;
      return v;
    };
    auto flag = [&](bool b) {
      auto v = val(K::Bool);
      v->b = b;
      return v;
    };
    auto integer = [&](int64_t i) {
      auto v = val(K::Int);
      v->i = i;
      return v;
    };
    auto seq = [&](K k, std::vector<pickle::Ptr> xs) {
      auto v = val(k);
      v->items = std::move(xs);
      return v;
    };
    const auto& o = opt.param_groups().at(0).options();
    double eps = 0, wd = 0;
    std::tuple<double, double> betas;
    bool amsgrad = false, decoupled = false;
    if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
      eps = w->eps(), wd = w->weight_decay(), betas = w->betas(), amsgrad = w->amsgrad(), decoupled = true;
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
      eps = a->eps(), wd = a->weight_decay(), betas = a->betas(), amsgrad = a->amsgrad();
    } else {
      return;  // OptimizerState accepts Adam and AdamW only
    }
    const double now = lr.current_lr();
    for (const auto& fqn : fqns) {
      const std::string k = "optimizer.param_groups." + fqn + ".";
      sd.python_object(k + "lr", num(now));
      sd.python_object(k + "betas", seq(K::Tuple, {num(std::get<0>(betas)), num(std::get<1>(betas))}));
      sd.python_object(k + "eps", num(eps));
      sd.python_object(k + "weight_decay", num(wd));
      sd.python_object(k + "amsgrad", flag(amsgrad));
      sd.python_object(k + "maximize", flag(false));
      sd.python_object(k + "foreach", val(K::None));
      sd.python_object(k + "capturable", flag(false));
      sd.python_object(k + "differentiable", flag(false));
      sd.python_object(k + "fused", val(K::None));
      sd.python_object(k + "decoupled_weight_decay", flag(decoupled));
      sd.python_object(k + "initial_lr", num(lr.base_lr()));
    }
    sd.python_object("lr_scheduler.base_lrs", seq(K::List, {num(lr.base_lr())}));
    sd.python_object("lr_scheduler.last_epoch", integer(lr.last_step));
    sd.python_object("lr_scheduler._step_count", integer(lr.last_step + 1));
    sd.python_object("lr_scheduler._is_initial", flag(false));
    sd.python_object("lr_scheduler._get_lr_called_within_step", flag(false));
    sd.python_object("lr_scheduler._last_lr", seq(K::List, {num(now)}));
  };
}

// ---- dataloader redistribution ----------------------------------------------------------
//
// checkpoint.dataloader_reshard = "redistribute", when the dp degree changed from W to W'.
// Each saved rank r had read the global document stream up to position P_r = (epoch,
// next_document): it owns documents d ≡ r (mod W) and has taken every one below P_r; the
// tokens of those not yet emitted are in its buffer. Let P* = max_r P_r, the furthest any
// saved rank had read. Then:
//   1. For every saved rank r, carry_r = its buffer followed by the encodings (BOS … EOS)
//      of its own documents in [P_r, P*) — the ones it had not reached yet — read here from
//      the corpus with the same tokenizer.
//   2. New rank r' continues the stream at P* (taking documents d ≡ r' mod W' from there) and
//      first emits carry_r of every saved rank r with r mod W' = r', in order of r.
// Every document below P* is emitted exactly once, by the new rank that inherits its old
// owner, and every document from P* on exactly once by its new owner: no window is seen
// twice and no token is skipped (the bound on skipped windows is 0). What changes is only
// which rank emits a document and where window boundaries fall. Cost: reading the
// documents in [min_r P_r, P*), at most a few batches' worth.
struct LoaderPosition {
  int64_t epoch = 0;
  SourcePosition pos;
  std::string file_name;
  int64_t windows = 0, seq_len = 0, vocab = 0, dp_world = 0, skipped = 0;
  std::vector<int64_t> buffer;
  bool operator<(const LoaderPosition& o) const {
    return std::tie(epoch, pos.next_document) < std::tie(o.epoch, o.pos.next_document);
  }
};

inline LoaderPosition parse_loader_state(const std::string& state, int64_t saved_rank) {
  json::Value root;
  std::string err;
  const std::string where = "checkpoint: dataloader state of saved dp rank " + std::to_string(saved_rank);
  if (!json::parse(state, &root, &err) || root.type != json::Value::Type::Object)
    throw RuntimeFailure(where + " is not valid JSON: " + err);
  auto get = [&](const char* k) {
    const json::Value* v = root.find(k);
    int64_t out = 0;
    if (!v || !v->as_int64(&out)) throw RuntimeFailure(where + " has no integer \"" + std::string(k) + "\"");
    return out;
  };
  LoaderPosition p;
  p.epoch = get("epoch");
  p.pos.next_document = get("next_document");
  p.pos.file = static_cast<size_t>(get("file_index"));
  p.pos.offset = static_cast<uint64_t>(get("file_offset"));
  p.pos.line = get("file_line");
  p.windows = get("windows_produced");
  p.seq_len = get("seq_len");
  p.vocab = get("vocab_size");
  p.dp_world = get("dp_world");
  if (root.find("skipped_documents")) p.skipped = get("skipped_documents");
  if (const json::Value* f = root.find("file_name"); f && f->type == json::Value::Type::String) p.file_name = f->text;
  const json::Value* buf = root.find("buffer");
  if (!buf || buf->type != json::Value::Type::Array) throw RuntimeFailure(where + " has no \"buffer\"");
  for (const auto& item : buf->items) {
    int64_t id = 0;
    if (!item.as_int64(&id)) throw RuntimeFailure(where + ": \"buffer\" holds a non-integer");
    p.buffer.push_back(id);
  }
  return p;
}

// Builds dp rank `rank` of `world`'s loader state from the saved ranks' states (see above).
inline std::string redistribute_loader_states(const std::vector<std::string>& saved, int64_t rank, int64_t world,
                                              const Tokenizer& tokenizer, const std::string& source) {
  const int64_t W = static_cast<int64_t>(saved.size());
  std::vector<LoaderPosition> ps;
  for (int64_t r = 0; r < W; ++r) ps.push_back(parse_loader_state(saved[r], r));
  const LoaderPosition& far = *std::max_element(ps.begin(), ps.end());
  std::vector<int64_t> buffer;
  int64_t windows = 0, carried_docs = 0, buffered_tokens = 0, doc_tokens = 0, skipped = 0;
  for (int64_t r = rank; r < W; r += world) {
    const LoaderPosition& p = ps[r];
    buffer.insert(buffer.end(), p.buffer.begin(), p.buffer.end());
    buffered_tokens += static_cast<int64_t>(p.buffer.size());
    windows += p.windows;
    skipped += p.skipped;
    // Saved rank r's own documents between its position and the furthest one.
    DocumentReader reader(source);
    reader.seek(p.pos);
    reader.report_bad_documents(true);
    int64_t epoch = p.epoch;
    Document doc;
    while (std::make_tuple(epoch, reader.position().next_document) <
           std::make_tuple(far.epoch, far.pos.next_document)) {
      if (!reader.next(&doc)) {
        reader.rewind();
        ++epoch;
        continue;
      }
      if (doc.index % W != r) continue;
      if (!doc.error.empty()) {  // the loader reports or counts it when it gets there
        ++skipped;
        continue;
      }
      const std::vector<int32_t> ids = tokenizer.encode(doc.text, /*bos=*/true, /*eos=*/true);
      buffer.insert(buffer.end(), ids.begin(), ids.end());
      ++carried_docs;
      doc_tokens += static_cast<int64_t>(ids.size());
    }
  }
  spdlog::info("dataloader: redistributed from dp {} to dp {}: this rank continues at document {} (epoch {}) after "
               "{} carried tokens ({} buffered by saved ranks, {} from {} documents they had not reached)",
               W, world, far.pos.next_document, far.epoch, buffer.size(), buffered_tokens, doc_tokens,
               carried_docs);
  std::string s = "{\"format\":\"ctitan.dataloader\",\"version\":1";
  s += ",\"dp_rank\":" + std::to_string(rank) + ",\"dp_world\":" + std::to_string(world);
  s += ",\"seq_len\":" + std::to_string(far.seq_len) + ",\"vocab_size\":" + std::to_string(far.vocab);
  s += ",\"epoch\":" + std::to_string(far.epoch) + ",\"windows_produced\":" + std::to_string(windows);
  s += ",\"next_document\":" + std::to_string(far.pos.next_document);
  s += ",\"file_index\":" + std::to_string(far.pos.file) + ",\"file_name\":" + json::quote(far.file_name);
  s += ",\"file_offset\":" + std::to_string(far.pos.offset) + ",\"file_line\":" + std::to_string(far.pos.line);
  s += ",\"skipped_documents\":" + std::to_string(skipped);
  s += ",\"buffer\":[";
  for (size_t i = 0; i < buffer.size(); ++i) s += (i ? "," : "") + std::to_string(buffer[i]);
  s += "]}";
  return s;
}

}  // namespace ctitan
