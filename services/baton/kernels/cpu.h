// baton's CPU kernels: what the sources share, and what the bindings export.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace baton_cpu {

// exp(r) for |r| <= ln2/2 times 2^n: a degree-7 Taylor polynomial (relative error < 1e-8
// there), and the power of two applied with scalef (2^-150 and below give 0).
inline __m512 exp_reduced(__m512 r, __m512 n) {
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

// exp(x) for x <= 0 (softmax after subtracting the row maximum): Cody-Waite reduction to
// r in [-ln2/2, ln2/2], then exp_reduced. Inputs below -104 give 0.
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
  return exp_reduced(r, n);
}

// 2^x for x up to a few units above 0 (the prompt kernel's softmax, in base 2, whose reference
// point may trail a row's maximum by the type's kRescaleSlack): x = n + f with n an integer
// and |f| <= 1/2, 2^f = exp(f ln 2) by exp_reduced. Inputs below -160 give 0.
inline __m512 exp2_bounded(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));  // keeps -inf (a masked key) out
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return exp_reduced(_mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.693147180559945309f)), n);
}

// Softmax numerators of row[0, length) in place, exp(x - max), and their sum; a row whose
// every entry is -inf (nothing visible) is left as it is and gives 0.
inline float softmax_numerators(float* row, int64_t length) {
  const int64_t full = length / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (length - full)) - 1);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
  if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, row + full));
  const float maximum = _mm512_reduce_max_ps(m);
  if (maximum == -std::numeric_limits<float>::infinity()) return 0.0f;
  const __m512 row_max = _mm512_set1_ps(maximum);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), row_max));
    _mm512_storeu_ps(row + j, p);
    total = _mm512_add_ps(total, p);
  }
  if (tail) {
    __m512 p = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), row_max)));
    _mm512_mask_storeu_ps(row + full, tail, p);
    total = _mm512_add_ps(total, p);
  }
  return _mm512_reduce_add_ps(total);
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

// 16x16 32-bit transpose: r[i] holds row i on entry, column i on return.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

constexpr int kTile = 16;  // fp32 lanes of a 512-bit register: keys, dims or values per tile
constexpr int kKeyBlock = 64;  // keys per softmax block of the prompt kernel (4 tiles)

// --- Element types ---------------------------------------------------------------------
//
// A type says how keys and values are laid out for its products and how a register tile
// of products is accumulated. "Lanes" are 32-bit words: a bf16 pair or one fp32 value.
//   keys:   [tiles][D / kDepth][16 keys] words: a tile's 16 keys side by side per depth step
//   values: [S_pad / kDepth][D] words: kDepth consecutive keys' values of one dim side by side
//   probabilities of a row: [kKeyBlock / kDepth] words

struct Bf16 {
  using Scalar = at::BFloat16;
  static constexpr int kDepth = 2;  // vdpbf16ps: pairs of bf16 per 32-bit lane
  // The prompt kernel's softmax keeps each row's reference point at its running maximum: the
  // largest probability is then exactly 1, which rounding to bf16 leaves exact (with a
  // slack, the bf16 error measured ~1.3x torch's).
  static constexpr float kRescaleSlack = 0.0f;
  static inline uint32_t word(const Scalar* x) {  // x[0], x[1] as one lane
    uint32_t w;
    std::memcpy(&w, x, sizeof(w));
    return w;
  }
  static inline uint32_t zero_word() { return 0; }
  static inline __m512 madd(__m512 acc, uint32_t a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
  }
  static inline __m512 madd(__m512 acc, uint32_t a, const uint32_t* b) {
    return madd(acc, a, _mm512_loadu_si512(b));
  }
  static inline void store_probabilities(const __m512* p, uint32_t* words) {
    // kKeyBlock probabilities -> kKeyBlock/2 bf16 pairs (cvtne2ps: round to nearest even)
    for (int i = 0; i < kKeyBlock / kTile; i += 2) {
      // cvtne2ps_pbh(a, b): bf16 elements 0-15 from b, 16-31 from a, so the 32 probabilities
      // stay in order and word j holds keys (2j, 2j + 1) of the pair of tiles, the low half first.
      _mm512_storeu_si512(words + i * kTile / 2, (__m512i)_mm512_cvtne2ps_pbh(p[i + 1], p[i]));
    }
  }
};

struct Fp32 {
  using Scalar = float;
  static constexpr int kDepth = 1;
  // fp32 probabilities are not rounded, so the reference point may trail the running maximum
  // by up to 2^8 (probabilities <= 256): most blocks skip rescaling, 6-9% of the kernel.
  static constexpr float kRescaleSlack = 8.0f;
  static inline uint32_t word(const Scalar* x) {
    uint32_t w;
    std::memcpy(&w, x, sizeof(w));
    return w;
  }
  static inline uint32_t zero_word() { return 0; }
  static inline __m512 madd(__m512 acc, uint32_t a, __m512i b) {
    float scalar;
    std::memcpy(&scalar, &a, sizeof(scalar));
    return _mm512_fmadd_ps(_mm512_set1_ps(scalar), _mm512_castsi512_ps(b), acc);
  }
  static inline __m512 madd(__m512 acc, uint32_t a, const uint32_t* b) {
    return madd(acc, a, _mm512_loadu_si512(b));
  }
  static inline void store_probabilities(const __m512* p, uint32_t* words) {
    for (int i = 0; i < kKeyBlock / kTile; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(words) + i * kTile, p[i]);
  }
};

// Runs job.template operator()<Type, D>() for q's dtype and head dim, the kernels' only
// template parameters.
template <typename Job>
void for_dtype_and_head_dim(const at::Tensor& q, Job&& job) {
  auto for_head_dim = [&]<typename Type>() {
    switch (q.size(2)) {
      case 32: return job.template operator()<Type, 32>();
      case 64: return job.template operator()<Type, 64>();
      case 128: return job.template operator()<Type, 128>();
      default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not one of 32, 64, 128");
    }
  };
  if (q.scalar_type() == at::kBFloat16) for_head_dim.template operator()<Bf16>();
  else if (q.scalar_type() == at::kFloat) for_head_dim.template operator()<Fp32>();
  else TORCH_CHECK(false, "dtype ", q.scalar_type(), " is not bfloat16 or float32");
}

}  // namespace baton_cpu

// attention (cpu_causal_attention.cpp, cpu_decode_attention.cpp)
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths);

// PyramidInfer's scores (cpu_attention_scores.cpp)
at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& query_positions,
                            const at::Tensor& weights, const at::Tensor& k,
                            const at::Tensor& key_positions, int64_t sliding_window);

// element-wise (cpu_elementwise.cpp)
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
