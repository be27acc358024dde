// Stop requests from outside (preemption): SIGTERM, SIGINT or SIGUSR1 on any rank asks the
// job to stop at the next step boundary, where the ranks agree, save a checkpoint and exit
// 0; re-running the same command resumes. A second signal ends the process at once.
//
// The signals are blocked in every thread and taken by one watcher thread (sigwait), so no
// system call of the training threads (Gloo's sockets, file writes) is ever interrupted
// with EINTR, and what runs on a signal is ordinary code, not a signal handler.
#pragma once

namespace ctitan {

// Installs the watcher. Call once, early in main's thread, before other threads exist
// (threads inherit the blocked mask). Repeated calls do nothing.
//
// A signal of the same request can arrive twice within moments (Ctrl-C reaches the launcher
// and every rank of its process group, and the launcher forwards it; Slurm signals every
// process of a step): a signal within kRepeatWindowSeconds of the first counts as the same
// request. A later one ends the process at once, killed by that signal (exit status 128+n).
void install_stop_signal_watcher();
constexpr double kRepeatWindowSeconds = 1.0;

// The first stop signal this process received (SIGTERM, SIGINT, SIGUSR1), or 0.
int stop_signal_received();

// Sends `sig` to this process and waits (up to 2 s) until the watcher has seen it: the
// fault-injection hook uses it to make a stop request at an exact step.
void request_stop_for_test(int sig);

// "SIGTERM", "SIGINT", "SIGUSR1", or "a signal".
const char* stop_signal_name(int sig);

}  // namespace ctitan
