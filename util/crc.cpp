#include "util/crc.h"

#include <zlib.h>

#include <array>
#include <limits>

namespace {

uLong zlib_crc32_combine(uLong a, uLong b, uint64_t len_b) {
  static_assert(sizeof(z_off_t) == 8, "zlib's z_off_t must hold 64-bit lengths");
  return ::crc32_combine(a, b, static_cast<z_off_t>(len_b));  // crc32_combine64 where zlib maps it
}

}  // namespace

// zlib may map the name to crc32_combine64 with a macro; ctitan's own function keeps its name.
#undef crc32_combine

namespace ctitan::crc {
namespace {

// Byte-at-a-time table of the reflected Castagnoli polynomial: metrics records are a few
// hundred bytes per step, so the simplest correct form is fast enough.
std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  // zlib takes the length as uInt (32 bits): feed larger buffers in pieces.
  const auto* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  constexpr size_t kPiece = size_t{1} << 30;
  while (n > 0) {
    const size_t k = n < kPiece ? n : kPiece;
    c = ::crc32(c, p, static_cast<uInt>(k));
    p += k;
    n -= k;
  }
  return static_cast<uint32_t>(c);
}

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return static_cast<uint32_t>(zlib_crc32_combine(crc_a, crc_b, len_b));
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

}  // namespace ctitan::crc
