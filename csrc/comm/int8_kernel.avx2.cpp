// AVX2 variant: the same loops, vectorised 8 floats wide.
// The loops are int8_element.h's; only this file's compiler flags differ.
#include "int8_element.h"

namespace shardopt::comm {

void int8_encode_avx2(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end) {
  int8_encode_range(a, block_begin, block_end);
}

void int8_decode_avx2(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end) {
  int8_decode_range(a, block_begin, block_end);
}

}  // namespace shardopt::comm
