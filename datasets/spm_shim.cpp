// libctitan_spm_shim.so: the only code that touches libsentencepiece (see spm_shim.h
// for why). Built as a CMake MODULE, never linked, only dlopen()ed by tokenizer.cpp.
#include "spm_shim.h"  // same folder: this MODULE target has no include path

#include <sentencepiece_processor.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <new>
#include <string>
#include <vector>

struct ctitan_spm {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

void set_error(char* err, size_t err_cap, const std::string& message) {
  if (err == nullptr || err_cap == 0) return;
  const size_t n = message.size() < err_cap - 1 ? message.size() : err_cap - 1;
  std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int ctitan_spm_abi_version(void) { return CTITAN_SPM_SHIM_ABI; }

__attribute__((visibility("default"))) ctitan_spm* ctitan_spm_load(const char* model_path, char* err, size_t err_cap) {
  try {
    if (model_path == nullptr) {
      set_error(err, err_cap, "no path given");
      return nullptr;
    }
    // sentencepiece's own message for a missing file is "...: No such file or directory
    // Error #2"; say it plainly before handing the file over.
    std::ifstream probe(model_path, std::ios::binary);
    if (!probe) {
      set_error(err, err_cap, std::string("cannot open file (") + std::strerror(errno) + ")");
      return nullptr;
    }
    probe.close();
    auto* handle = new ctitan_spm();
    const auto status = handle->processor.Load(model_path);
    if (!status.ok()) {
      set_error(err, err_cap, std::string("not a sentencepiece model (") + status.ToString() + ")");
      delete handle;
      return nullptr;
    }
    if (handle->processor.GetPieceSize() <= 0) {
      set_error(err, err_cap, "model has an empty vocabulary");
      delete handle;
      return nullptr;
    }
    return handle;
  } catch (const std::exception& e) {
    set_error(err, err_cap, e.what());
  } catch (...) {
    set_error(err, err_cap, "unknown exception");
  }
  return nullptr;
}

__attribute__((visibility("default"))) void ctitan_spm_free(ctitan_spm* handle) { delete handle; }

__attribute__((visibility("default"))) int32_t* ctitan_spm_encode(const ctitan_spm* handle, const char* text,
                                                                  size_t len, size_t* out_count, char* err,
                                                                  size_t err_cap) {
  try {
    std::vector<int> ids;
    const auto status = handle->processor.Encode(absl::string_view(text, len), &ids);
    if (!status.ok()) {
      set_error(err, err_cap, status.ToString());
      return nullptr;
    }
    // +1 so that an empty result is still a non-NULL allocation.
    auto* out = static_cast<int32_t*>(std::malloc((ids.size() + 1) * sizeof(int32_t)));
    if (out == nullptr) throw std::bad_alloc();
    for (size_t i = 0; i < ids.size(); ++i) out[i] = static_cast<int32_t>(ids[i]);
    *out_count = ids.size();
    return out;
  } catch (const std::exception& e) {
    set_error(err, err_cap, e.what());
  } catch (...) {
    set_error(err, err_cap, "unknown exception");
  }
  return nullptr;
}

__attribute__((visibility("default"))) char* ctitan_spm_decode(const ctitan_spm* handle, const int32_t* ids,
                                                               size_t count, size_t* out_len, char* err,
                                                               size_t err_cap) {
  try {
    const int vocab = handle->processor.GetPieceSize();
    std::vector<int> v(count);
    for (size_t i = 0; i < count; ++i) {
      if (ids[i] < 0 || ids[i] >= vocab) {
        set_error(err, err_cap,
                  "id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                      " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
        return nullptr;
      }
      v[i] = ids[i];
    }
    std::string text;
    const auto status = handle->processor.Decode(v, &text);
    if (!status.ok()) {
      set_error(err, err_cap, status.ToString());
      return nullptr;
    }
    auto* out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out == nullptr) throw std::bad_alloc();
    std::memcpy(out, text.data(), text.size());
    out[text.size()] = '\0';
    *out_len = text.size();
    return out;
  } catch (const std::exception& e) {
    set_error(err, err_cap, e.what());
  } catch (...) {
    set_error(err, err_cap, "unknown exception");
  }
  return nullptr;
}

__attribute__((visibility("default"))) void ctitan_spm_free_buffer(void* buffer) { std::free(buffer); }

__attribute__((visibility("default"))) int32_t ctitan_spm_vocab_size(const ctitan_spm* handle) {
  return handle->processor.GetPieceSize();
}
__attribute__((visibility("default"))) int32_t ctitan_spm_bos_id(const ctitan_spm* handle) {
  return handle->processor.bos_id();
}
__attribute__((visibility("default"))) int32_t ctitan_spm_eos_id(const ctitan_spm* handle) {
  return handle->processor.eos_id();
}
__attribute__((visibility("default"))) int32_t ctitan_spm_pad_id(const ctitan_spm* handle) {
  return handle->processor.pad_id();
}
__attribute__((visibility("default"))) int32_t ctitan_spm_unk_id(const ctitan_spm* handle) {
  return handle->processor.unk_id();
}

}  // extern "C"
