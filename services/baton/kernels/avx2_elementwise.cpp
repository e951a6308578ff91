// The element-wise steps of a Llama layer on x86 CPUs with AVX2 and FMA: the AVX-512 build's
// cpu_elementwise.cpp (which says why they are fused, and where they round) at eight lanes a
// register. Each is one pass over memory, computed in fp32, rounded where Hugging Face's
// Llama rounds; fp32 results equal torch's to rounding.

#include "avx2.h"
#include "common.h"

#include <cmath>

namespace {

using namespace baton_avx2;

// silu(g) = g / (1 + e^-g); with t = e^-|g| (never overflows): g / (1 + t) for g >= 0,
// g * t / (1 + t) below.
inline __m256 silu(__m256 g) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 t = exp_nonpositive(_mm256_sub_ps(zero, magnitude));
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), t);
  const __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
  const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, t), negative);
  return _mm256_div_ps(numerator, denominator);
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t width, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + width;
    T* o = out + r * width;
    for (int64_t i = 0; i < width; i += kLanes)
      store_from_float(o + i, _mm256_mul_ps(silu(load_as_float(gate + i)), load_as_float(up + i)));
  }
}

// One row of Hugging Face's RMSNorm: normalised in fp32, rounded to T, times the weight.
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < width; i += kLanes) {
    const __m256 v = load_as_float(x + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float scale = 1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(width) + eps);
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < width; i += kLanes) {
    const __m256 normalised = _mm256_mul_ps(load_as_float(x + i), s);
    T rounded[kLanes];
    store_from_float(rounded, normalised);  // the cast to the input dtype before the weight
    store_from_float(out + i, _mm256_mul_ps(load_as_float(rounded), load_as_float(weight + i)));
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
        const __m256 lo = load_as_float(v + i), hi = load_as_float(v + half + i);
        const __m256 new_lo = _mm256_fmsub_ps(lo, load_as_float(c + i), _mm256_mul_ps(hi, load_as_float(s + i)));
        const __m256 new_hi = _mm256_fmadd_ps(hi, load_as_float(c + half + i), _mm256_mul_ps(lo, load_as_float(s + half + i)));
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
