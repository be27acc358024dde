// Error channels (STYLE.md principle 5):
//  - UserError: bad config, arguments or input files. One line naming what and where;
//    main() prints it and exits 2 (config/arguments) — see ExitCode.
//  - Internal invariants use TORCH_CHECK / std::logic_error with a "[component]" prefix.
#pragma once
#include <stdexcept>
#include <string>

namespace ctitan {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A runtime failure that is not the user's config (I/O, NaN loss, dead rank): exit 1.
struct RuntimeFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A collective failed or timed out: usually the consequence of another rank's failure.
// main() exits 3 so a launcher can tell the cause (other codes) from the consequences.
struct CollectiveFailure : RuntimeFailure {
  using RuntimeFailure::RuntimeFailure;
};

}  // namespace ctitan
