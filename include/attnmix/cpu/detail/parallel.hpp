#pragma once
// A minimal dynamic-schedule parallel loop on std::thread, so the library needs no OpenMP.

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "attnmix/config.hpp"
#include "attnmix/core/tags.hpp"

namespace attnmix {
namespace detail {
namespace cpu {

inline int worker_count(const backend::cpu& be, index_t tasks) {
  int n = be.threads > 0 ? be.threads : static_cast<int>(std::thread::hardware_concurrency());
  return static_cast<int>(std::max<index_t>(1, std::min<index_t>(std::max(n, 1), tasks)));
}

// Calls body(task, worker) for every task in [0, tasks), `workers` threads pulling tasks in
// order. worker is in [0, workers) and lets the body own per-thread scratch. The first
// exception thrown by a body is rethrown here after all threads have joined.
template <class Body>
void parallel_for(index_t tasks, int workers, Body&& body) {
  if (tasks <= 0) return;
  if (workers <= 1) {
    for (index_t t = 0; t < tasks; ++t) body(t, 0);
    return;
  }
  std::atomic<index_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto run = [&](int worker) {
    try {
      for (index_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) body(t, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next.store(tasks);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace cpu
}  // namespace detail
}  // namespace attnmix
