#include "progress.hpp"

#include <algorithm>
#include <cstdio>

namespace tileattn::bench {
namespace {

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

Progress::Progress(double after_s) : after_s_(after_s) {
  if (after_s_ > 0) thread_ = std::thread([this] { loop(); });
}

Progress::~Progress() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    quit_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Progress::start(std::string task) {
  if (!thread_.joinable()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  task_ = std::move(task);
  detail_.clear();
  active_ = true;
  started_ = Clock::now();
  next_report_ = started_ + seconds(after_s_);
  wake_.notify_one();
}

void Progress::step(std::string detail) {
  if (!thread_.joinable()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  detail_ = std::move(detail);
}

void Progress::stop() {
  if (!thread_.joinable()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  active_ = false;
}

void Progress::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!quit_) {
    if (!active_) {
      wake_.wait(lock, [this] { return quit_ || active_; });
      continue;
    }
    // Wakes at the report time; a start() in between moves it, and the wait is then redone.
    const Clock::time_point due = next_report_;
    if (wake_.wait_until(lock, due, [this, due] { return quit_ || !active_ || next_report_ != due; })) continue;
    const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
    std::fprintf(stderr, "tileattn-bench: %s%s%s: still running after %.1f s\n", task_.c_str(),
                 detail_.empty() ? "" : ", ", detail_.c_str(), elapsed);
    std::fflush(stderr);
    next_report_ = Clock::now() + seconds(5 * after_s_);
  }
}

}  // namespace tileattn::bench
