// The CPU backend's parallel loop.

#include <atomic>
#include <stdexcept>
#include <vector>

#include "attnmix/cpu/detail/parallel.hpp"
#include "support/catch.hpp"

using attnmix::index_t;
namespace cpu = attnmix::detail::cpu;

TEST_CASE("parallel_for runs every task once", "[core][parallel]") {
  for (int workers : {1, 2, 7}) {
    std::vector<std::atomic<int>> hits(1000);
    std::atomic<int> bad_worker{0};
    cpu::parallel_for(1000, workers, [&](index_t t, int w) {
      hits[static_cast<std::size_t>(t)]++;
      if (w < 0 || w >= workers) bad_worker++;
    });
    for (auto& h : hits) CHECK(h.load() == 1);
    CHECK(bad_worker.load() == 0);
  }
}

TEST_CASE("parallel_for rethrows the first exception after joining", "[core][parallel]") {
  std::atomic<int> done{0};
  CHECK_THROWS_AS(cpu::parallel_for(100, 3,
                                    [&](index_t t, int) {
                                      if (t == 10) throw std::runtime_error("boom");
                                      done++;
                                    }),
                  std::runtime_error);
  CHECK(done.load() < 100);
  CHECK(cpu::worker_count(attnmix::backend::cpu{4}, 2) == 2);
  CHECK(cpu::worker_count(attnmix::backend::cpu{0}, 1000) >= 1);
}
