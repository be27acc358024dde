// Sampling with a KV cache; see generate.h.
#include "tools/generate.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "checkpoint/dcp.h"
#include "checkpoint/format.h"
#include "checkpoint/options.h"
#include "config/cli.h"
#include "config/errors.h"
#include "config/job_config.h"
#include "datasets/tokenizer.h"
#include "models/hf_adapter.h"
#include "models/registry.h"
#include "util/strings.h"

namespace fs = std::filesystem;

namespace ctitan {

int64_t sample_token(const at::Tensor& logits_in, const SamplingOptions& o, at::Generator& gen) {
  TORCH_CHECK(logits_in.dim() == 1, "[generate] sample_token expects logits [V], got ", logits_in.sizes());
  const at::Tensor logits = logits_in.to(torch::kFloat);
  if (o.temperature == 0) return logits.argmax().item<int64_t>();
  auto scores = logits / o.temperature;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  const int64_t V = scores.size(0);
  if (o.top_k > 0 && o.top_k < V) {
    // Below the k-th largest score: removed (ties with it stay, as transformers' TopK warper).
    const auto kth = std::get<0>(scores.topk(o.top_k)).select(0, o.top_k - 1);
    scores = scores.masked_fill(scores < kth, minus_inf);
  }
  if (o.top_p < 1.0) {
    // Most likely first; a token is removed when the tokens before it already reach top_p
    // (so the most likely one always stays).
    const auto sorted = scores.sort(/*dim=*/0, /*descending=*/true);
    const auto& sorted_scores = std::get<0>(sorted);
    const auto& order = std::get<1>(sorted);
    const auto probs = torch::softmax(sorted_scores, 0);
    const auto before = probs.cumsum(0) - probs;
    const auto drop_sorted = before >= o.top_p;
    const auto drop = torch::zeros_like(drop_sorted).scatter(0, order, drop_sorted);
    scores = scores.masked_fill(drop, minus_inf);
  }
  const auto probs = torch::softmax(scores, 0);
  return torch::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

GenerateResult generate_tokens(const InferenceModel& model, const std::vector<int64_t>& prompt, int64_t max_new_tokens,
                               const SamplingOptions& sampling, uint64_t seed, int64_t eos_id,
                               const std::function<void(int64_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  r.prompt = prompt;
  const int64_t P = static_cast<int64_t>(prompt.size());
  TORCH_CHECK(P > 0 && P <= model.max_seq_len, "[generate] prompt of ", P, " tokens, limit ", model.max_seq_len);
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  KVCache cache = model.new_cache(1, model.max_seq_len);
  const auto t0 = clock::now();
  at::Tensor logits = model.forward_cached(torch::tensor(prompt, torch::kInt64).view({1, P}), cache);
  auto t1 = clock::now();
  r.prefill_s = std::chrono::duration<double>(t1 - t0).count();
  r.stop = "max_new_tokens";
  for (int64_t n = 0; n < max_new_tokens; ++n) {
    const int64_t next = sample_token(logits[0][logits.size(1) - 1], sampling, gen);
    on_token(next);
    if (eos_id >= 0 && next == eos_id) {
      r.stop = "eos";
      break;
    }
    r.generated.push_back(next);
    if (n + 1 == max_new_tokens) break;
    if (cache.pos >= cache.capacity()) {
      r.stop = "max_seq_len";
      break;
    }
    logits = model.forward_cached(torch::tensor({next}, torch::kInt64).view({1, 1}), cache);
  }
  r.decode_s = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

namespace {

const char* const kUsage =
    "usage: generate <checkpoint> [--tokenizer PATH] (--prompt TEXT | --prompt-ids ID,ID,...) [options]\n"
    "       generate --config TRAIN.toml [<checkpoint>] (--prompt TEXT | --prompt-ids ...) [options]\n"
    "  <checkpoint>       a step folder (ctitan or torch.distributed.checkpoint), a folder of step-<N>\n"
    "                     folders (the newest complete one), a Hugging Face folder, or a consolidated .pt;\n"
    "                     with --config: <job.dump_folder>/<checkpoint.folder> unless given\n"
    "  --config FILE      the training TOML: its checkpoint folder, tokenizer and training.seq_len\n"
    "  --tokenizer PATH   tokenizer.json, vocab.json, a sentencepiece .model, or a folder holding one\n"
    "                     (default: the run's, or the HF checkpoint folder's own tokenizer.json)\n"
    "  --prompt TEXT      encoded with BOS, as training framed documents (--no-bos: without)\n"
    "  --prompt-ids LIST  token ids instead of text (no tokenizer needed; output is ids)\n"
    "  --max-new-tokens N tokens to generate at most (default 64)\n"
    "  --temperature T    0 (default): greedy; > 0: sample from softmax(logits / T)\n"
    "  --top-k K          sample among the K most likely tokens only (0, default: all)\n"
    "  --top-p P          nucleus sampling: the most likely tokens reaching probability P (default 1)\n"
    "  --seed S           seed of the sampling generator (default 0)\n"
    "  --ignore-eos       do not stop at the tokenizer's end-of-sequence token\n"
    "  --max-seq-len N    positions the model may use (default: training.seq_len with --config, the HF\n"
    "                     config's max_position_embeddings, else the flavor's)\n"
    "  --ids-out FILE     also write {\"prompt_ids\", \"generated_ids\", \"stop\", \"tokens_per_s\"} as JSON\n"
    "  --model M, --flavor F  for checkpoints that record neither (DCP, .pt)\n"
    "  --threads N        intra-op threads (default: LibTorch's, one per core); a small model's per-token\n"
    "                     matmuls are too short to share (docs/checkpoints.md: 1 thread was faster for the debug "
    "model)\n"
    "stdout: the prompt and the continuation as it is generated; stderr: the tokens/s line.\n"
    "exit status: 0 done; 2 bad input (missing checkpoint, unknown option, prompt too long); 1 a failure\n";

int64_t parse_int(const std::string& opt, const std::string& v) {
  const auto x = parse_int64(v);
  if (!x) throw UserError("generate: " + opt + " " + v + " is not an integer");
  return *x;
}

double parse_real(const std::string& opt, const std::string& v) {
  size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(v, &pos);
  } catch (const std::exception&) {
    pos = std::string::npos;
  }
  if (pos != v.size() || v.empty() || !std::isfinite(x))
    throw UserError("generate: " + opt + " " + v + " is not a number");
  return x;
}

// The newest complete step of a folder of step-<N> folders, or the path itself.
std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw UserError("generate: checkpoint " + path + " does not exist");
  if (!fs::is_directory(path, ec) || fs::exists(fs::path(path) / "metadata", ec) || dcp::is_dcp_folder(path) ||
      is_hf_folder(path))
    return path;
  const auto scan = ckpt::scan_folder(path);
  if (scan.complete.empty())
    throw UserError("generate: " + path +
                    " is neither a checkpoint nor a folder holding a complete step-<N> checkpoint");
  return ckpt::step_dir(path, scan.complete.back());
}

// Text decoded from ids so far, printed as it grows: only complete UTF-8 characters, and only
// once the decoded text extends what was printed (a token may change how the previous ones
// decode, e.g. a sentencepiece piece's leading space).
class TextStream {
 public:
  TextStream(const Tokenizer& tok, std::vector<int32_t> prompt) : tok_(tok), ids_(std::move(prompt)) {
    printed_ = tok_.decode(ids_);
    std::cout << printed_ << std::flush;
  }
  void add(int64_t id) {
    ids_.push_back(static_cast<int32_t>(id));
    const std::string text = tok_.decode(ids_);
    if (text.compare(0, printed_.size(), printed_) != 0) return;  // not an extension (yet)
    size_t end = text.size();
    // Hold back an incomplete UTF-8 sequence at the end, and a U+FFFD a byte-level decoder
    // gives for one.
    size_t lead = end;
    while (lead > printed_.size() && (static_cast<unsigned char>(text[lead - 1]) & 0xC0) == 0x80) --lead;
    if (lead > printed_.size()) {
      const unsigned char c = static_cast<unsigned char>(text[lead - 1]);
      const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      if (end - (lead - 1) < need) end = lead - 1;
    }
    if (end >= printed_.size() + 3 && text.compare(end - 3, 3, "\xEF\xBF\xBD") == 0) end -= 3;
    if (end <= printed_.size()) return;
    std::cout << text.substr(printed_.size(), end - printed_.size()) << std::flush;
    printed_ = text.substr(0, end);
  }
  void finish() {
    const std::string text = tok_.decode(ids_);
    if (text.size() > printed_.size() && text.compare(0, printed_.size(), printed_) == 0)
      std::cout << text.substr(printed_.size());
    std::cout << std::endl;
  }

 private:
  const Tokenizer& tok_;
  std::vector<int32_t> ids_;
  std::string printed_;
};

std::string sampling_text(const SamplingOptions& so, uint64_t seed) {
  if (so.temperature == 0) return "greedy";
  char buf[160];
  std::snprintf(buf, sizeof buf, "temperature %g, top-k %lld, top-p %g, seed %llu", so.temperature,
                static_cast<long long>(so.top_k), so.top_p, static_cast<unsigned long long>(seed));
  return buf;
}

std::string ids_json(const std::vector<int64_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

// generate's command line (see kUsage).
struct GenerateArgs {
  std::string source, config_file, tokenizer_arg, prompt, prompt_ids, ids_out, model_arg, flavor_arg;
  bool have_prompt = false, have_ids = false, bos = true, ignore_eos = false, help = false;
  int64_t max_new = 64, max_seq_arg = 0, threads = 0;
  uint64_t seed = 0;
  SamplingOptions so;
};

void set_option(GenerateArgs& g, const std::string& a, const std::string& v) {
  if (a == "--config")
    g.config_file = v;
  else if (a == "--tokenizer")
    g.tokenizer_arg = v;
  else if (a == "--prompt")
    g.prompt = v, g.have_prompt = true;
  else if (a == "--prompt-ids")
    g.prompt_ids = v, g.have_ids = true;
  else if (a == "--max-new-tokens")
    g.max_new = parse_int(a, v);
  else if (a == "--temperature")
    g.so.temperature = parse_real(a, v);
  else if (a == "--top-k")
    g.so.top_k = parse_int(a, v);
  else if (a == "--top-p")
    g.so.top_p = parse_real(a, v);
  else if (a == "--seed")
    g.seed = static_cast<uint64_t>(parse_int(a, v));
  else if (a == "--max-seq-len")
    g.max_seq_arg = parse_int(a, v);
  else if (a == "--ids-out")
    g.ids_out = v;
  else if (a == "--model")
    g.model_arg = v;
  else if (a == "--flavor")
    g.flavor_arg = v;
  else if (a == "--threads")
    g.threads = parse_int(a, v);
}

// The options in order; stops at --help (help set).
GenerateArgs parse_args(const std::vector<std::string>& args) {
  GenerateArgs g;
  static const std::map<std::string, bool> takes_value = {
      {"--config", true},         {"--tokenizer", true},   {"--prompt", true},  {"--prompt-ids", true},
      {"--max-new-tokens", true}, {"--temperature", true}, {"--top-k", true},   {"--top-p", true},
      {"--seed", true},           {"--max-seq-len", true}, {"--ids-out", true}, {"--model", true},
      {"--flavor", true},         {"--threads", true},     {"--no-bos", false}, {"--ignore-eos", false}};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      g.help = true;
      return g;
    }
    if (a.rfind("--", 0) != 0) {
      if (!g.source.empty()) throw UserError("generate: a second checkpoint \"" + a + "\" (one is read; see --help)");
      g.source = a;
      continue;
    }
    const auto it = takes_value.find(a);
    if (it == takes_value.end()) throw UserError("generate: unknown option " + a + " (see --help)");
    if (!it->second) {
      if (a == "--no-bos") g.bos = false;
      if (a == "--ignore-eos") g.ignore_eos = true;
      continue;
    }
    if (i + 1 >= args.size()) throw UserError("generate: " + a + " needs a value");
    set_option(g, a, args[++i]);
  }
  return g;
}

void check_args(const GenerateArgs& g) {
  if (g.have_prompt == g.have_ids)
    throw UserError("generate: give exactly one of --prompt TEXT and --prompt-ids LIST (see --help)");
  if (g.max_new < 1) throw UserError("generate: --max-new-tokens must be at least 1, got " + std::to_string(g.max_new));
  if (g.so.temperature < 0) throw UserError("generate: --temperature must be >= 0");
  if (g.so.top_k < 0) throw UserError("generate: --top-k must be >= 0");
  if (!(g.so.top_p > 0 && g.so.top_p <= 1)) throw UserError("generate: --top-p must be in (0, 1]");
  if (g.max_seq_arg < 0) throw UserError("generate: --max-seq-len must be positive");
  if (g.threads < 0) throw UserError("generate: --threads must be positive");
}

// Where the model and the tokenizer come from, and the sequence limit.
struct Inputs {
  std::string source, tok_path;
  int64_t max_seq = 0;
  ModelTensors m;
};

Inputs resolve_inputs(const GenerateArgs& g) {
  std::string source = g.source, tok_path;
  int64_t max_seq = 0;
  if (!g.config_file.empty()) {
    if (!fs::exists(g.config_file)) throw UserError("generate: --config " + g.config_file + " does not exist");
    const JobConfig cfg = load_job_config({"--job.config_file", g.config_file}).config;
    if (source.empty()) source = checkpoint_options(cfg).folder;
    if (g.tokenizer_arg.empty() && g.have_prompt)
      tok_path = resolve_tokenizer_path(cfg.model.tokenizer_path, cfg.model.hf_assets_path);
    max_seq = cfg.training.seq_len;
  }
  if (source.empty()) throw UserError("generate: no checkpoint given (a path, or --config; see --help)");
  source = resolve_checkpoint(source);
  if (!g.tokenizer_arg.empty()) {
    std::error_code ec;
    tok_path = fs::is_directory(g.tokenizer_arg, ec) ? resolve_tokenizer_path("", g.tokenizer_arg)
                                                     : resolve_tokenizer_path(g.tokenizer_arg, "");
  }
  ModelTensors m = open_model(source, g.model_arg, g.flavor_arg, hf_adapter());
  if (tok_path.empty() && g.have_prompt) {
    if (m.form == "hf" &&
        (fs::exists(fs::path(source) / "tokenizer.json") || fs::exists(fs::path(source) / "vocab.json") ||
         fs::exists(fs::path(source) / "tokenizer.model")))
      tok_path = resolve_tokenizer_path("", source);
    else
      throw UserError("generate: no tokenizer for the prompt: pass --tokenizer PATH (or --config, or --prompt-ids)");
  }
  if (m.hf_config && max_seq == 0 && m.hf_config->max_position_embeddings > 0)
    max_seq = m.hf_config->max_position_embeddings;
  if (g.max_seq_arg > 0) max_seq = g.max_seq_arg;
  if (max_seq == 0) max_seq = model_spec(m.model_name).max_seq_len(m.flavor);
  return Inputs{source, tok_path, max_seq, std::move(m)};
}

// The prompt's ids: the text through the tokenizer (loaded into *tok), or --prompt-ids.
std::vector<int64_t> prompt_tokens(const GenerateArgs& g, const Inputs& in, std::unique_ptr<Tokenizer>* tok) {
  std::vector<int64_t> ids;
  const int64_t vocab = in.m.vocab_size();
  if (g.have_prompt) {
    *tok = Tokenizer::load(in.tok_path);
    if ((*tok)->vocab_size() > vocab)
      throw UserError("generate: tokenizer " + in.tok_path + " has " + std::to_string((*tok)->vocab_size()) +
                      " ids, the model's vocabulary only " + std::to_string(vocab));
    for (int32_t id : (*tok)->encode(g.prompt, g.bos, false)) ids.push_back(id);
  } else {
    std::stringstream ss(g.prompt_ids);
    for (std::string t; std::getline(ss, t, ',');) ids.push_back(parse_int("--prompt-ids", t));
    for (int64_t t : ids)
      if (t < 0 || t >= vocab)
        throw UserError("generate: prompt id " + std::to_string(t) + " is outside the vocabulary [0, " +
                        std::to_string(vocab) + ")");
  }
  if (ids.empty()) throw UserError("generate: the prompt encodes to no tokens");
  const int64_t P = static_cast<int64_t>(ids.size());
  if (P >= in.max_seq)
    throw UserError("generate: the prompt is " + std::to_string(P) + " tokens, the sequence limit " +
                    std::to_string(in.max_seq) + " (room for no new token; --max-seq-len raises it)");
  return ids;
}

// The summary line (stderr) and, with --ids-out, the ids as JSON.
void report(const GenerateResult& r, int64_t P, const std::string& ids_out) {
  const double n = static_cast<double>(r.generated.size());
  // The first new token comes from the prompt pass; the rest each from one cached step.
  const double decode_tps = r.generated.size() > 1 && r.decode_s > 0 ? (n - 1) / r.decode_s : 0;
  const double total_tps = n / (r.prefill_s + r.decode_s);
  char line[320];
  std::snprintf(line, sizeof line,
                "generate: %zu new tokens in %.2f s: %.1f tokens/s (prompt %lld tokens in %.3f s, then %.1f tokens/s "
                "decoding with the KV cache); stopped at %s",
                r.generated.size(), r.prefill_s + r.decode_s, total_tps, static_cast<long long>(P), r.prefill_s,
                decode_tps, r.stop.c_str());
  std::cerr << line << std::endl;
  if (!ids_out.empty()) {
    std::ofstream f(ids_out);
    f << "{\"prompt_ids\": " << ids_json(r.prompt) << ", \"generated_ids\": " << ids_json(r.generated)
      << ", \"stop\": \"" << r.stop << "\", \"tokens_per_s\": " << total_tps << "}\n";
    if (!f) throw RuntimeFailure("generate: cannot write " + ids_out);
  }
}

int run(const std::vector<std::string>& args) {
  const GenerateArgs g = parse_args(args);
  if (g.help) {
    std::cout << kUsage;
    return 0;
  }
  check_args(g);
  if (g.threads > 0) torch::set_num_threads(static_cast<int>(g.threads));
  const Inputs in = resolve_inputs(g);
  const ModelTensors& m = in.m;
  std::unique_ptr<Tokenizer> tok;
  const std::vector<int64_t> ids = prompt_tokens(g, in, &tok);
  const int64_t P = static_cast<int64_t>(ids.size());

  const InferenceModel model = load_inference_model(m, std::min(in.max_seq, P + g.max_new));
  std::cerr << "generate: " << m.model_name << " " << m.flavor << " from " << in.source << " (" << m.form
            << (tok ? ", tokenizer " + in.tok_path : std::string()) << "); " << torch::get_num_threads()
            << (torch::get_num_threads() == 1 ? " thread" : " threads") << "; prompt " << P << " tokens; "
            << sampling_text(g.so, g.seed) << std::endl;
  std::unique_ptr<TextStream> text;
  if (tok) text = std::make_unique<TextStream>(*tok, std::vector<int32_t>(ids.begin(), ids.end()));
  const int64_t eos = tok && !g.ignore_eos ? tok->eos_id() : -1;
  const GenerateResult r = generate_tokens(model, ids, g.max_new, g.so, g.seed, eos, [&](int64_t id) {
    if (id == eos) return;
    if (text)
      text->add(id);
    else
      std::cout << id << " " << std::flush;
  });
  if (text)
    text->finish();
  else
    std::cout << std::endl;
  report(r, P, g.ids_out);
  return 0;
}

}  // namespace

int generate_main(const std::vector<std::string>& args) {
  return run_tool([&]() -> int {
    if (args.empty()) {
      std::cerr << kUsage;
      return 2;
    }
    return run(args);
  });
}

}  // namespace ctitan
