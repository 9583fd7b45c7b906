// One parallel region over many tensors.
//
// Note [One parallel pass over all tensors]
// Calling a fused kernel once per tensor costs one at::parallel_for per
// tensor: thread wake-up and join, 8-15 us each on a quiet machine and far
// more under contention. With 200 small tensors that overhead dominates the
// memory traffic. Instead we lay the tensors end to end in one virtual element
// space, run a single at::parallel_for over it, and let each thread's range
// cross tensor boundaries freely. The work is split by elements, not by
// tensors, so one large tensor among many small ones is shared by all threads.
//
// Each tensor starts at a multiple of kThreadAlign in that space (its length
// is rounded up; the padding is never handed out), and thread ranges are cut
// at multiples of kThreadAlign too. So every piece a thread gets starts at an
// element offset that is a multiple of 16 inside its tensor: two threads never
// write the same 64-byte line of a tensor whose data starts line aligned (what
// torch's allocator returns), and the vector loop of every piece but the first
// starts aligned. The padding costs at most 15 elements of imbalance per tensor.
//
// Per-tensor cost inside the region is one binary search per thread range and
// one call of `fn` per piece: nanoseconds, against microseconds for a region.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>

namespace shardopt {

constexpr int64_t kThreadAlign = 16;
// Below this many elements per thread, waking another thread costs more than
// it saves (about torch's at::internal::GRAIN_SIZE).
constexpr int64_t kDefaultGrain = 32768;

// Calls fn(tensor_index, begin, end) for pieces [begin, end) of each tensor
// (numels[i] elements), covering every element exactly once, from inside one
// at::parallel_for. fn runs concurrently on disjoint pieces.
template <typename Fn>
void parallel_over_tensors(const std::vector<int64_t>& numels, int64_t grain, const Fn& fn) {
  // offsets in units of kThreadAlign elements: tensor i occupies units
  // [offsets[i], offsets[i + 1]).
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) {
    offsets[i + 1] = offsets[i] + (numels[i] + kThreadAlign - 1) / kThreadAlign;
  }
  const int64_t units = offsets.back();
  if (units == 0) return;
  const int64_t grain_units = std::max<int64_t>(1, grain / kThreadAlign);
  at::parallel_for(0, units, grain_units, [&](int64_t ubegin, int64_t uend) {
    // The last tensor whose start is <= ubegin contains it (empty tensors
    // share their start with the next one and are skipped this way).
    size_t t = std::upper_bound(offsets.begin(), offsets.end(), ubegin) - offsets.begin() - 1;
    for (int64_t u = ubegin; u < uend; ++t) {
      const int64_t stop = std::min(uend, offsets[t + 1]);
      if (stop > u) {
        const int64_t begin = (u - offsets[t]) * kThreadAlign;
        const int64_t end = std::min((stop - offsets[t]) * kThreadAlign, numels[t]);
        fn(t, begin, end);
        u = stop;
      }
    }
  });
}

}  // namespace shardopt
