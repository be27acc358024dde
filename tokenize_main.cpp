// tokenize: a corpus -> pre-tokenized .ctok shards for training.dataset_path.
//   build/tokenize --help
#include "datasets/token_shard.h"

int main(int argc, char** argv) { return ctitan::tokenize_main({argv + 1, argv + argc}); }
