// The element-wise steps of a Llama layer, each one pass over memory, in every build (one
// register of vec.h at a time: 16 lanes with AVX-512, 8 with AVX2).
//
// Why: unfused, these were ~40% of a bf16 prefill iteration outside attention on the
// shipped model (torch runs each as several passes with intermediate tensors: the norm's
// casts, silu then mul, rotate_half's cat and negation) and dozens of small ops per decode
// step. Each kernel computes in fp32 and rounds where Hugging Face's Llama rounds:
//   rms_norm:    (x * rsqrt(mean(x^2) + eps)) rounded to the dtype, times the weight
//   silu_and_mul: silu(gate) * up, rounded once (torch rounds silu's result too)
//   rotary_:     x * cos + rotate_half(x) * sin, rounded once
// so fp32 results equal torch's to rounding and bf16 ones differ by at most one rounding.

#include "common.h"
#include "vec.h"

#include <cmath>

namespace {

using namespace baton_vec;

// silu(g) = g / (1 + e^-g); with t = e^-|g| (never overflows): g / (1 + t) for g >= 0,
// g * t / (1 + t) below.
inline Vec silu(Vec g) {
  const Vec t = exp_nonpositive(sub(zero(), abs(g)));
  const Vec denominator = add(broadcast(1.0f), t);
  const Vec numerator = where_negative(g, mul(g, t), g);
  return div(numerator, denominator);
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t width, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + width;
    T* o = out + r * width;
    for (int64_t i = 0; i < width; i += kLanes)
      store_from_float(o + i, mul(silu(load_as_float(gate + i)), load_as_float(up + i)));
  }
}

// One row of Hugging Face's RMSNorm: normalised in fp32, rounded to T, times the weight.
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  Vec squares = zero();
  for (int64_t i = 0; i < width; i += kLanes) {
    const Vec v = load_as_float(x + i);
    squares = fmadd(v, v, squares);
  }
  const float scale = 1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(width) + eps);
  const Vec s = broadcast(scale);
  for (int64_t i = 0; i < width; i += kLanes) {
    const Vec normalised = mul(load_as_float(x + i), s);
    T rounded[kLanes];
    store_from_float(rounded, normalised);  // the cast to the input dtype before the weight
    store_from_float(out + i, mul(load_as_float(rounded), load_as_float(weight + i)));
  }
}

// In place on `heads` heads of head_dim at the start of each row: rotate_half pairs dim i
// with dim i + head_dim / 2.
template <typename T>
void rotary_rows(T* x, int64_t stride, const T* cos, const T* sin, int64_t heads, int64_t head_dim,
                 int64_t begin, int64_t end) {
  const int64_t half = head_dim / 2;
  for (int64_t r = begin; r < end; ++r) {
    const T* c = cos + r * head_dim;
    const T* s = sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * stride + h * head_dim;
      for (int64_t i = 0; i < half; i += kLanes) {
        const Vec lo = load_as_float(v + i), hi = load_as_float(v + half + i);
        const Vec new_lo = fmsub(lo, load_as_float(c + i), mul(hi, load_as_float(s + i)));
        const Vec new_hi = fmadd(hi, load_as_float(c + half + i), mul(lo, load_as_float(s + half + i)));
        store_from_float(v + i, new_lo);
        store_from_float(v + half + i, new_hi);
      }
    }
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) {
  return baton_kernels::silu_and_mul_with(x, [](const auto* in, int64_t stride, auto* out, int64_t width,
                                                int64_t b, int64_t e) { silu_and_mul_rows(in, stride, out, width, b, e); });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return baton_kernels::rms_norm_with(x, weight, eps, [](const auto* in, const auto* w, auto* out, int64_t width,
                                                         float e) { rms_norm_row(in, w, out, width, e); });
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  baton_kernels::rotary_with(x, cos, sin, heads, head_dim, [](auto* v, int64_t stride, const auto* c, const auto* s,
                                                               int64_t h, int64_t d, int64_t b, int64_t e) {
    rotary_rows(v, stride, c, s, h, d, b, e);
  });
}
