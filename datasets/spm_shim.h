// C API of libctitan_spm_shim.so: sentencepiece behind a wall.
//
// Why a shim: Debian's libsentencepiece.so.0 carries its own copy of protobuf. Linked
// into a process that also links libtorch (libprotobuf.so.32) the two register the
// same descriptors and the process aborts during static initialisation, before main.
// The shim is the only thing that links libsentencepiece; ctitan::Tokenizer dlopen()s
// it with RTLD_LOCAL | RTLD_DEEPBIND so its protobuf symbols never meet libtorch's.
//
// Plain C types only cross this boundary, and no C++ exception does: every function
// that can fail returns NULL / a negative value and writes a NUL-terminated reason
// into the caller's `err` buffer (truncated to err_cap bytes).
// Buffers returned by encode/decode are malloc'ed by the shim and must be released
// with ctitan_spm_free_buffer.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a signature below changes; the loader refuses a different value.
#define CTITAN_SPM_SHIM_ABI 1

typedef struct ctitan_spm ctitan_spm;  // opaque: one loaded .model

int ctitan_spm_abi_version(void);

// Loads a sentencepiece model file. NULL on failure (reason in err).
ctitan_spm* ctitan_spm_load(const char* model_path, char* err, size_t err_cap);
void ctitan_spm_free(ctitan_spm* handle);

// text[0..len) -> ids; *out_count receives the number of ids. Returns a malloc'ed array
// (non-NULL even when the count is 0) or NULL on failure (reason in err).
int32_t* ctitan_spm_encode(const ctitan_spm* handle, const char* text, size_t len, size_t* out_count, char* err,
                           size_t err_cap);

// ids[0..count) -> UTF-8 text of *out_len bytes (plus a NUL). NULL on failure, e.g. an
// id outside [0, vocab_size).
char* ctitan_spm_decode(const ctitan_spm* handle, const int32_t* ids, size_t count, size_t* out_len, char* err,
                        size_t err_cap);

void ctitan_spm_free_buffer(void* buffer);

int32_t ctitan_spm_vocab_size(const ctitan_spm* handle);
int32_t ctitan_spm_bos_id(const ctitan_spm* handle);  // -1 when the model has none
int32_t ctitan_spm_eos_id(const ctitan_spm* handle);
int32_t ctitan_spm_pad_id(const ctitan_spm* handle);
int32_t ctitan_spm_unk_id(const ctitan_spm* handle);

#ifdef __cplusplus
}  // extern "C"
#endif
