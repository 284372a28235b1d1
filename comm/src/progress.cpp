#include "progress_thread.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/comm/detail/progress_cpus.h"
#include "tessera/comm/progress.h"

namespace tessera::detail {

namespace {

// Long enough that polling costs the computing thread next to nothing (one test of each pending
// work per poll when nothing is ready), short against the milliseconds a prefetched all-gather has
// to hide in.
constexpr std::chrono::microseconds kPollInterval{100};

// CPU time of the calling thread.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Moves the calling thread onto `cpus`; the CPUs it may then run on, or empty when it stays
// where it was (nothing planned, or the system refused).
CpuList move_to(const CpuList& cpus) {
  if (cpus.empty()) return {};
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) return {};
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(pthread_self(), sizeof(set), &set) != 0) return {};
  CpuList now;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) now.push_back(c);
  return now;
}

class ProgressThread {
 public:
  void plan(CpuList cpus) {
    std::lock_guard<std::mutex> guard(mutex_);
    planned_ = std::move(cpus);
  }
  CpuList planned() {
    std::lock_guard<std::mutex> guard(mutex_);
    return planned_;
  }

  ProgressStats stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return stats_;
  }

  void add(std::weak_ptr<Work> work) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (stopped_) return;
    works_.push_back(std::move(work));
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    wake_.notify_one();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stopped_ = true;
      wake_.notify_one();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
    std::lock_guard<std::mutex> guard(mutex_);
    works_.clear();
  }

 private:
  void run() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stats_.cpus = move_to(planned_);
    }
    std::vector<std::weak_ptr<Work>> batch;
    for (;;) {
      {
        std::unique_lock<std::mutex> guard(mutex_);
        wake_.wait(guard, [this] { return stopped_ || !works_.empty(); });
        if (stopped_) return;
        batch.swap(works_);
      }
      // A work may be dropped by its owner meanwhile: then the last reference taken here runs
      // its destructor on this thread, which waits for it like any other owner would.
      std::vector<std::weak_ptr<Work>> pending;
      for (std::weak_ptr<Work>& weak : batch) {
        std::shared_ptr<Work> work = weak.lock();
        if (work && !work->poll()) pending.push_back(std::move(weak));
      }
      batch.clear();
      {
        std::lock_guard<std::mutex> guard(mutex_);
        ++stats_.polls;
        stats_.cpu_seconds = thread_cpu_seconds();
        for (std::weak_ptr<Work>& w : pending)
          works_.push_back(std::move(w));
      }
      if (pending.empty()) continue;
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::weak_ptr<Work>> works_;
  std::thread thread_;
  bool stopped_ = false;
  CpuList planned_;
  ProgressStats stats_;  // the thread's CPU time as of its last poll
};

// Never destroyed: the thread is joined by finalize() (always run, at exit if not before), and
// a static destructor running first would terminate on a joinable std::thread.
ProgressThread& progress_thread() {
  static ProgressThread* t = new ProgressThread();
  return *t;
}

}  // namespace

void stop_progress() {
  progress_thread().stop();
}

void set_planned_progress_cpus(std::vector<int> cpus) {
  progress_thread().plan(std::move(cpus));
}

CpuList planned_progress_cpus() {
  return progress_thread().planned();
}

}  // namespace tessera::detail

namespace tessera {

ProgressStats progress_stats() {
  return detail::progress_thread().stats();
}

void progress_in_background(const WorkPtr& work) {
  if (work && work->needs_polling()) detail::progress_thread().add(work);
}

}  // namespace tessera
