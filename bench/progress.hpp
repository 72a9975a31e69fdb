#pragma once
// Progress lines on stderr for runs that take long: without them a single large problem on the
// CPU prints nothing for minutes. A background thread reports what runs now once it has gone
// `after_s` seconds, then every 5 * after_s seconds, until the next task starts.
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace tileattn::bench {

class Progress {
 public:
  explicit Progress(double after_s);  // after_s <= 0: silent, no thread
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // A new task (e.g. "tileattn fwd B=1 H=8/8 ..."): its clock starts now.
  void start(std::string task);
  // What the current task is doing now (e.g. "run 3 of 20"); its clock keeps running.
  void step(std::string detail);
  // The current task is over; nothing is reported until the next start().
  void stop();

 private:
  using Clock = std::chrono::steady_clock;
  void loop();

  const double after_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool quit_ = false;
  bool active_ = false;
  std::string task_, detail_;
  Clock::time_point started_, next_report_;
  std::thread thread_;
};

// Starts `task` on construction and stops it on destruction, exceptions included.
class ProgressTask {
 public:
  ProgressTask(Progress* progress, std::string task) : progress_(progress) {
    if (progress_) progress_->start(std::move(task));
  }
  ~ProgressTask() {
    if (progress_) progress_->stop();
  }
  ProgressTask(const ProgressTask&) = delete;
  ProgressTask& operator=(const ProgressTask&) = delete;
  void step(std::string detail) {
    if (progress_) progress_->step(std::move(detail));
  }

 private:
  Progress* progress_;
};

}  // namespace tileattn::bench
