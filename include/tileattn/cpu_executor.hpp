#pragma once
// The CPU backend's threads. By default its tasks run on the caller's thread and the workers of
// one process-wide pool of tileattn's own. A program with a thread pool of its own (PyTorch's
// intra-op pool, a server's workers) can install an executor instead, so that one pool serves the
// process: two pools on the same cores compete (torch's OpenMP workers spin-wait for milliseconds
// after each of torch's calls, on the cores a following tileattn call wants). The executor only
// supplies threads; which task computes what does not change, so results are bitwise identical
// whatever runs them. AttentionProblem::num_threads still caps the threads a call asks for.
namespace tileattn {

// Runs work(job) on up to `threads` threads at once, the caller among them, and returns once every
// call has returned. work claims tasks until none are left, so a call that starts late, or runs
// after another on the same thread, finds nothing to do: an executor may start fewer calls than
// `threads` (at least one, on the caller or not). work never throws. Returns false, having run
// nothing, to leave the job to tileattn's own pool (e.g. more threads asked than it has).
using CpuExecutor = bool (*)(int threads, void (*work)(void* job), void* job);

// Installs the executor every later CPU call of this process uses; nullptr restores tileattn's own
// pool. Safe to call at any time: a call in flight finishes on what it started with.
void set_cpu_executor(CpuExecutor executor);

}  // namespace tileattn
