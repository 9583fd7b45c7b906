// The one TORCH_LIBRARY(shardopt) block: every op's schema is declared here so
// the whole op surface of the extension reads in one place. Kernels register
// with TORCH_LIBRARY_IMPL next to their implementation, and fake (meta)
// kernels for torch.compile / opcheck live in shardopt/_ops.py.
#include <torch/library.h>

TORCH_LIBRARY(shardopt, m) {
}
