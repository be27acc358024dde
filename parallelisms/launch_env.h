// Where this process sits in the job: rank, world size and rendezvous address, read from
// whichever launcher started it (our scripts/run_train.sh and torchrun set RANK etc.;
// mpirun sets OMPI_COMM_WORLD_*; srun sets SLURM_*). No launcher: one process.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace ctitan {

struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  // torchrun | mpirun | srun | none

  bool distributed() const { return world_size > 1; }
};

// Reads the launcher's variables from `env` (name → value; pass the process environment
// through environment_map()). Throws UserError on missing or inconsistent values, naming
// the variable, e.g. "launch: RANK=4 is not below WORLD_SIZE=4".
LaunchEnv detect_launch_env(const std::map<std::string, std::string>& env);
std::map<std::string, std::string> environment_map();

}  // namespace ctitan
