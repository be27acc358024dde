#include "util/files.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace fs = std::filesystem;

namespace ctitan {

std::string why_not_a_writable_folder(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  if (ec) p = path;
  // Up to the nearest part that exists: a part that is a file ends the walk (ENOTDIR below
  // it reads as "not found", as mkdir -p would then fail on it).
  for (;;) {
    const fs::file_status st = fs::status(p, ec);
    if (st.type() == fs::file_type::none) return p.string() + " cannot be looked at (" + ec.message() + ")";
    if (st.type() != fs::file_type::not_found) break;
    if (!p.has_relative_path()) return std::string();  // the root itself missing: nothing to say
    p = p.parent_path();
  }
  if (!fs::is_directory(p, ec))
    return p.string() + (fs::is_regular_file(p, ec) ? " is a file" : " exists and is not a folder");
  if (access(p.c_str(), W_OK | X_OK) != 0) return p.string() + " is not writable (" + std::strerror(errno) + ")";
  return std::string();
}

}  // namespace ctitan
