// Questions about the file system a run asks before it writes anything.
#pragma once
#include <string>

namespace ctitan {

// Why `path` cannot become a folder this process writes into: "" when it is a writable folder
// or can be made one (its nearest existing ancestor is a writable folder), else the reason,
// e.g. "/tmp/run/ckpt is a file". Looks only: creates, changes and removes nothing.
std::string why_not_a_writable_folder(const std::string& path);

}  // namespace ctitan
