// C++ test of the Adam kernels, independent of Python and of torch's ops.
//
// Each ISA variant this CPU runs is checked against a double-precision
// reference written here (for several sizes around the vector widths, both
// weight-decay modes and both low-precision copies), and against the scalar
// variant bit for bit (Note [Adam operation order]). The bf16/fp16 copies are
// checked against nearest-value searches in double, independent of the
// kernels' bit tricks. Exit status 0 = pass.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../adam/adam_dispatch.h"

namespace {

using shardopt::AdamHyper;
using shardopt::AdamTensor;

int g_failures = 0;

#define EXPECT(cond, ...)                                   \
  do {                                                      \
    if (!(cond)) {                                          \
      if (++g_failures <= 20) {                             \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
        std::printf(__VA_ARGS__);                           \
        std::printf("\n");                                  \
      }                                                     \
    }                                                       \
  } while (0)

AdamHyper make_hyper(bool adamw, double lr, double wd, int step) {
  const double b1 = 0.9, b2 = 0.999, bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
  AdamHyper h;
  h.beta1 = float(b1);
  h.beta2 = float(b2);
  h.one_minus_beta1 = float(1 - b1);
  h.one_minus_beta2 = float(1 - b2);
  h.step_size = float(lr / bc1);
  h.bias_correction2_sqrt = float(std::sqrt(bc2));
  h.eps = 1e-8f;
  h.adamw = adamw;
  h.l2 = adamw ? 0.0f : float(wd);
  h.decay = adamw ? float(1 - lr * wd) : 1.0f;
  return h;
}

// One element of Adam in double from the same fp32 inputs and constants.
// The *_scale outputs are the magnitudes the fp32 rounding errors are
// relative to: the terms summed, not the (possibly cancelling) result.
struct Reference {
  double p, m, v, p_scale, m_scale, v_scale;
};

Reference reference(const AdamHyper& h, double p, double g, double m, double v) {
  if (!h.adamw) g += double(h.l2) * p;
  if (h.adamw) p *= double(h.decay);
  Reference r;
  r.m_scale = std::fabs(m * h.beta1) + std::fabs(g * h.one_minus_beta1);
  r.m = m * h.beta1 + g * h.one_minus_beta1;
  r.v = v * h.beta2 + g * g * h.one_minus_beta2;
  r.v_scale = r.v;
  const double update = double(h.step_size) * r.m / (std::sqrt(r.v) / h.bias_correction2_sqrt + h.eps);
  // The update inherits exp_avg's rounding error relative to its terms.
  r.p_scale = std::fabs(p) + std::fabs(update) * (r.m_scale / (std::fabs(r.m) + 1e-30));
  r.p = p - update;
  return r;
}

double decode_bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double decode_fp16(uint16_t b) {
  const int e = (b >> 10) & 0x1F, mant = b & 0x3FF;
  const double mag = e == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, e - 25);
  return (b & 0x8000) ? -mag : mag;
}

// The representable value nearest to x (ties to the even encoding), by
// comparing the two candidates that bracket it. `step_up(b)` is the next
// larger magnitude.
template <typename Decode>
bool is_nearest(uint16_t got, double x, Decode decode, double overflow_at, uint16_t inf_bits) {
  const double ax = std::fabs(x);
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (ax >= overflow_at) return got == (sign | inf_bits);
  if ((got & 0x8000) != sign && ax != 0) return false;
  const uint16_t mag = got & 0x7FFF;
  const double d = std::fabs(decode(mag));
  const double below = mag > 0 ? std::fabs(decode(mag - 1)) : -1.0;
  const double above = std::fabs(decode(mag + 1));
  const double err = std::fabs(d - ax);
  if (below >= 0 && std::fabs(below - ax) < err) return false;
  if (std::fabs(above - ax) < err) return false;
  if (below >= 0 && std::fabs(below - ax) == err && (mag & 1)) return false;  // tie: even wins
  if (std::fabs(above - ax) == err && (mag & 1)) return false;
  return true;
}

struct Buffers {
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> lowp;
};

Buffers make_buffers(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Buffers b;
  for (int64_t i = 0; i < n; ++i) {
    b.p.push_back(normal(rng));
    b.g.push_back(normal(rng));
    b.m.push_back(0.1f * normal(rng));
    b.v.push_back(0.01f * std::fabs(normal(rng)));
  }
  b.lowp.assign(n, 0);
  return b;
}

void run(shardopt::AdamKernelFn kernel, const AdamHyper& h, Buffers& b, int lowp_kind) {
  AdamTensor t{b.p.data(), b.g.data(), b.m.data(), b.v.data(), b.lowp.data(), lowp_kind};
  // Two calls over [0, n/3) and [n/3, n): a range that starts off a vector
  // boundary, as a thread's piece of a tensor may.
  const int64_t n = int64_t(b.p.size()), cut = n / 3;
  kernel(&h, &t, 0, cut);
  kernel(&h, &t, cut, n);
}

bool close(double got, double want, double scale) {
  // One fp32 step from identical inputs: each of the few rounded operations
  // adds at most half an ulp of the magnitudes involved; 1e-6 is ~8 ulps.
  return std::fabs(got - want) <= 1e-6 * scale + 1e-30;
}

void check_variant(shardopt::Isa isa) {
  const auto kernel = shardopt::adam_kernel_for(isa);
  const char* name = shardopt::isa_name(isa);
  for (int64_t n : {1, 3, 7, 8, 9, 15, 16, 17, 33, 1023, 4099}) {
    for (bool adamw : {true, false}) {
      for (int lowp : {shardopt::kAdamLowpNone, shardopt::kAdamLowpBf16, shardopt::kAdamLowpFp16}) {
        const AdamHyper h = make_hyper(adamw, 0.01, 0.1, 3);
        Buffers b = make_buffers(n, unsigned(n * 7 + adamw)), in = b, scalar = b;
        run(kernel, h, b, lowp);
        run(shardopt::adam_kernel_scalar, h, scalar, lowp);
        for (int64_t i = 0; i < n; ++i) {
          const Reference r = reference(h, in.p[i], in.g[i], in.m[i], in.v[i]);
          EXPECT(close(b.p[i], r.p, r.p_scale), "%s n=%lld adamw=%d i=%lld: param %.9g, reference %.9g", name,
                 (long long)n, adamw, (long long)i, b.p[i], r.p);
          EXPECT(close(b.m[i], r.m, r.m_scale), "%s n=%lld i=%lld: exp_avg %.9g, reference %.9g", name,
                 (long long)n, (long long)i, b.m[i], r.m);
          EXPECT(close(b.v[i], r.v, r.v_scale), "%s n=%lld i=%lld: exp_avg_sq %.9g, reference %.9g", name,
                 (long long)n, (long long)i, b.v[i], r.v);
          EXPECT(b.p[i] == scalar.p[i] && b.m[i] == scalar.m[i] && b.v[i] == scalar.v[i] &&
                     b.lowp[i] == scalar.lowp[i],
                 "%s n=%lld i=%lld: differs from the scalar variant", name, (long long)n, (long long)i);
          if (lowp == shardopt::kAdamLowpBf16) {
            EXPECT(is_nearest(b.lowp[i], b.p[i], decode_bf16, 3.3961775292304957e38, 0x7F80),
                   "%s: bf16 copy of %.9g is 0x%04x", name, b.p[i], b.lowp[i]);
          } else if (lowp == shardopt::kAdamLowpFp16) {
            EXPECT(is_nearest(b.lowp[i], b.p[i], decode_fp16, 65520.0, 0x7C00),
                   "%s: fp16 copy of %.9g is 0x%04x", name, b.p[i], b.lowp[i]);
          }
        }
      }
    }
  }
}

// The conversions over values of every magnitude, including fp16 subnormals,
// overflow and exact ties, with lr = 0 so the param passes through unchanged.
void check_conversions(shardopt::Isa isa) {
  const auto kernel = shardopt::adam_kernel_for(isa);
  std::mt19937 rng(5);
  std::vector<float> x;
  for (int i = 0; i < 100000; ++i) {
    uint32_t u = rng() & 0x7FFFFFFFu;
    if (u > 0x7F800000u) continue;  // skip NaN: its payload is not part of the contract
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back((i & 1) ? -f : f);
  }
  for (float f : {0.0f, 65504.0f, 65520.0f, 0x1p-24f, 0x1p-25f, 0x1.8p-24f, 0x1.0p-14f, 1.0f + 0x1p-11f,
                  1.0f + 0x1.8p-10f, 1.0f + 0x1p-8f, 3.3895314e38f})
    x.push_back(f);
  const int64_t n = int64_t(x.size());
  for (int kind : {shardopt::kAdamLowpBf16, shardopt::kAdamLowpFp16}) {
    Buffers b;
    b.p = x;
    b.g.assign(n, 0.0f);
    b.m.assign(n, 0.0f);
    b.v.assign(n, 0.0f);
    b.lowp.assign(n, 0);
    run(kernel, make_hyper(true, 0.0, 0.0, 1), b, kind);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT(std::memcmp(&b.p[i], &x[i], 4) == 0, "%s: lr=0 changed %.9g", shardopt::isa_name(isa), x[i]);
      const bool ok = kind == shardopt::kAdamLowpBf16
                          ? is_nearest(b.lowp[i], x[i], decode_bf16, 3.3961775292304957e38, 0x7F80)
                          : is_nearest(b.lowp[i], x[i], decode_fp16, 65520.0, 0x7C00);
      EXPECT(ok, "%s: %s of %.9g is 0x%04x", shardopt::isa_name(isa), kind == 1 ? "bf16" : "fp16", x[i],
             b.lowp[i]);
    }
  }
}

}  // namespace

int main() {
  const auto isas = shardopt::supported_isas();
  for (auto isa : isas) {
    check_variant(isa);
    check_conversions(isa);
    std::printf("%-7s %s\n", shardopt::isa_name(isa), g_failures ? "FAILED" : "ok");
  }
  if (isas.size() < 2) std::printf("note: only the scalar variant runs on this CPU/build\n");
  std::printf("%d failure(s)\n", g_failures);
  return g_failures ? 1 : 0;
}
