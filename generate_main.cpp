// generate: sample text from a checkpoint with a KV cache (see tools/generate.h).
//   build/generate --help
#include "tools/generate.h"

int main(int argc, char** argv) { return ctitan::generate_main({argv + 1, argv + argc}); }
