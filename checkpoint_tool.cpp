// checkpoint_tool: inspect, verify and convert checkpoint folders offline.
//   build/checkpoint_tool --help
#include "tools/checkpoint_tool.h"

int main(int argc, char** argv) { return ctitan::checkpoint_tool_main({argv + 1, argv + argc}); }
