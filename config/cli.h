// The exit-code rule of ctitan's command-line tools (checkpoint_tool, generate, tokenize), in one
// place: the body's own return value; a UserError is its one line and exit 2; any other failure
// is "error: <what>" and exit 1 (errors.h).
#pragma once
#include <iostream>

#include "config/errors.h"

namespace ctitan {

template <class Body>
int run_tool(Body&& body) {
  try {
    return body();
  } catch (const UserError& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace ctitan
