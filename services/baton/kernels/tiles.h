// What the AVX-512 builds' attention kernels share (causal_attention_tiles.cpp,
// decode_attention_tiles.cpp, attention_scores.cpp): 16-key register tiles, bf16 products on
// AVX512_BF16's dot-product instruction (two FMAs without it), and the element types that say how keys and values are
// laid out for them. Their loops hold 16-24 registers of scores at once, which only
// AVX-512's 32 registers keep; the AVX2 build has its own loops (rows.h).
#pragma once

#include "vec.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>

#ifndef __AVX512F__
#error "tiles.h is for the AVX-512 builds (-mavx512f -mavx512bw -mavx512vl -mavx512dq)"
#endif

namespace baton_tiles {

using namespace baton_vec;
static_assert(kLanes == 16, "a tile is one 512-bit register of fp32 lanes");

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
  static constexpr int kDepth = 2;  // vdpbf16ps (or its two FMAs): pairs of bf16 per 32-bit lane
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
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
#else
    // Without AVX512_BF16 (the avx512 build): vdpbf16ps's sum in two fp32 FMAs, in its order,
    // the pairs' high elements first (a product of two bf16 values is exact in fp32).
    const uint32_t a_high = a & 0xffff0000u, a_low = a << 16;
    float high, low;
    std::memcpy(&high, &a_high, sizeof(high));
    std::memcpy(&low, &a_low, sizeof(low));
    const __m512 b_high = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    const __m512 b_low = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    return _mm512_fmadd_ps(_mm512_set1_ps(low), b_low, _mm512_fmadd_ps(_mm512_set1_ps(high), b_high, acc));
#endif
  }
  static inline __m512 madd(__m512 acc, uint32_t a, const uint32_t* b) {
    return madd(acc, a, _mm512_loadu_si512(b));
  }
  static inline void store_probabilities(const __m512* p, uint32_t* words) {
    // kKeyBlock probabilities -> kKeyBlock/2 bf16 pairs (round to nearest even), in order:
    // word j holds keys (2j, 2j + 1), the low half first.
#ifdef __AVX512BF16__
    for (int i = 0; i < kKeyBlock / kTile; i += 2) {
      // cvtne2ps_pbh(a, b): bf16 elements 0-15 from b, 16-31 from a
      _mm512_storeu_si512(words + i * kTile / 2, (__m512i)_mm512_cvtne2ps_pbh(p[i + 1], p[i]));
    }
#else
    for (int i = 0; i < kKeyBlock / kTile; ++i)
      store_from_float(reinterpret_cast<Scalar*>(words) + i * kTile, p[i]);
#endif
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

}  // namespace baton_tiles
