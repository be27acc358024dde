// Tokenizer: the sentencepiece back-end over the shim (see spm_shim.h), the choice of
// back-end by file, and the tokenizer file as torchtitan finds it; see tokenizer.h.
#include "datasets/tokenizer.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "datasets/hf_tokenizer.h"
#include "datasets/spm_shim.h"
#include "util/env.h"

namespace ctitan {
namespace {

constexpr const char* kShimFileName = "libctitan_spm_shim.so";

// Function table of the shim, resolved once per process.
struct ShimApi {
  std::string path;
  decltype(&ctitan_spm_abi_version) abi_version = nullptr;
  decltype(&ctitan_spm_load) load = nullptr;
  decltype(&ctitan_spm_free) free_handle = nullptr;
  decltype(&ctitan_spm_encode) encode = nullptr;
  decltype(&ctitan_spm_decode) decode = nullptr;
  decltype(&ctitan_spm_free_buffer) free_buffer = nullptr;
  decltype(&ctitan_spm_vocab_size) vocab_size = nullptr;
  decltype(&ctitan_spm_bos_id) bos_id = nullptr;
  decltype(&ctitan_spm_eos_id) eos_id = nullptr;
  decltype(&ctitan_spm_pad_id) pad_id = nullptr;
  decltype(&ctitan_spm_unk_id) unk_id = nullptr;
};

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string executable_dir() {
  std::string buf(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return {};
  buf.resize(static_cast<size_t>(n));
  const auto slash = buf.rfind('/');
  return slash == std::string::npos ? std::string() : buf.substr(0, slash);
}

template <typename Fn>
void resolve(void* lib, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(::dlsym(lib, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

// Tries one candidate; on failure appends "<path>: <reason>" to `tried`.
bool try_open(const std::string& path, ShimApi* api, std::string* tried) {
  auto note = [&](const std::string& why) { *tried += (tried->empty() ? "" : "; ") + path + ": " + why; };
  if (!is_file(path)) {
    note("no such file");
    return false;
  }
  // DEEPBIND: the shim and libsentencepiece resolve their own symbols (protobuf's among
  // them) before the process's global ones, i.e. before libtorch's libprotobuf.
#ifdef CTITAN_SANITIZE
  // The sanitizer runtimes refuse RTLD_DEEPBIND; a separate link-map namespace isolates the
  // shim even more (its own libstdc++ and malloc: only C types and its own buffers cross).
  void* lib = ::dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
#else
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
#endif
  if (lib == nullptr) {
    const char* e = ::dlerror();
    note(e ? e : "dlopen failed");
    return false;
  }
  ShimApi a;
  a.path = path;
  std::string missing;
  resolve(lib, "ctitan_spm_abi_version", &a.abi_version, &missing);
  resolve(lib, "ctitan_spm_load", &a.load, &missing);
  resolve(lib, "ctitan_spm_free", &a.free_handle, &missing);
  resolve(lib, "ctitan_spm_encode", &a.encode, &missing);
  resolve(lib, "ctitan_spm_decode", &a.decode, &missing);
  resolve(lib, "ctitan_spm_free_buffer", &a.free_buffer, &missing);
  resolve(lib, "ctitan_spm_vocab_size", &a.vocab_size, &missing);
  resolve(lib, "ctitan_spm_bos_id", &a.bos_id, &missing);
  resolve(lib, "ctitan_spm_eos_id", &a.eos_id, &missing);
  resolve(lib, "ctitan_spm_pad_id", &a.pad_id, &missing);
  resolve(lib, "ctitan_spm_unk_id", &a.unk_id, &missing);
  if (!missing.empty()) {
    note("missing symbols " + missing);
    ::dlclose(lib);
    return false;
  }
  if (a.abi_version() != CTITAN_SPM_SHIM_ABI) {
    note("ABI version " + std::to_string(a.abi_version()) + ", expected " + std::to_string(CTITAN_SPM_SHIM_ABI) +
         " (stale build?)");
    ::dlclose(lib);
    return false;
  }
  // Never dlclose'd: sentencepiece's statics must outlive every Tokenizer.
  *api = a;
  return true;
}

ShimApi open_shim() {
  std::vector<std::pair<std::string, std::string>> candidates;  // (origin, path)
  if (const std::string& env = runtime_env().spm_shim; !env.empty()) {
    candidates.emplace_back("$CTITAN_SPM_SHIM", env);
  }
  if (const auto dir = executable_dir(); !dir.empty()) {
    candidates.emplace_back("executable folder", dir + "/" + kShimFileName);
  }
#ifdef CTITAN_SPM_SHIM_BUILD_PATH
  candidates.emplace_back("build tree", CTITAN_SPM_SHIM_BUILD_PATH);
#endif
  std::string tried;
  for (size_t i = 0; i < candidates.size(); ++i) {
    ShimApi api;
    if (try_open(candidates[i].second, &api, &tried)) {
      if (i > 0 && candidates[0].first == "$CTITAN_SPM_SHIM") {
        spdlog::warn("tokenizer: $CTITAN_SPM_SHIM unusable ({}); using {}", tried, api.path);
      }
      return api;
    }
  }
  throw RuntimeFailure("tokenizer: cannot load the sentencepiece shim " + std::string(kShimFileName) + " (tried " +
                       (tried.empty() ? std::string("nothing") : tried) +
                       "); build target ctitan_spm_shim or set CTITAN_SPM_SHIM");
}

const ShimApi& shim() {
  // A throwing initialiser leaves the static uninitialised: the next call tries again.
  static const ShimApi api = open_shim();
  return api;
}

// A sentencepiece model through the shim.
class SentencePieceTokenizer final : public Tokenizer {
 public:
  static std::unique_ptr<Tokenizer> load(const std::string& model_path) {
    const ShimApi& api = shim();
    char err[1024] = {0};
    ctitan_spm* handle = api.load(model_path.c_str(), err, sizeof(err));
    if (handle == nullptr) {
      throw UserError("tokenizer: cannot load " + model_path + ": " + err);
    }
    std::unique_ptr<SentencePieceTokenizer> tok(new SentencePieceTokenizer());
    tok->handle_ = handle;
    tok->model_path_ = model_path;
    tok->vocab_size_ = api.vocab_size(handle);
    tok->bos_id_ = api.bos_id(handle);
    tok->eos_id_ = api.eos_id(handle);
    tok->pad_id_ = api.pad_id(handle);
    tok->unk_id_ = api.unk_id(handle);
    return tok;
  }

  ~SentencePieceTokenizer() override {
    if (handle_ != nullptr) shim().free_handle(static_cast<ctitan_spm*>(handle_));
  }

  std::string kind() const override { return "sentencepiece"; }

  std::vector<int32_t> encode(const std::string& text, bool bos, bool eos) const override {
    const ShimApi& api = shim();
    char err[1024] = {0};
    size_t count = 0;
    int32_t* ids =
        api.encode(static_cast<const ctitan_spm*>(handle_), text.data(), text.size(), &count, err, sizeof(err));
    if (ids == nullptr) {
      throw RuntimeFailure("tokenizer: encoding " + std::to_string(text.size()) + " bytes failed: " + err);
    }
    std::vector<int32_t> out;
    out.reserve(count + 2);
    if (bos && bos_id_ >= 0) out.push_back(bos_id_);
    out.insert(out.end(), ids, ids + count);
    if (eos && eos_id_ >= 0) out.push_back(eos_id_);
    api.free_buffer(ids);
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    const ShimApi& api = shim();
    char err[1024] = {0};
    size_t len = 0;
    char* text = api.decode(static_cast<const ctitan_spm*>(handle_), ids.data(), ids.size(), &len, err, sizeof(err));
    if (text == nullptr) throw std::out_of_range(std::string("[tokenizer] decode: ") + err);
    std::string out(text, len);
    api.free_buffer(text);
    return out;
  }

 private:
  SentencePieceTokenizer() = default;
  void* handle_ = nullptr;  // ctitan_spm*
};

std::string base_name(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string dir_name(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

}  // namespace

std::string Tokenizer::shim_path() { return shim().path; }

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  const std::string name = base_name(path);
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".json") == 0) {
    if (name == "vocab.json") return HfTokenizer::from_vocab_merges(path, dir_name(path) + "/merges.txt");
    return HfTokenizer::from_tokenizer_json(path);
  }
  return SentencePieceTokenizer::load(path);
}

std::string resolve_tokenizer_path(const std::string& tokenizer_path, const std::string& hf_assets_path) {
  if (!tokenizer_path.empty()) {
    if (is_file(tokenizer_path)) return tokenizer_path;
    throw UserError("model.tokenizer_path=" + tokenizer_path +
                    " is not a file (expected tokenizer.json, vocab.json or a sentencepiece "
                    ".model; scripts/train_tokenizer.sh makes a .model)");
  }
  if (!hf_assets_path.empty()) {
    // torchtitan v0.2.2's order: tokenizer.json, then vocab.json + merges.txt; ctitan keeps
    // sentencepiece's tokenizer.model as the last choice.
    for (const char* file : {"tokenizer.json", "vocab.json", "tokenizer.model"}) {
      const std::string candidate = hf_assets_path + "/" + file;
      if (!is_file(candidate)) continue;
      if (std::string(file) == "vocab.json" && !is_file(hf_assets_path + "/merges.txt")) {
        throw UserError("model.hf_assets_path=" + hf_assets_path +
                        " holds vocab.json but no merges.txt (ctitan reads byte-level BPE "
                        "only; a WordLevel vocab.json alone is not supported)");
      }
      return candidate;
    }
    throw UserError("model.hf_assets_path=" + hf_assets_path +
                    " holds none of tokenizer.json, vocab.json + merges.txt, tokenizer.model "
                    "and model.tokenizer_path is not set");
  }
  throw UserError(
      "no tokenizer: set model.hf_assets_path (a folder holding tokenizer.json, vocab.json + "
      "merges.txt or tokenizer.model) or model.tokenizer_path (one such file); "
      "scripts/train_tokenizer.sh makes a sentencepiece one");
}

}  // namespace ctitan
