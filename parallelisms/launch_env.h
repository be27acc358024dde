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

  // torchrun's elastic agent (TORCHELASTIC_*; empty / 0 / false elsewhere). Its agent already
  // serves the c10d store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), so
  // every rank, 0 included, joins it as a client; it restarts the workers up to max_restarts
  // times (restart_count says which attempt this is) and reads a failing rank's reason from
  // error_file (TORCHELASTIC_ERROR_FILE) for its failure summary.
  bool agent_store = false;
  std::string run_id;
  int64_t restart_count = 0;
  int64_t max_restarts = 0;
  std::string error_file;

  bool distributed() const { return world_size > 1; }
  bool elastic() const { return !run_id.empty(); }
};

// Reads the launcher's variables from `env` (name → value; pass the process environment
// through environment_map()). Throws UserError on missing or inconsistent values, naming
// the variable, e.g. "launch: RANK=4 is not below WORLD_SIZE=4".
LaunchEnv detect_launch_env(const std::map<std::string, std::string>& env);
std::map<std::string, std::string> environment_map();

// torchrun starts each worker in a session of its own, so an agent killed with its process
// group (a node's processes going down) leaves its workers training, out of reach of any
// restart and holding the other nodes to a world that no longer exists. Under torchrun this
// starts a thread that ends the process (exit 1, one line on stderr and in the error file)
// within half a second of the agent's death, seen as a change of the parent pid. No-op
// outside torchrun.
void exit_when_agent_dies(const LaunchEnv& env);

// The error file torchrun's ChildFailedError reads (the schema of PyTorch's
// torch.distributed.elastic ErrorHandler): {"message": {"message": <line>, "extraInfo":
// {"timestamp": "<unix seconds>"}}} — torchrun's summary then shows <line> as the failed rank's
// "traceback" and orders failures by the timestamp.
std::string torchelastic_error_json(const std::string& line, int64_t unix_seconds);

// Writes `line` to $TORCHELASTIC_ERROR_FILE when torchrun set it (best effort: a failure to
// write is ignored, the line is on stderr anyway). A `consequence` (a collective failed because
// another rank did) is written one second later: torchrun names the failure with the smallest
// timestamp, in whole seconds, the root cause, and a rank that sees its peer's socket close
// fails within milliseconds of that peer — with equal timestamps torchrun could name either.
void maybe_write_torchelastic_error(const std::string& line, bool consequence = false);

}  // namespace ctitan
