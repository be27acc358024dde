// TensorBoard event files; the format is described in tensorboard.h.
#include "components/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "config/errors.h"
#include "util/crc.h"

namespace ctitan {
namespace tensorboard {
namespace {

// ---- protobuf wire format -------------------------------------------------------------
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (uint64_t{field} << 3) | type); }

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

// int64 as protobuf encodes it: the two's-complement bits as an unsigned varint.
void put_int64(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(v));
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// event.proto / summary.proto field numbers.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2;

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc::crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out.data(), 8), 4);
  out += data;
  put_le(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

std::string encode_file_version_event(double wall_time, const std::string& version) {
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_bytes(e, kEventFileVersion, version);
  return e;
}

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, double>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, kValueTag, tag);
    put_float(v, kValueSimpleValue, static_cast<float>(value));
    put_bytes(summary, kSummaryValue, v);
  }
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_int64(e, kEventStep, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}

}  // namespace tensorboard

TensorBoardWriter::TensorBoardWriter(const std::string& folder) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) throw RuntimeFailure("tensorboard: cannot create " + folder + ": " + ec.message());
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = tensorboard::unix_seconds();
  path_ = (std::filesystem::path(folder) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." +
                                            host + "." + std::to_string(getpid()) + ".0"))
              .string();
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw RuntimeFailure("tensorboard: cannot create " + path_ + ": " + std::strerror(errno));
  write_record(tensorboard::encode_file_version_event(now));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  write_record(tensorboard::encode_scalars_event(tensorboard::unix_seconds(), step, scalars));
}

void TensorBoardWriter::write_record(const std::string& event) {
  if (failed_) return;
  const std::string rec = tensorboard::tfrecord(event);
  size_t done = 0;
  while (done < rec.size()) {
    const ssize_t n = ::write(fd_, rec.data() + done, rec.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      failed_ = true;
      spdlog::warn("tensorboard: writing {} failed ({}); no further steps are written to it", path_,
                   n < 0 ? std::strerror(errno) : "no progress");
      return;
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace ctitan
