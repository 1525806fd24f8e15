// Host-side work over the threads, for a thread that wakes late (see NOTE: [Threads that wake late]).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include <ATen/Parallel.h>

namespace nanfast {

// NOTE: [Threads that wake late]
// at::parallel_for gives each thread a fixed share, so the call lasts as long as its latest thread
// plus that thread's share. After a stretch of single-threaded work the pool's other threads sleep,
// and on a VM a sleeping vCPU takes 100-140 us to wake (2-vCPU AMD EPYC of issue 19: a 64K-element
// parallel sum takes 136 us right after 40 ms of one-thread ops, 7 us right after itself). So each
// thread starts on its own share in order, as at::parallel_for would give it (a tensor written by
// threaded ATen ops is read near where it was written), and a thread that has finished its share
// takes the items the others have not started yet: a late thread's share is done by the others
// meanwhile. Which thread reads an item never changes what is computed (each item's result has its
// own slot), so results stay identical for any thread count and any timing.
// Calls fn(begin, end) on chunks of [0, n) of at most `chunk` items, each item exactly once.
template <typename Fn>
void parallel_items(int64_t n, int64_t chunk, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t begin = 0; begin < n; begin += chunk) {
      fn(begin, std::min(begin + chunk, n));
    }
    return;
  }
  const auto share_begin = [&](int64_t k) { return n * k / threads; };
  const std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[threads]);
  for (int64_t k = 0; k < threads; ++k) {
    next[k].store(share_begin(k), std::memory_order_relaxed);
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t own = first; own < last; ++own) {
      for (int64_t j = 0; j < threads; ++j) {  // its own share first, then the others' rest
        const int64_t k = (own + j) % threads;
        const int64_t end = share_begin(k + 1);
        for (int64_t begin = next[k].fetch_add(chunk); begin < end; begin = next[k].fetch_add(chunk)) {
          fn(begin, std::min(begin + chunk, end));
        }
      }
    }
  });
}

}  // namespace nanfast
