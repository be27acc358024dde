// Tokenizer: a sentencepiece model (.model file) used through libctitan_spm_shim.so.
//
// sentencepiece is never linked into ctitan: the shim is dlopen()ed with
// RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND (see spm_shim.h for the protobuf clash this
// avoids). The shim is searched, first hit wins:
//   1. $CTITAN_SPM_SHIM (a path to the .so),
//   2. libctitan_spm_shim.so in the folder of the running executable (/proc/self/exe),
//   3. the build-tree path baked in at compile time (CTITAN_SPM_SHIM_BUILD_PATH).
// It is loaded once per process and never unloaded.
//
// BOS/EOS ids come from the model file (spm_train's defaults: unk=0, bos=1, eos=2).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ctitan {

class Tokenizer {
 public:
  // Throws UserError "tokenizer: cannot load <path>: <reason>" for a missing, unreadable
  // or corrupt model file, and RuntimeFailure when the shim itself cannot be found.
  static std::unique_ptr<Tokenizer> load(const std::string& model_path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // text (UTF-8) -> ids, optionally framed by BOS / EOS. Thread-safe.
  std::vector<int32_t> encode(const std::string& text, bool bos, bool eos) const;
  // ids -> text. Control ids (BOS/EOS/PAD) decode to nothing; an id outside
  // [0, vocab_size) throws std::out_of_range.
  std::string decode(const std::vector<int32_t>& ids) const;

  int64_t vocab_size() const { return vocab_size_; }
  int32_t bos_id() const { return bos_id_; }  // -1 when the model defines none
  int32_t eos_id() const { return eos_id_; }
  int32_t pad_id() const { return pad_id_; }
  int32_t unk_id() const { return unk_id_; }
  const std::string& model_path() const { return model_path_; }

  // The shim file this process loaded (for logs); loads it if not yet loaded.
  static std::string shim_path();

 private:
  Tokenizer() = default;
  void* handle_ = nullptr;  // ctitan_spm*
  std::string model_path_;
  int64_t vocab_size_ = 0;
  int32_t bos_id_ = -1, eos_id_ = -1, pad_id_ = -1, unk_id_ = -1;
};

// model.tokenizer_path when set (must exist), else <model.hf_assets_path>/tokenizer.model.
// UserError naming both keys when neither gives an existing file.
std::string resolve_tokenizer_path(const std::string& tokenizer_path,
                                   const std::string& hf_assets_path);

}  // namespace ctitan
