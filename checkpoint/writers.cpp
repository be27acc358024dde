// The checkpoint formats' registry, and what every writer uses (see writer.h).
#include "checkpoint/writer.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <spdlog/spdlog.h>
#include <c10/util/Exception.h>

#include "checkpoint/format.h"
#include "config/errors.h"
#include "util/env.h"

namespace ctitan {

// The formats ctitan writes, one line each: X(<name>) registers <name>_writer() of
// checkpoint/writer_<name>.cpp under <name> (checkpoint.format's value; "hf" is the final
// model-only save's). A list rather than static self-registration: the linker drops
// unreferenced objects of a static library.
#define CTITAN_CHECKPOINT_WRITERS(X) \
  X(ctitan)                          \
  X(dcp)                             \
  X(hf)

#define CTITAN_DECLARE_WRITER(name) const CheckpointWriter& name##_writer();
CTITAN_CHECKPOINT_WRITERS(CTITAN_DECLARE_WRITER)
#undef CTITAN_DECLARE_WRITER

const CheckpointWriter& checkpoint_writer(const std::string& format) {
#define CTITAN_FIND_WRITER(name) \
  if (format == #name) return name##_writer();
  CTITAN_CHECKPOINT_WRITERS(CTITAN_FIND_WRITER)
#undef CTITAN_FIND_WRITER
  TORCH_CHECK(false, "[checkpoint] no writer for the format \"", format, "\"");
}

namespace ckpt {

void maybe_fault_in_save(int64_t rank, int64_t step, const std::string& file) {
  const auto& hook = runtime_env().checkpoint_fault;
  if (!hook || !hook->at(rank, step)) return;
  const std::string& k = hook->kind;
  const std::string& f = hook->spec;
  if (k == "kill") raise(SIGKILL);
  if (k == "raise")
    throw RuntimeFailure("injected fault while writing the checkpoint (CTITAN_CHECKPOINT_FAULT=" + f + ")");
  if (k == "enospc")  // the text of ckpt::DurableFileWriter's error for a failed write
    throw RuntimeFailure("checkpoint: cannot write " + file + ".tmp: " + std::strerror(ENOSPC));
  if (k == "fill") {
    const std::string filler = file + ".filler";  // in the staging folder: removed with it
    if (ckpt::disk_space(filler).free > (256u << 20))
      throw RuntimeFailure("CTITAN_CHECKPOINT_FAULT=fill refuses to fill a file system with more than 256 MiB free");
    const int fd = ::open(filler.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char> block(1 << 16, 0);
    while (fd >= 0 && ::write(fd, block.data(), block.size()) > 0) {
    }
    if (fd >= 0) ::close(fd);
    spdlog::warn("CTITAN_CHECKPOINT_FAULT={}: filled the file system of {}", f, filler);
  }
}

}  // namespace ckpt
}  // namespace ctitan
