// Portable variant: the one every other must match bit for bit. On x86-64 the compiler still vectorises it with SSE2.
// The loops are int8_element.h's; only this file's compiler flags differ.
#include "int8_element.h"

namespace shardopt::comm {

void int8_encode_scalar(const Int8EncodeArgs* a, int64_t block_begin, int64_t block_end) {
  int8_encode_range(a, block_begin, block_end);
}

void int8_decode_scalar(const Int8DecodeArgs* a, int64_t block_begin, int64_t block_end) {
  int8_decode_range(a, block_begin, block_end);
}

}  // namespace shardopt::comm
