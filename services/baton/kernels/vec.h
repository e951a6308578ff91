// The fp32 vector that every kernel source is written over, one register of the build's
// instruction set: 16 lanes (__m512) where the build's flags enable AVX-512 (__AVX512F__),
// 8 lanes (__m256, AVX2 and FMA) otherwise. cpu.py compiles the same sources once per
// instruction set; only this header (and the AVX-512 kernels' tiles.h) names registers.
//
// Each instruction set keeps its own exp and reductions (their lanes sum in a different order,
// and exp's underflow threshold differs), so a build's results are those it always had.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "baton's CPU kernels need at least AVX2 and FMA (-mavx2 -mfma)"
#endif

namespace baton_vec {

// The eight sums of a[0] .. a[7], each a's lanes added: lane i holds the sum of a[i]. (Eight
// AVX2 lanes, in every build: the AVX-512 builds' sums_of_lanes adds halves with it.)
inline __m256 sums_of_eight(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  // [0l 1l 2l 3l | 0h 1h 2h 3h] and the same for 4-7 (l, h: a register's low, high half)
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#ifdef __AVX512F__

using Vec = __m512;
constexpr int kLanes = 16;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* x) { return _mm512_loadu_ps(x); }
inline void store(float* x, Vec v) { _mm512_storeu_ps(x, v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline Vec fmsub(Vec a, Vec b, Vec c) { return _mm512_fmsub_ps(a, b, c); }  // a * b - c
inline Vec abs(Vec a) { return _mm512_abs_ps(a); }
// if_negative where x < 0, otherwise elsewhere
inline Vec where_negative(Vec x, Vec if_negative, Vec otherwise) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_LT_OQ), otherwise, if_negative);
}
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }

// The sixteen sums of a[0] .. a[15], each a's lanes added: lane i holds the sum of a[i]
// (each register's halves added, then eight sums at a time).
inline Vec sums_of_lanes(const Vec a[kLanes]) {
  __m256 halves[kLanes];
  for (int i = 0; i < kLanes; ++i)
    halves[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(sums_of_eight(halves)), sums_of_eight(halves + 8), 1);
}

// exp(r) for |r| <= ln2/2 times 2^n: a degree-7 Taylor polynomial (relative error < 1e-8
// there), and the power of two applied with scalef (2^-150 and below give 0).
inline Vec exp_reduced(Vec r, Vec n) {
  Vec p = broadcast(1.0f / 5040);
  p = fmadd(p, r, broadcast(1.0f / 720));
  p = fmadd(p, r, broadcast(1.0f / 120));
  p = fmadd(p, r, broadcast(1.0f / 24));
  p = fmadd(p, r, broadcast(1.0f / 6));
  p = fmadd(p, r, broadcast(0.5f));
  p = fmadd(p, r, broadcast(1.0f));
  p = fmadd(p, r, broadcast(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp(x) for x <= 0 (softmax after subtracting the row maximum): Cody-Waite reduction to
// r in [-ln2/2, ln2/2], then exp_reduced. Inputs below -104 give 0.
inline Vec exp_nonpositive(Vec x) {
  // Keeps -inf (a masked key) out of the reduction; exp(-110) scales by 2^-159, exactly 0.
  x = max(x, broadcast(-110.0f));
  const Vec n = _mm512_roundscale_ps(mul(x, broadcast(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, broadcast(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, broadcast(-2.12194440e-4f), r);
  return exp_reduced(r, n);
}

// 16 values as fp32, and back (bf16: round to nearest even, as torch's conversion).
inline Vec load_as_float(const float* x) { return load(x); }
inline Vec load_as_float(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
inline void store_from_float(float* x, Vec v) { store(x, v); }
inline void store_from_float(at::BFloat16* x, Vec v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), (__m256i)_mm512_cvtneps_pbh(v));
#else
  // torch's rounding (c10::round_to_nearest_even) in integer lanes: add 0x7fff and the kept
  // part's lowest bit, keep the high half; a NaN becomes the quiet NaN 0x7fc0.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lowest = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lowest, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(rounded));
#endif
}

#else  // AVX2 and FMA

using Vec = __m256;
constexpr int kLanes = 8;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* x) { return _mm256_loadu_ps(x); }
inline void store(float* x, Vec v) { _mm256_storeu_ps(x, v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
inline Vec fmsub(Vec a, Vec b, Vec c) { return _mm256_fmsub_ps(a, b, c); }  // a * b - c
inline Vec abs(Vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
// if_negative where x < 0, otherwise elsewhere
inline Vec where_negative(Vec x, Vec if_negative, Vec otherwise) {
  return _mm256_blendv_ps(otherwise, if_negative, _mm256_cmp_ps(x, zero(), _CMP_LT_OQ));
}

inline float reduce_add(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float reduce_max(Vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// lane i holds the sum of a[i]'s lanes
inline Vec sums_of_lanes(const Vec a[kLanes]) { return sums_of_eight(a); }

// exp(x) for x <= 0 (softmax after subtracting the row maximum): Cody-Waite reduction to
// r in [-ln2/2, ln2/2], a degree-7 Taylor polynomial (relative error < 1e-8 there), and 2^n
// built in the exponent bits. Inputs below -87 (where 2^n leaves the normal range) give 0.
inline Vec exp_nonpositive(Vec x) {
  const Vec underflow = _mm256_cmp_ps(x, broadcast(-87.0f), _CMP_LT_OQ);  // -inf too
  x = max(x, broadcast(-87.0f));
  const Vec n = _mm256_round_ps(mul(x, broadcast(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, broadcast(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, broadcast(-2.12194440e-4f), r);
  Vec p = broadcast(1.0f / 5040);
  p = fmadd(p, r, broadcast(1.0f / 720));
  p = fmadd(p, r, broadcast(1.0f / 120));
  p = fmadd(p, r, broadcast(1.0f / 24));
  p = fmadd(p, r, broadcast(1.0f / 6));
  p = fmadd(p, r, broadcast(0.5f));
  p = fmadd(p, r, broadcast(1.0f));
  p = fmadd(p, r, broadcast(1.0f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, mul(p, _mm256_castsi256_ps(power)));
}

// 8 values as fp32, and back (bf16: round to nearest even, as torch's conversion; NaN kept).
inline Vec load_as_float(const float* x) { return load(x); }
inline Vec load_as_float(const at::BFloat16* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}
inline void store_from_float(float* x, Vec v) { store(x, v); }
inline void store_from_float(at::BFloat16* x, Vec v) {
  alignas(32) float values[kLanes];
  _mm256_store_ps(values, v);
  for (int i = 0; i < kLanes; ++i) x[i] = static_cast<at::BFloat16>(values[i]);
}

#endif

}  // namespace baton_vec
