// ctitan's experiment configuration: torchtitan v0.2.x's TOML tables and key names.
//
// One struct per TOML table (ctitan::config::Training is [training], ...), fields named
// exactly as the keys. Every key is declared ONCE, in its struct's visit_keys():
//
//     v(seq_len, "seq_len", 2048, "Sequence length in tokens", at_least(1));
//       field    TOML key   default  one line of help          rules (optional)
//
// and everything else is derived from that list by visitors (config/job_config.cpp):
// defaults (fields have no initializers: each struct's constructor applies the declared
// ones), TOML reading, `--section.key value` overrides, --help, the TOML dump of the
// effective config, and check_supported(). Rules hold the choices, numeric range, legacy
// spellings, and the values ctitan implements today.
//
// Conventions: torchtitan's `str | None` keys are std::string with "" meaning None;
// `int | None` / `float | None` keys are std::optional (TOML has no null, so None is
// "key absent"). Precedence: command line > TOML file (--job.config_file) > defaults.
//
// The section structs live in ctitan::config (as torchtitan.config) because ctitan has
// classes of the same names elsewhere (ctitan::LRScheduler, ctitan::DataLoader).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ctitan {

// Constraints of one key. Checked whenever a value is read (TOML or command line), except
// `supported`, which only check_supported() enforces.
struct KeyRules {
  std::vector<std::string> choices;  // string key (or each element of a string list)
  bool none_allowed = false;         // "" (torchtitan's None) is allowed besides `choices`
  std::optional<double> min, max;    // numeric range, inclusive unless *_exclusive
  bool min_exclusive = false, max_exclusive = false;
  std::vector<double> also_allowed;  // values accepted outside [min, max], e.g. -1 = "auto"
  std::optional<double> excluded;    // a value inside the range that is still rejected
  const char* excluded_why = "";
  bool (*text_check)(const std::string&) = nullptr;  // custom rule for string values
  const char* text_expected = "";                    // ... and what it expects
  std::vector<std::string> legacy;                   // older spellings accepted on read ("a" or "sec.a")
  std::vector<std::string> supported;                // values ctitan implements now (strings unquoted,
                                                     // others as TOML, None as "None"); empty = all

  KeyRules& one_of(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  KeyRules& or_none() {
    none_allowed = true;
    return *this;
  }
  KeyRules& at_least(double v) {
    min = v;
    return *this;
  }
  KeyRules& greater_than(double v) {
    min = v;
    min_exclusive = true;
    return *this;
  }
  KeyRules& at_most(double v) {
    max = v;
    return *this;
  }
  KeyRules& below(double v) {
    max = v;
    max_exclusive = true;
    return *this;
  }
  KeyRules& or_value(double v) {
    also_allowed.push_back(v);
    return *this;
  }
  KeyRules& except(double v, const char* why) {
    excluded = v;
    excluded_why = why;
    return *this;
  }
  KeyRules& text(bool (*check)(const std::string&), const char* expected) {
    text_check = check;
    text_expected = expected;
    return *this;
  }
  KeyRules& alias(std::string old_name) {
    legacy.push_back(std::move(old_name));
    return *this;
  }
  KeyRules& supported_only(std::vector<std::string> v) {
    supported = std::move(v);
    return *this;
  }
};

inline KeyRules rules() { return KeyRules(); }
inline KeyRules one_of(std::vector<std::string> c) { return KeyRules().one_of(std::move(c)); }
inline KeyRules at_least(double v) { return KeyRules().at_least(v); }
inline KeyRules greater_than(double v) { return KeyRules().greater_than(v); }
inline KeyRules in_range(double lo, double hi) { return KeyRules().at_least(lo).at_most(hi); }
inline KeyRules supported_only(std::vector<std::string> v) { return KeyRules().supported_only(std::move(v)); }
inline KeyRules alias(std::string old_name) { return KeyRules().alias(std::move(old_name)); }

// activation_checkpoint.selective_ac_option: a positive integer (every n-th block) or "op".
bool is_positive_int_or_op(const std::string& s);

// Enumerated keys: a key whose values are a fixed list is an enum field, parsed once here
// (TOML or command line, refused with the one-line error of any key outside its choices) and
// passed around as the enum; the dump, --help and messages spell it as the config does.
// KeyEnum<E>::names spells E's values in the enum's order.
template <class E>
struct KeyEnum;

enum class ACMode { Selective, Full, MemoryBudget, None };  // activation_checkpoint.mode
template <>
struct KeyEnum<ACMode> {
  static constexpr const char* names[] = {"selective", "full", "memory_budget", "none"};
};
enum class NonfinitePolicy { Stop, Skip };  // training.on_nonfinite
template <>
struct KeyEnum<NonfinitePolicy> {
  static constexpr const char* names[] = {"stop", "skip"};
};
enum class BadDocumentPolicy { Stop, Skip };  // training.on_bad_document
template <>
struct KeyEnum<BadDocumentPolicy> {
  static constexpr const char* names[] = {"stop", "skip"};
};
enum class SaveFailurePolicy { Stop, Continue };  // checkpoint.on_save_failure
template <>
struct KeyEnum<SaveFailurePolicy> {
  static constexpr const char* names[] = {"stop", "continue"};
};
enum class SdpaBackend { Auto, CuDNN, Flash, Efficient, Math };  // model.sdpa_backend
template <>
struct KeyEnum<SdpaBackend> {
  static constexpr const char* names[] = {"auto", "cudnn", "flash", "efficient", "math"};
};

// The config's spelling of v ("selective").
template <class E>
const char* key_name(E v) {
  return KeyEnum<E>::names[static_cast<size_t>(v)];
}
// The value spelled s; false when s spells none.
template <class E>
bool key_value(const std::string& s, E& out) {
  const auto& names = KeyEnum<E>::names;
  for (size_t i = 0; i < std::size(names); ++i)
    if (s == names[i]) {
      out = static_cast<E>(i);
      return true;
    }
  return false;
}
// The rules of an enumerated key: one of E's spellings.
template <class E>
KeyRules one_of() {
  return one_of(std::vector<std::string>(std::begin(KeyEnum<E>::names), std::end(KeyEnum<E>::names)));
}

namespace config {

template <class T>
struct NoDeduce {
  using type = T;
};
// The default argument of a key must not take part in deducing the field's type.
template <class T>
using NoDeduceT = typename NoDeduce<T>::type;

// Sets every field to its declared default (used by each struct's constructor).
struct DefaultsVisitor {
  template <class T>
  void operator()(T& field, const char*, const NoDeduceT<T>& def, const char*, const KeyRules& = KeyRules()) {
    field = def;
  }
  template <class S>
  void table(S&, const char*, const char*) {}  // sub-structs construct themselves
};

#define CTITAN_CONFIG_DEFAULTS(Struct) \
  Struct() {                           \
    DefaultsVisitor d;                 \
    visit_keys(d);                     \
  }

struct Job {
  std::string config_file;
  std::string dump_folder;
  std::string description;
  bool print_config;
  bool validate_only;  // ctitan only
  std::string save_config_file;
  std::string custom_config_module;

  template <class V>
  void visit_keys(V& v) {
    v(config_file, "config_file", "", "TOML file to read the job config from (command line only)");
    v(dump_folder, "dump_folder", "./outputs", "Folder for all job outputs (logs, metrics, checkpoints)");
    v(description, "description", "default job", "Free-text description of the job");
    v(print_config, "print_config", false, "Print the effective config as TOML and exit 0 without training",
      alias("print_args"));
    v(validate_only, "validate_only", false,
      "ctitan: make the checks a run makes at start (config, launch environment, device, tokenizer, "
      "dataset, output folders, memory estimate), print \"config ok: ...\" and exit 0 without training or "
      "writing anything");
    v(save_config_file, "save_config_file", "",
      "Extra file name under dump_folder to save the effective config to (\"\" = None)");
    v(custom_config_module, "custom_config_module", "", "Python module extending JobConfig (torchtitan only)",
      supported_only({""}));
  }
  CTITAN_CONFIG_DEFAULTS(Job)
};

struct Profiling {
  bool enable_profiling;
  std::string save_traces_folder;
  int64_t profile_freq;
  int64_t profiler_active;
  int64_t profiler_warmup;
  bool enable_memory_snapshot;
  std::string save_memory_snapshot_folder;

  template <class V>
  void visit_keys(V& v) {
    v(enable_profiling, "enable_profiling", false,
      "Record every profile_freq-th step with LibTorch's profiler: a Chrome trace per rank in "
      "<dump_folder>/<save_traces_folder>/iteration_<step>/ (scripts/profile_summary.py sums it by op)");
    v(save_traces_folder, "save_traces_folder", "profile_traces", "Folder for profiler traces");
    v(profile_freq, "profile_freq", 10, "Collect a trace every this many steps", at_least(1));
    v(profiler_active, "profiler_active", 1, "Steps the profiler records per cycle", at_least(1).supported_only({"1"}));
    v(profiler_warmup, "profiler_warmup", 3, "Profiler warm-up steps before each active step", at_least(0));
    v(enable_memory_snapshot, "enable_memory_snapshot", false, "Dump memory snapshots", supported_only({"false"}));
    v(save_memory_snapshot_folder, "save_memory_snapshot_folder", "memory_snapshot", "Folder for memory snapshots");
  }
  CTITAN_CONFIG_DEFAULTS(Profiling)
};

struct Metrics {
  int64_t log_freq;
  bool enable_tensorboard;
  bool disable_color_printing;
  std::string save_tb_folder;
  bool save_for_all_ranks;
  bool enable_wandb;
  double mfu_peak_tflops;  // ctitan only

  template <class V>
  void visit_keys(V& v) {
    v(log_freq, "log_freq", 10, "Log metrics every this many steps", at_least(1));
    v(enable_tensorboard, "enable_tensorboard", false,
      "Write every logged step (and validation) to a TensorBoard event file in "
      "<dump_folder>/<save_tb_folder>/<%Y%m%d-%H%M>/");
    v(disable_color_printing, "disable_color_printing", false, "Plain (uncolored) console logs");
    v(save_tb_folder, "save_tb_folder", "tb", "Folder for TensorBoard event files");
    v(save_for_all_ranks, "save_for_all_ranks", false,
      "TensorBoard files from every rank (in rank_<r>/) instead of rank 0 only");
    v(enable_wandb, "enable_wandb", false,
      "Log metrics to Weights & Biases (ctitan has no W&B client: use enable_tensorboard)", supported_only({"false"}));
    v(mfu_peak_tflops, "mfu_peak_tflops", 0.0,
      "ctitan: the per-rank matmul peak in TFLOP/s that MFU divides by (e.g. a GPU's dense bf16 datasheet figure, "
      "989.5 for an H100 or H200 SXM): the same reference in every run. 0 measures it when the first metrics line "
      "is due (and again if a step runs faster); the environment's CTITAN_PEAK_TFLOPS serves where this is 0",
      at_least(0));
  }
  CTITAN_CONFIG_DEFAULTS(Metrics)
};

struct Model {
  std::string name;
  std::string flavor;
  std::string hf_assets_path;
  std::string tokenizer_path;
  std::vector<std::string> converters;
  bool print_after_conversion;
  SdpaBackend sdpa_backend;  // ctitan only

  template <class V>
  void visit_keys(V& v) {
    // Checked against the registered families where the model is built (models/registry.h).
    v(name, "name", "llama3", "Model family to train (a family registered in models/registry.cpp)");
    v(flavor, "flavor", "debugmodel", "Size preset of the model family (e.g. debugmodel, 8B)");
    v(hf_assets_path, "hf_assets_path", "./tests/assets/tokenizer",
      "Folder of HF assets; the tokenizer is its tokenizer.json, else vocab.json + merges.txt, else "
      "tokenizer.model (sentencepiece), with tokenizer_config.json for BOS/EOS");
    v(tokenizer_path, "tokenizer_path", "",
      "One tokenizer file (tokenizer.json, vocab.json or a sentencepiece .model); wins over "
      "hf_assets_path (torchtitan deprecated this key)");
    v(converters, "converters", std::vector<std::string>{},
      "Model converters to apply, e.g. float8 (comma-separated on the command line)", supported_only({"[]"}));
    v(print_after_conversion, "print_after_conversion", false, "Print the model after the converters ran");
    v(sdpa_backend, "sdpa_backend", SdpaBackend::Auto,
      "GPU only: ATen's attention kernel (cudnn, flash, efficient, math); auto: the first of cudnn, "
      "flash, efficient that takes the run's shape and dtype (each timed at start-up and logged). "
      "The CPU runs ctitan's own flash attention whatever this says",
      one_of<SdpaBackend>());
  }
  CTITAN_CONFIG_DEFAULTS(Model)
};

struct Optimizer {
  std::string name;
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  std::string implementation;
  bool early_step_in_backward;

  template <class V>
  void visit_keys(V& v) {
    v(name, "name", "AdamW", "Optimizer", one_of({"AdamW", "Adam"}));
    v(lr, "lr", 8e-4, "Peak learning rate", at_least(0));
    v(beta1, "beta1", 0.9, "Adam first-moment decay", at_least(0).below(1));
    v(beta2, "beta2", 0.95, "Adam second-moment decay", at_least(0).below(1));
    v(eps, "eps", 1e-8, "Adam epsilon", greater_than(0));
    v(weight_decay, "weight_decay", 0.1, "Decoupled weight decay (AdamW) or L2 penalty (Adam)", at_least(0));
    v(implementation, "implementation", "fused",
      "Kernel variant in PyTorch; ctitan's CPU build has one implementation and ignores it",
      one_of({"for-loop", "foreach", "fused"}));
    v(early_step_in_backward, "early_step_in_backward", false, "Step the optimizer per parameter during backward",
      supported_only({"false"}));
  }
  CTITAN_CONFIG_DEFAULTS(Optimizer)
};

struct LRScheduler {
  int64_t warmup_steps;
  std::optional<int64_t> total_steps;
  std::optional<double> decay_ratio;
  std::string decay_type;
  double min_lr_factor;

  template <class V>
  void visit_keys(V& v) {
    v(warmup_steps, "warmup_steps", 200, "Linear warm-up steps", at_least(0));
    v(total_steps, "total_steps", std::nullopt, "Steps the schedule spans (None = training.steps)",
      at_least(1).supported_only({"None"}));
    v(decay_ratio, "decay_ratio", std::nullopt,
      "Share of steps spent decaying after a stable phase (WSD); None = decay right after warm-up", in_range(0, 1));
    v(decay_type, "decay_type", "linear", "Shape of the decay", one_of({"linear", "sqrt", "cosine"}));
    v(min_lr_factor, "min_lr_factor", 0.0, "Floor of the decay, as a fraction of optimizer.lr",
      in_range(0, 1).alias("lr_min"));
  }
  CTITAN_CONFIG_DEFAULTS(LRScheduler)
};

struct DataLoader {
  int64_t num_workers;
  bool persistent_workers;
  bool pin_memory;
  std::optional<int64_t> prefetch_factor;

  template <class V>
  void visit_keys(V& v) {
    v(num_workers, "num_workers", 0, "Data-loading worker processes (ctitan loads in-process)",
      at_least(0).supported_only({"0"}));
    v(persistent_workers, "persistent_workers", false, "Keep workers alive between epochs");
    v(pin_memory, "pin_memory", false, "Pin batches in page-locked memory");
    v(prefetch_factor, "prefetch_factor", std::nullopt,
      "Batches each worker process loads ahead (ctitan has no workers; its read-ahead is "
      "training.prefetch_batches)",
      at_least(1));
  }
  CTITAN_CONFIG_DEFAULTS(DataLoader)
};

struct Training {
  std::string dataset;
  std::string dataset_path;
  int64_t local_batch_size;
  int64_t global_batch_size;
  int64_t seq_len;
  double max_norm;
  int64_t steps;
  bool enable_cpu_offload;
  std::string dtype;
  std::string mixed_precision_param;
  std::string mixed_precision_reduce;
  int64_t gc_freq;
  bool gc_debug;
  NonfinitePolicy on_nonfinite;       // ctitan only
  double loss_spike_factor;           // ctitan only
  BadDocumentPolicy on_bad_document;  // ctitan only
  int64_t prefetch_batches;           // ctitan only
  bool cuda_graphs;                   // ctitan only
  DataLoader dataloader;

  template <class V>
  void visit_keys(V& v) {
    v(dataset, "dataset", "moby_dick", "Named corpus (ctitan's default is moby_dick; torchtitan's is c4_test)");
    v(dataset_path, "dataset_path", "",
      "A .txt/.jsonl/.json/.jsonl.gz/.json.gz file or a folder of them to read instead of the named corpus "
      "(\"\" = None)");
    v(local_batch_size, "local_batch_size", 8, "Sequences per rank per micro-batch", at_least(1).alias("batch_size"));
    v(global_batch_size, "global_batch_size", -1,
      "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree",
      at_least(1).or_value(-1));
    v(seq_len, "seq_len", 2048, "Sequence length in tokens", at_least(1));
    v(max_norm, "max_norm", 1.0, "Gradient-norm clipping threshold", at_least(0));
    v(steps, "steps", 10000, "Optimizer steps to train", at_least(1));
    v(enable_cpu_offload, "enable_cpu_offload", false, "Offload FSDP parameters, gradients and optimizer state to CPU",
      supported_only({"false"}));
    v(dtype, "dtype", "float32", "Dtype of parameters, gradients and optimizer state",
      one_of({"bfloat16", "float32"}).supported_only({"float32"}));
    v(mixed_precision_param, "mixed_precision_param", "bfloat16",
      "Compute dtype of FSDP-gathered parameters (ctitan's single-process path ignores it)",
      one_of({"bfloat16", "float32"}));
    v(mixed_precision_reduce, "mixed_precision_reduce", "float32", "Dtype of gradient reductions under FSDP",
      one_of({"float32"}));
    v(gc_freq, "gc_freq", 50, "Python GC interval in torchtitan (no effect in ctitan)", at_least(1));
    v(gc_debug, "gc_debug", false, "Python GC debugging in torchtitan (no effect in ctitan)");
    v(on_nonfinite, "on_nonfinite", NonfinitePolicy::Stop,
      "ctitan: a NaN/inf loss or gradient norm stops the run naming the step, or skips the step "
      "(no optimizer update; counted and logged)",
      one_of<NonfinitePolicy>());
    v(loss_spike_factor, "loss_spike_factor", 3.0,
      "ctitan: warn when a step's loss exceeds this times the mean of the previous 20 steps; 0 = never",
      greater_than(1).or_value(0));
    v(on_bad_document, "on_bad_document", BadDocumentPolicy::Stop,
      "ctitan: a malformed document (bad JSON, no string \"text\", NUL byte, invalid UTF-8) stops the "
      "run naming file, line and reason (exit 2), or is skipped and counted (bad_documents_skipped)",
      one_of<BadDocumentPolicy>());
    v(prefetch_batches, "prefetch_batches", 2,
      "ctitan: batches a background thread reads ahead of the step that trains on them (into pinned "
      "memory on a GPU, copied there before use); 0 = each batch is read when the step asks for it. "
      "Checkpoints hold the data position of the batches trained on, whatever the depth",
      at_least(0));
    v(cuda_graphs, "cuda_graphs", false,
      "ctitan: on one GPU, capture the training step as a CUDA graph at the third step and replay it "
      "from then on (no host launch work between kernels; for small models, where the host cannot keep "
      "the GPU busy). One process, optimizer AdamW, Llama-family models");
    v.table(dataloader, "dataloader", "Data-loader settings");
  }
  CTITAN_CONFIG_DEFAULTS(Training)
};

struct Parallelism {
  int64_t data_parallel_replicate_degree;
  int64_t data_parallel_shard_degree;
  std::string fsdp_reshard_after_forward;
  bool fsdp_prefetch;
  int64_t tensor_parallel_degree;
  bool disable_loss_parallel;
  bool enable_async_tensor_parallel;
  int64_t pipeline_parallel_degree;
  std::vector<std::string> pipeline_parallel_split_points;
  std::vector<std::vector<std::string>> module_fqns_per_model_part;
  int64_t pipeline_parallel_first_stage_less_layers;
  int64_t pipeline_parallel_last_stage_less_layers;
  std::optional<int64_t> pipeline_parallel_layers_per_stage;
  std::string pipeline_parallel_schedule;
  std::string pipeline_parallel_schedule_csv;
  int64_t pipeline_parallel_microbatch_size;
  bool pipeline_parallel_expert_parallel_overlap;
  int64_t context_parallel_degree;
  std::string context_parallel_load_balancer;
  std::string context_parallel_rotate_method;
  int64_t expert_parallel_degree;
  int64_t expert_tensor_parallel_degree;
  std::string expert_parallel_comm_backend;

  template <class V>
  void visit_keys(V& v) {
    v(data_parallel_replicate_degree, "data_parallel_replicate_degree", 1,
      "Ranks holding full replicas (DDP/HSDP); 1 = off", at_least(1));
    v(data_parallel_shard_degree, "data_parallel_shard_degree", -1,
      "Ranks sharding parameters (FSDP); -1 = all ranks left over by the other degrees", at_least(1).or_value(-1));
    v(fsdp_reshard_after_forward, "fsdp_reshard_after_forward", "default",
      "Free gathered parameters after forward: default (all but the root), always, never",
      one_of({"default", "always", "never"}));
    v(fsdp_prefetch, "fsdp_prefetch", true,
      "(ctitan) Issue the next FSDP unit's all-gather while the current one computes");
    v(tensor_parallel_degree, "tensor_parallel_degree", 1,
      "Tensor parallelism degree (with sequence parallelism; tp innermost in the mesh); 1 = off", at_least(1));
    v(disable_loss_parallel, "disable_loss_parallel", false,
      "Under TP, gather the whole logits and compute the plain loss (default: the vocabulary-split loss)");
    v(enable_async_tensor_parallel, "enable_async_tensor_parallel", false, "Overlap TP communication with compute",
      supported_only({"false"}));
    v(pipeline_parallel_degree, "pipeline_parallel_degree", 1, "Pipeline parallelism degree; 1 = off",
      at_least(1).supported_only({"1"}));
    v(pipeline_parallel_split_points, "pipeline_parallel_split_points", std::vector<std::string>{},
      "Deprecated in torchtitan: module names that start each pipeline stage", supported_only({"[]"}));
    v(module_fqns_per_model_part, "module_fqns_per_model_part", std::vector<std::vector<std::string>>{},
      "Module names of each pipeline chunk ([] = None; command line: a,b;c,d)", supported_only({"[]"}));
    v(pipeline_parallel_first_stage_less_layers, "pipeline_parallel_first_stage_less_layers", 1,
      "Layers fewer on the first stage (it also holds the embedding)", at_least(0));
    v(pipeline_parallel_last_stage_less_layers, "pipeline_parallel_last_stage_less_layers", 1,
      "Layers fewer on the last stage (it also holds the output)", at_least(0));
    v(pipeline_parallel_layers_per_stage, "pipeline_parallel_layers_per_stage", std::nullopt,
      "Layers per virtual pipeline stage (None = derived)", at_least(1));
    v(pipeline_parallel_schedule, "pipeline_parallel_schedule", "1F1B", "Pipeline schedule name");
    v(pipeline_parallel_schedule_csv, "pipeline_parallel_schedule_csv", "",
      "CSV file describing a custom pipeline schedule");
    v(pipeline_parallel_microbatch_size, "pipeline_parallel_microbatch_size", 1, "Sequences per pipeline micro-batch",
      at_least(1));
    v(pipeline_parallel_expert_parallel_overlap, "pipeline_parallel_expert_parallel_overlap", true,
      "Overlap EP and PP communication (DualPipeV only)");
    v(context_parallel_degree, "context_parallel_degree", 1, "Context parallelism degree; 1 = off",
      at_least(1).supported_only({"1"}));
    v(context_parallel_load_balancer, "context_parallel_load_balancer", "headtail",
      "Context-parallel load balancer (\"\" = None)", one_of({"headtail", "ptrr"}).or_none());
    v(context_parallel_rotate_method, "context_parallel_rotate_method", "allgather",
      "Collective exchanging KV shards under context parallelism", one_of({"allgather", "alltoall"}));
    v(expert_parallel_degree, "expert_parallel_degree", 1, "Expert parallelism degree (MoE only); 1 = off",
      at_least(1).supported_only({"1"}));
    v(expert_tensor_parallel_degree, "expert_tensor_parallel_degree", 1,
      "Tensor parallelism degree inside routed experts", at_least(1).supported_only({"1"}));
    v(expert_parallel_comm_backend, "expert_parallel_comm_backend", "standard",
      "All-to-all implementation for expert parallelism", one_of({"standard", "deepep"}));
  }
  CTITAN_CONFIG_DEFAULTS(Parallelism)
};

struct Checkpoint {
  bool enable;
  bool enable_ft_dataloader_checkpoints;
  std::string folder;
  int64_t interval;
  std::string initial_load_path;
  bool initial_load_model_only;
  bool initial_load_in_hf;
  bool initial_load_in_hf_quantized;
  bool last_save_model_only;
  bool last_save_in_hf;
  std::string export_dtype;
  std::string async_mode;
  int64_t keep_latest_k;
  int64_t load_step;
  std::vector<std::string> exclude_from_loading;
  bool enable_first_step_checkpoint;
  bool create_seed_checkpoint;
  bool load_only;
  std::string dataloader_reshard;     // ctitan only
  SaveFailurePolicy on_save_failure;  // ctitan only
  std::string format;                 // ctitan only

  template <class V>
  void visit_keys(V& v) {
    v(enable, "enable", false, "Save checkpoints and resume from the latest one", alias("enable_checkpoint"));
    v(enable_ft_dataloader_checkpoints, "enable_ft_dataloader_checkpoints", true,
      "Checkpoint the data-loader position under fault tolerance");
    v(folder, "folder", "checkpoint", "Checkpoint folder, relative to job.dump_folder");
    v(interval, "interval", 500, "Save every this many steps", at_least(1));
    v(initial_load_path, "initial_load_path", "",
      "Checkpoint to start from when the run's own folder has none (\"\" = None)");
    v(initial_load_model_only, "initial_load_model_only", true, "Load only the model from initial_load_path",
      alias("initial_load_model_weights_only"));
    v(initial_load_in_hf, "initial_load_in_hf", false,
      "initial_load_path (or model.hf_assets_path) is a folder of HF *.safetensors + config.json");
    v(initial_load_in_hf_quantized, "initial_load_in_hf_quantized", false,
      "initial_load_path holds quantized HF safetensors", supported_only({"false"}));
    v(last_save_model_only, "last_save_model_only", true,
      "The final save holds the model only (no optimizer or train state)",
      alias("last_save_model_weights_only").alias("model_weights_only"));
    v(last_save_in_hf, "last_save_in_hf", false,
      "Write the final (model-only) save as HF safetensors + config.json in its step folder");
    v(export_dtype, "export_dtype", "float32", "Dtype of the final model-only save",
      one_of({"float16", "bfloat16", "float32"}));
    v(async_mode, "async_mode", "disabled", "Save in the background",
      one_of({"disabled", "async", "async_with_pinned_mem"}).supported_only({"disabled", "async"}));
    v(keep_latest_k, "keep_latest_k", 10, "Keep only the newest k checkpoints; 0 = keep all",
      at_least(0).except(1,
                         "the newest checkpoint may still be being written when older ones "
                         "are purged, so keep at least 2"));
    v(load_step, "load_step", -1, "Step to resume from; -1 = the latest", at_least(0).or_value(-1));
    v(format, "format", "ctitan",
      "On-disk form of saves: ctitan's own, or a torch.distributed.checkpoint (DCP) folder that "
      "PyTorch and torchtitan load",
      one_of({"ctitan", "dcp"}));
    v(exclude_from_loading, "exclude_from_loading", std::vector<std::string>{},
      "State entries not to load, e.g. optimizer,lr_scheduler,dataloader");
    v(enable_first_step_checkpoint, "enable_first_step_checkpoint", false, "Also save right after the first step");
    v(create_seed_checkpoint, "create_seed_checkpoint", false,
      "Initialise the full model, save it as step 0, and exit");
    v(load_only, "load_only", false, "Load checkpoints but never save");
    v(dataloader_reshard, "dataloader_reshard", "error",
      "ctitan: resuming on another dp degree: error, or redistribute the document stream",
      one_of({"error", "redistribute"}));
    v(on_save_failure, "on_save_failure", SaveFailurePolicy::Stop,
      "ctitan: a save that fails on any rank (disk full, I/O error) stops the run, or training "
      "continues to the next save (the last save and a stop request's always end the run)",
      one_of<SaveFailurePolicy>());
  }
  CTITAN_CONFIG_DEFAULTS(Checkpoint)
};

struct ActivationCheckpoint {
  ACMode mode;
  std::string selective_ac_option;
  std::vector<std::string> per_op_sac_force_recompute_mm_shapes_by_fqns;
  bool early_stop;
  double memory_budget;
  bool visualize_memory_budget_pareto;
  bool preserve_rng_state;
  std::string determinism_check;
  bool debug;

  template <class V>
  void visit_keys(V& v) {
    v(mode, "mode", ACMode::Selective, "Recompute activations in backward: none, selective, full",
      one_of<ACMode>().supported_only({"none", "full", "selective"}));
    v(selective_ac_option, "selective_ac_option", "2",
      "Selective AC: a positive integer n (every n-th block) or \"op\" (per-op policy)",
      rules().text(is_positive_int_or_op, "a positive integer or \"op\""));
    v(per_op_sac_force_recompute_mm_shapes_by_fqns, "per_op_sac_force_recompute_mm_shapes_by_fqns",
      std::vector<std::string>{"moe.router.gate"},
      "Per-op SAC: Linear modules whose matmul shapes are always recomputed");
    v(early_stop, "early_stop", false, "Stop recomputing once all needed activations exist");
    v(memory_budget, "memory_budget", 0.5, "memory_budget mode: 0 = recompute everything, 1 = keep everything",
      in_range(0, 1));
    v(visualize_memory_budget_pareto, "visualize_memory_budget_pareto", false,
      "Write the runtime/memory Pareto curve as SVG");
    v(preserve_rng_state, "preserve_rng_state", false, "Replay the RNG state in recomputation (exact dropout)");
    v(determinism_check, "determinism_check", "default", "Check recomputed tensors against the originals",
      one_of({"default", "none"}));
    v(debug, "debug", false, "Capture AC debug information");
  }
  CTITAN_CONFIG_DEFAULTS(ActivationCheckpoint)
};

struct Compile {
  bool enable;
  std::vector<std::string> components;
  std::string backend;

  template <class V>
  void visit_keys(V& v) {
    v(enable, "enable", false, "torch.compile the components below",
      supported_only({"false"}).alias("training.compile"));
    v(components, "components", std::vector<std::string>{"model", "loss"}, "What to compile",
      one_of({"model", "loss"}));
    v(backend, "backend", "inductor", "torch.compile backend");
  }
  CTITAN_CONFIG_DEFAULTS(Compile)
};

struct Float8Linear {
  bool enable_fsdp_float8_all_gather;
  bool precompute_float8_dynamic_scale_for_fsdp;
  std::string recipe_name;
  std::vector<std::string> filter_fqns;
  bool emulate;

  template <class V>
  void visit_keys(V& v) {
    v(enable_fsdp_float8_all_gather, "enable_fsdp_float8_all_gather", false,
      "All-gather parameters in float8 under FSDP", alias("float8.enable_fsdp_float8_all_gather"));
    v(precompute_float8_dynamic_scale_for_fsdp, "precompute_float8_dynamic_scale_for_fsdp", false,
      "Precompute float8 scales for FSDP", alias("float8.precompute_float8_dynamic_scale_for_fsdp"));
    v(recipe_name, "recipe_name", "", "float8 recipe (\"\" = None)",
      one_of({"tensorwise", "rowwise", "rowwise_with_gw_hp"}).or_none().alias("float8.recipe_name"));
    v(filter_fqns, "filter_fqns", std::vector<std::string>{}, "Linear modules not to convert to float8",
      alias("float8.filter_fqns"));
    v(emulate, "emulate", false, "Emulate float8 matmuls (testing only)", alias("float8.emulate"));
  }
  CTITAN_CONFIG_DEFAULTS(Float8Linear)
};

struct MXLinear {
  std::string mxfp8_dim1_cast_kernel_choice;
  std::string recipe_name;
  std::vector<std::string> filter_fqns;

  template <class V>
  void visit_keys(V& v) {
    v(mxfp8_dim1_cast_kernel_choice, "mxfp8_dim1_cast_kernel_choice", "triton", "Kernel for the MX dim-1 cast",
      one_of({"triton", "cuda", "torch"}).alias("mx.mxfp8_dim1_cast_kernel_choice"));
    v(recipe_name, "recipe_name", "mxfp8_cublas", "MX recipe", alias("mx.recipe_name"));
    v(filter_fqns, "filter_fqns", std::vector<std::string>{"output"}, "Linear modules not to convert to MX",
      alias("mx.filter_fqns"));
  }
  CTITAN_CONFIG_DEFAULTS(MXLinear)
};

struct QuantizedLinear {
  Float8Linear float8;
  MXLinear mx;

  template <class V>
  void visit_keys(V& v) {
    v.table(float8, "float8", "float8 training of Linear layers");
    v.table(mx, "mx", "MX-format training of Linear layers");
  }
};

struct Float8GroupedMM {
  std::vector<std::string> fqns;

  template <class V>
  void visit_keys(V& v) {
    v(fqns, "fqns", std::vector<std::string>{}, "MoE modules whose grouped GEMMs use float8",
      alias("float8.moe_fqns_prototype"));
  }
  CTITAN_CONFIG_DEFAULTS(Float8GroupedMM)
};

struct MXGroupedMM {
  std::string recipe_name;
  std::vector<std::string> fqns;

  template <class V>
  void visit_keys(V& v) {
    v(recipe_name, "recipe_name", "mxfp8", "MX recipe for grouped GEMMs", one_of({"mxfp8"}));
    v(fqns, "fqns", std::vector<std::string>{}, "MoE modules whose grouped GEMMs use MX",
      alias("mx.moe_fqns_prototype"));
  }
  CTITAN_CONFIG_DEFAULTS(MXGroupedMM)
};

struct QuantizedGroupedMM {
  Float8GroupedMM float8;
  MXGroupedMM mx;

  template <class V>
  void visit_keys(V& v) {
    v.table(float8, "float8", "float8 grouped GEMMs (MoE)");
    v.table(mx, "mx", "MX-format grouped GEMMs (MoE)");
  }
};

// Settings of the quantize.* converters; they only act when model.converters names them.
struct Quantize {
  QuantizedLinear linear;
  QuantizedGroupedMM grouped_mm;

  template <class V>
  void visit_keys(V& v) {
    v.table(linear, "linear", "Quantized training of Linear layers");
    v.table(grouped_mm, "grouped_mm", "Quantized grouped GEMMs (MoE)");
  }
};

struct Comm {
  int64_t init_timeout_seconds;
  int64_t train_timeout_seconds;
  int64_t trace_buf_size;
  std::string save_traces_folder;
  std::string save_traces_file_prefix;
  std::string mode;

  template <class V>
  void visit_keys(V& v) {
    v(init_timeout_seconds, "init_timeout_seconds", 300, "Collective timeout during start-up and the first step",
      at_least(1));
    v(train_timeout_seconds, "train_timeout_seconds", 100, "Collective timeout after the first step", at_least(1));
    v(trace_buf_size, "trace_buf_size", 20000, "Entries in the collective flight recorder; 0 = off", at_least(0));
    v(save_traces_folder, "save_traces_folder", "comm_traces", "Folder for flight-recorder dumps");
    v(save_traces_file_prefix, "save_traces_file_prefix", "rank_", "File-name prefix of flight-recorder dumps");
    v(mode, "mode", "default", "Communication mode (fake backends are for dry runs)",
      one_of({"default", "fake_backend", "local_tensor"}).supported_only({"default"}));
  }
  CTITAN_CONFIG_DEFAULTS(Comm)
};

struct MemoryEstimation {
  bool enable;
  bool disable_fake_mode;

  template <class V>
  void visit_keys(V& v) {
    v(enable, "enable", false, "Estimate FSDP memory use before training", supported_only({"false"}).alias("enabled"));
    v(disable_fake_mode, "disable_fake_mode", false, "Estimate with real tensors");
  }
  CTITAN_CONFIG_DEFAULTS(MemoryEstimation)
};

struct FaultTolerance {
  bool enable;
  std::string process_group;
  int64_t process_group_timeout_ms;
  int64_t replica_id;
  int64_t group_size;
  int64_t min_replica_size;
  std::string semi_sync_method;
  int64_t sync_steps;
  bool should_quantize;
  int64_t fragment_sync_delay;
  double fragment_update_alpha;

  template <class V>
  void visit_keys(V& v) {
    v(enable, "enable", false, "TorchFT fault-tolerant training", supported_only({"false"}));
    v(process_group, "process_group", "gloo", "Process group used by TorchFT", one_of({"gloo", "nccl"}));
    v(process_group_timeout_ms, "process_group_timeout_ms", 10000, "TorchFT collective timeout in ms", at_least(1));
    v(replica_id, "replica_id", 0, "TorchFT replica id of this run", at_least(0));
    v(group_size, "group_size", 0, "Number of TorchFT replica groups", at_least(0));
    v(min_replica_size, "min_replica_size", 1, "Minimum replicas per step", at_least(1));
    v(semi_sync_method, "semi_sync_method", "", "Semi-synchronous method (\"\" = None)",
      one_of({"local_sgd", "diloco"}).or_none());
    v(sync_steps, "sync_steps", 5, "Steps between semi-sync synchronisations", at_least(1));
    v(should_quantize, "should_quantize", false, "Quantize pseudo-gradients before all-reduce");
    v(fragment_sync_delay, "fragment_sync_delay", 0, "Steps to delay fragment syncs", at_least(0));
    v(fragment_update_alpha, "fragment_update_alpha", 0.0, "Mix of local and global parameters after a sync",
      in_range(0, 1));
  }
  CTITAN_CONFIG_DEFAULTS(FaultTolerance)
};

struct Experimental {
  std::string custom_import;
  std::string custom_args_module;

  template <class V>
  void visit_keys(V& v) {
    v(custom_import, "custom_import", "", "Python module to import (torchtitan only)", supported_only({""}));
    v(custom_args_module, "custom_args_module", "", "Deprecated Python JobConfig extension (torchtitan only)",
      supported_only({""}));
  }
  CTITAN_CONFIG_DEFAULTS(Experimental)
};

struct Validation {
  bool enable;
  std::string dataset;
  std::string dataset_path;
  int64_t local_batch_size;
  int64_t seq_len;
  int64_t freq;
  int64_t steps;
  DataLoader dataloader;

  template <class V>
  void visit_keys(V& v) {
    v(enable, "enable", false, "Forward-only validation loss on held-out data (after step 1 and every freq steps)",
      alias("enabled"));
    v(dataset, "dataset", "c4_validation",
      "Named validation corpus (as training.dataset; torchtitan's default c4_validation is read from "
      "<data root>/c4/en/c4-validation.*)");
    v(dataset_path, "dataset_path", "",
      "Validation .txt/.jsonl/.json/.jsonl.gz/.json.gz file or folder; wins over dataset (\"\" = None)");
    v(local_batch_size, "local_batch_size", 8, "Validation sequences per rank per batch", at_least(1));
    v(seq_len, "seq_len", 2048, "Validation sequence length (at most training.seq_len)", at_least(1));
    v(freq, "freq", 10, "Validate after step 1 and every this many steps", at_least(1));
    v(steps, "steps", -1, "Validation batches per rank per run; -1 = until the first rank has no whole batch left",
      at_least(1).or_value(-1));
    v.table(dataloader, "dataloader", "Validation data-loader settings");
  }
  CTITAN_CONFIG_DEFAULTS(Validation)
};

struct Debug {
  std::optional<int64_t> seed;
  bool deterministic;
  bool deterministic_warn_only;
  bool moe_force_load_balance;

  template <class V>
  void visit_keys(V& v) {
    v(seed, "seed", std::nullopt, "Base RNG seed (None = random)", alias("training.seed"));
    v(deterministic, "deterministic", false, "Use deterministic algorithms (may be slower)",
      alias("training.deterministic"));
    v(deterministic_warn_only, "deterministic_warn_only", false,
      "Only warn about ops without a deterministic implementation");
    v(moe_force_load_balance, "moe_force_load_balance", false, "Route tokens round-robin to experts (debugging)",
      supported_only({"false"}));
  }
  CTITAN_CONFIG_DEFAULTS(Debug)
};

#undef CTITAN_CONFIG_DEFAULTS

}  // namespace config

// The whole experiment: one member per TOML table, in torchtitan's order.
struct JobConfig {
  config::Job job;
  config::Profiling profiling;
  config::Metrics metrics;
  config::Model model;
  config::Optimizer optimizer;
  config::LRScheduler lr_scheduler;
  config::Training training;
  config::Parallelism parallelism;
  config::Checkpoint checkpoint;
  config::ActivationCheckpoint activation_checkpoint;
  config::Compile compile;
  config::Quantize quantize;
  config::Comm comm;
  config::MemoryEstimation memory_estimation;
  config::FaultTolerance fault_tolerance;
  config::Experimental experimental;
  config::Validation validation;
  config::Debug debug;

  template <class V>
  void visit_keys(V& v) {
    v.table(job, "job", "Job identity and outputs");
    v.table(profiling, "profiling", "Profiler traces and memory snapshots");
    v.table(metrics, "metrics", "Metric logging");
    v.table(model, "model", "Model family, size and tokenizer");
    v.table(optimizer, "optimizer", "Optimizer hyper-parameters");
    v.table(lr_scheduler, "lr_scheduler", "Warm-up, stable and decay learning-rate schedule");
    v.table(training, "training", "Data, batch, sequence length and steps");
    v.table(parallelism, "parallelism", "Parallelism degrees (their product = WORLD_SIZE)");
    v.table(checkpoint, "checkpoint", "Saving and resuming");
    v.table(activation_checkpoint, "activation_checkpoint", "Activation recomputation");
    v.table(compile, "compile", "torch.compile");
    v.table(quantize, "quantize", "Low-precision training converters");
    v.table(comm, "comm", "Collective timeouts and flight recorder");
    v.table(memory_estimation, "memory_estimation", "Memory estimation");
    v.table(fault_tolerance, "fault_tolerance", "TorchFT fault tolerance");
    v.table(experimental, "experimental", "Python extension hooks (torchtitan only)");
    v.table(validation, "validation", "Validation loop");
    v.table(debug, "debug", "Seeds and determinism");
  }
};

// Equal iff every key has the same value (compares the TOML renderings, which are exact).
bool operator==(const JobConfig& a, const JobConfig& b);
inline bool operator!=(const JobConfig& a, const JobConfig& b) { return !(a == b); }

struct ConfigLoadResult {
  JobConfig config;
  bool help_requested = false;  // --help / -h given: print job_config_help() and exit 0
};

// args = argv[1..]: `--section.key value`, `--section.key=value`, a bare bool flag means
// true, `--section.no_key` means false, lists are comma-separated; `--job.config_file PATH`
// names the TOML file. Bad input throws UserError with one line naming where, the key,
// the value and what is expected. Does not call check_supported().
ConfigLoadResult load_job_config(const std::vector<std::string>& args);

// Defaults + one TOML document; `filename` is only used in error messages.
JobConfig parse_job_config_toml(std::istream& in, const std::string& filename);

// Every key: --section.key, type, default, one line of help, choices/range, legacy names.
std::string job_config_help();

// The effective config as TOML (None values as comments); parsing it gives an equal config,
// except job.print_config, which is not written (so the file runs instead of printing itself).
std::string job_config_to_toml(const JobConfig& cfg);

// Throws UserError "not supported yet: section.key = value (ctitan supports: ...)" for the
// first key (in declaration order) set to a value of a feature ctitan does not have yet.
void check_supported(const JobConfig& cfg);

// All canonical key paths ("training.seq_len", "quantize.linear.float8.filter_fqns", ...).
std::vector<std::string> job_config_keys();

}  // namespace ctitan
