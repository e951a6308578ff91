// baton's CPU kernels: what the sources share, and what the bindings export.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace baton_cpu {

// exp(x) for x <= 0 (softmax after subtracting the row maximum): Cody-Waite reduction to
// r in [-ln2/2, ln2/2], a degree-7 Taylor polynomial (relative error < 1e-8 there), and
// the power of two applied with scalef. Inputs below -104 give 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  // Keeps -inf (a masked key) out of the reduction; exp(-110) scales by 2^-159, exactly 0.
  x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 values of a row as fp32, and back (bf16: round to nearest even, as torch's conversion).
inline __m512 load_as_float(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
inline __m512 load_as_float(const float* x) { return _mm512_loadu_ps(x); }
inline void store_from_float(at::BFloat16* x, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_from_float(float* x, __m512 v) { _mm512_storeu_ps(x, v); }

}  // namespace baton_cpu

// attention (cpu_attention.cpp)
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths);

// element-wise (cpu_elementwise.cpp)
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
