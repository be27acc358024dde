// util/: the environment hooks' parser, the string helpers and the checksums, against
// references written here (zlib itself for CRC-32, bit-at-a-time CRC-32C).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "util/crc.h"
#include "util/env.h"
#include "util/files.h"
#include "util/strings.h"

namespace ctitan {
namespace {

TEST(Util, FaultHookParsesKindRankStepAndDetail) {
  const auto h = parse_fault_hook("oom:1:7:checkpoint save");
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->kind, "oom");
  EXPECT_TRUE(h->at(1, 7));
  EXPECT_FALSE(h->at(0, 7));
  EXPECT_FALSE(h->at(1, 6));
  EXPECT_EQ(h->detail, "checkpoint save");
  EXPECT_EQ(h->spec, "oom:1:7:checkpoint save");
  const auto k = parse_fault_hook("kill:0:3");
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->kind, "kill");
  EXPECT_TRUE(k->detail.empty());
  EXPECT_FALSE(parse_fault_hook("").has_value());
  EXPECT_FALSE(parse_fault_hook("kill").has_value());
  EXPECT_FALSE(parse_fault_hook("kill:x:3").has_value());
}

TEST(Util, RuntimeEnvIsReadOnceUntilReloaded) {
  ::setenv("CTITAN_TRACE_WINDOWS", "/tmp/a", 1);
  reload_runtime_env();
  EXPECT_EQ(runtime_env().trace_windows, "/tmp/a");
  ::setenv("CTITAN_TRACE_WINDOWS", "/tmp/b", 1);
  EXPECT_EQ(runtime_env().trace_windows, "/tmp/a") << "read once";
  reload_runtime_env();
  EXPECT_EQ(runtime_env().trace_windows, "/tmp/b");
  ::setenv("CTITAN_CHECKPOINT_FAULT", "raise:2:5", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  reload_runtime_env();
  ASSERT_TRUE(runtime_env().checkpoint_fault.has_value());
  EXPECT_TRUE(runtime_env().checkpoint_fault->at(2, 5));
  EXPECT_EQ(runtime_env().restart_count, 3);
  ::unsetenv("CTITAN_TRACE_WINDOWS");
  ::unsetenv("CTITAN_CHECKPOINT_FAULT");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  reload_runtime_env();
  EXPECT_TRUE(runtime_env().trace_windows.empty());
  EXPECT_FALSE(runtime_env().checkpoint_fault.has_value());
  EXPECT_EQ(runtime_env().restart_count, 0);
}

TEST(Util, JoinAndShape) {
  EXPECT_EQ(join({}, ", "), "");
  EXPECT_EQ(join({"a", "b", "c"}, ", or "), "a, or b, or c");
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({2, 3}), "[2, 3]");
  EXPECT_EQ(shape_str({2, 3}, ","), "[2,3]");
}

// One integer parser for the tools' command lines and checkpoint metadata: the whole string
// or nothing, 64-bit range checked.
TEST(Util, ParseInt64TakesTheWholeStringOrNothing) {
  EXPECT_EQ(parse_int64("42"), 42);
  EXPECT_EQ(parse_int64("-7"), -7);
  EXPECT_EQ(parse_int64("+7"), 7);
  EXPECT_EQ(parse_int64(" 7"), 7);
  EXPECT_EQ(parse_int64("9223372036854775807"), INT64_MAX);
  EXPECT_EQ(parse_int64("-9223372036854775808"), INT64_MIN);
  for (const char* bad : {"", " ", "7x", "7 ", "1.5", "x", "--1", "9223372036854775808", "1e3"})
    EXPECT_FALSE(parse_int64(bad).has_value()) << '"' << bad << '"';
}

uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t c = ~0u;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Util, CrcMatchesReferences) {
  std::mt19937 rng(5);
  std::string s(100003, '\0');
  for (auto& ch : s) ch = static_cast<char>(rng());
  const auto* p = reinterpret_cast<const Bytef*>(s.data());
  EXPECT_EQ(crc::crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc::crc32(s.data(), s.size()), static_cast<uint32_t>(::crc32(0, p, s.size())));
  const size_t cut = 4097;
  EXPECT_EQ(crc::crc32_combine(crc::crc32(s.data(), cut), crc::crc32(s.data() + cut, s.size() - cut), s.size() - cut),
            crc::crc32(s.data(), s.size()));
  EXPECT_EQ(crc::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc::crc32c(s.data(), s.size()), crc32c_bitwise(s));
}

// A folder a run will write into, looked at before anything is written: "" when it exists or
// can be made; otherwise the part in the way is named (the folder itself or one above it).
// Nothing is created or changed.
TEST(Util, WhyNotAWritableFolderNamesWhatIsInTheWay) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("ctitan_files_" + std::to_string(getpid()));
  fs::create_directories(root / "dir");
  std::ofstream(root / "file") << "keep";
  EXPECT_EQ(why_not_a_writable_folder((root / "dir").string()), "");
  EXPECT_EQ(why_not_a_writable_folder((root / "new/a/b").string()), "");
  EXPECT_EQ(why_not_a_writable_folder((root / "dir/../new/").string()), "");
  EXPECT_FALSE(fs::exists(root / "new"));
  const std::string file = (root / "file").string();
  EXPECT_EQ(why_not_a_writable_folder(file), file + " is a file");
  EXPECT_EQ(why_not_a_writable_folder(file + "/sub/step-1"), file + " is a file");
  EXPECT_EQ(why_not_a_writable_folder(file + "/../dir"), file + " is a file") << "as mkdir -p sees it";
  EXPECT_EQ(why_not_a_writable_folder("/dev/null/x"), "/dev/null exists and is not a folder");
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  EXPECT_EQ(why_not_a_writable_folder("file/ckpt"), file + " is a file") << "relative to the working folder";
  EXPECT_EQ(why_not_a_writable_folder("outputs/ckpt"), "");
  fs::current_path(cwd);
  if (geteuid() != 0) {  // root may write anywhere
    fs::create_directories(root / "ro");
    chmod((root / "ro").c_str(), 0555);
    EXPECT_EQ(why_not_a_writable_folder((root / "ro/ckpt").string()),
              (root / "ro").string() + " is not writable (Permission denied)");
    chmod((root / "ro").c_str(), 0755);
  }
  std::ifstream kept(file);
  std::string text;
  kept >> text;
  EXPECT_EQ(text, "keep");
  fs::remove_all(root);
}

}  // namespace
}  // namespace ctitan
