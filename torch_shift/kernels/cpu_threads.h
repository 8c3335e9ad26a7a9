// What the CPU kernels' own threads share (Linux): sleeping on a futex word, waking its sleepers, a monotonic clock,
// and when a thread without work has spun long enough to sleep.

#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>

namespace {

void futex_wait(std::atomic<uint32_t>* word, uint32_t value) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}
int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1'000'000'000LL + t.tv_nsec;
}

// A thread without work spins, reading the clock every `spins_per_check` spins (1024 where a spin is a pause; 1 where
// it yields the core, which may take a scheduler's slice); `spun()` is true once it has spun `sleep_after_ns` since it
// last had work (`busy()`, also after it slept): time to sleep.
class IdleSpin {
 public:
  explicit IdleSpin(int64_t sleep_after_ns, int spins_per_check = 1024)
      : sleep_after_ns_(sleep_after_ns), spins_per_check_(spins_per_check) {}
  void busy() { since_ = -1; }
  bool spun() {
    if (++spins_ < spins_per_check_) return false;
    spins_ = 0;
    const int64_t now = now_ns();
    if (since_ < 0) {
      since_ = now;
      return false;
    }
    return now - since_ > sleep_after_ns_;
  }

 private:
  int64_t sleep_after_ns_;
  int spins_per_check_;
  int64_t since_ = -1;
  int spins_ = 0;
};

}  // namespace
