// Portable variant: the reference every SIMD variant must match bit for bit.
#include "adam_element.h"

namespace shardopt {

void adam_kernel_scalar(const AdamHyper* h, const AdamTensor* t, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) adam_element(*h, *t, i);
}

}  // namespace shardopt
