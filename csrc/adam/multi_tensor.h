// One parallel region over many tensors.
//
// Note [One parallel pass over all tensors]
// Calling a fused kernel once per tensor costs one at::parallel_for per
// tensor: thread wake-up and join, 8-15 us each on a quiet machine and far
// more under contention. With 200 small tensors that overhead dominates the
// memory traffic. Instead we lay the tensors end to end in one virtual element
// space, run a single at::parallel_for over it, and let each thread's range
// cross tensor boundaries freely.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>

namespace shardopt {

// Ranges handed to threads start at multiples of this many elements (64 bytes
// of fp32), so two threads never write the same cache line of a tensor that
// starts cache-line aligned, and vector loops start aligned.
constexpr int64_t kThreadAlign = 16;
// Below this many elements per thread, waking another thread costs more than
// it saves (about torch's at::internal::GRAIN_SIZE).
constexpr int64_t kDefaultGrain = 32768;

// Calls fn(tensor_index, begin, end) for pieces [begin, end) of each tensor
// (numels[i] elements), covering every element exactly once, from inside one
// at::parallel_for. fn runs concurrently on disjoint pieces.
template <typename Fn>
void parallel_over_tensors(const std::vector<int64_t>& numels, int64_t grain, const Fn& fn) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) offsets[i + 1] = offsets[i] + numels[i];
  const int64_t total = offsets.back();
  if (total == 0) return;
  const int64_t units = (total + kThreadAlign - 1) / kThreadAlign;
  const int64_t grain_units = std::max<int64_t>(1, grain / kThreadAlign);
  at::parallel_for(0, units, grain_units, [&](int64_t ubegin, int64_t uend) {
    int64_t begin = ubegin * kThreadAlign;
    const int64_t end = std::min(uend * kThreadAlign, total);
    // The last tensor whose start is <= begin contains begin (empty tensors
    // share their start with the next one and are skipped this way).
    size_t t = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, offsets[t + 1]);
      if (stop > begin) fn(t, begin - offsets[t], stop - offsets[t]);
      begin = std::max(begin, stop);
      ++t;
    }
  });
}

}  // namespace shardopt
