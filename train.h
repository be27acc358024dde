// ctitan's training program as a function, so that tests can run the very entry the train
// executable runs (config fuzzing in-process); train_main.cpp adds the process set-up.
#pragma once
#include <iosfwd>
#include <string>
#include <vector>

namespace ctitan {

// Runs `args` (argv[1..]) and returns the exit code: 0 success (or --help,
// job.print_config, job.validate_only), 2 bad config or arguments, 3 a collective failed,
// 1 any other failure. A failure is printed as one line on `err`; --help, the printed config
// and validate_only's line go to `out`.
int train_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace ctitan
