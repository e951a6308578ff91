// The element-wise steps of a Llama layer, each one pass over memory on x86 CPUs with AVX-512.
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
#include "cpu.h"

#include <cmath>

namespace {

using namespace baton_cpu;

constexpr int kLanes = 16;

// silu(g) = g / (1 + e^-g); with t = e^-|g| (never overflows): g / (1 + t) for g >= 0,
// g * t / (1 + t) below.
inline __m512 silu(__m512 g) {
  const __m512 t = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), t);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, t);
  return _mm512_div_ps(numerator, denominator);
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t width, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + width;
    T* o = out + r * width;
    for (int64_t i = 0; i < width; i += kLanes)
      store_from_float(o + i, _mm512_mul_ps(silu(load_as_float(gate + i)), load_as_float(up + i)));
  }
}

// One row of Hugging Face's RMSNorm: normalised in fp32, rounded to T, times the weight.
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += kLanes) {
    const __m512 v = load_as_float(x + i);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < width; i += kLanes) {
    const __m512 normalised = _mm512_mul_ps(load_as_float(x + i), s);
    T rounded[kLanes];
    store_from_float(rounded, normalised);  // the cast to the input dtype before the weight
    store_from_float(out + i, _mm512_mul_ps(load_as_float(rounded), load_as_float(weight + i)));
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
        const __m512 lo = load_as_float(v + i), hi = load_as_float(v + half + i);
        const __m512 new_lo = _mm512_fmsub_ps(lo, load_as_float(c + i), _mm512_mul_ps(hi, load_as_float(s + i)));
        const __m512 new_hi = _mm512_fmadd_ps(hi, load_as_float(c + half + i), _mm512_mul_ps(lo, load_as_float(s + half + i)));
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
