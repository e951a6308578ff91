// What the AVX2 build's attention kernels share (causal_attention_rows.cpp,
// decode_attention_rows.cpp): scores 8 keys at a time, each key's products summed across
// the lanes of one register, whole rows of scores at hand for the softmax, and value sums
// with at most 12 accumulators, so that every loop fits AVX2's 16 registers (the AVX-512
// builds' loops, tiles.h, need 32). bf16 is widened to fp32 on load (AVX2 has no bf16 products).
#pragma once

#include "vec.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#ifdef __AVX512F__
#error "rows.h is the AVX2 build's (8 lanes a register); the AVX-512 builds use tiles.h"
#endif

namespace baton_rows {

using namespace baton_vec;
static_assert(kLanes == 8, "the loops here sum 8 keys' products in one register");

// Softmax numerators of row[0, length) in place, exp(x - max), and their sum; a row whose
// every entry is -inf (nothing visible) is left as it is and gives 0. The row is padded to a
// multiple of 8 floats that may be overwritten.
inline float softmax_numerators(float* row, int64_t length) {
  const int64_t full = length / kLanes * kLanes;
  float maximum = -std::numeric_limits<float>::infinity();
  __m256 m = _mm256_set1_ps(maximum);
  for (int64_t j = 0; j < full; j += kLanes) m = _mm256_max_ps(m, _mm256_loadu_ps(row + j));
  maximum = reduce_max(m);
  for (int64_t j = full; j < length; ++j) maximum = std::max(maximum, row[j]);
  if (maximum == -std::numeric_limits<float>::infinity()) return 0.0f;
  for (int64_t j = length; j < full + kLanes; ++j) row[j] = -std::numeric_limits<float>::infinity();
  const __m256 row_max = _mm256_set1_ps(maximum);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < length; j += kLanes) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), row_max));
    _mm256_storeu_ps(row + j, p);
    total = _mm256_add_ps(total, p);
  }
  return reduce_add(total);
}

// Eight key rows as fp32: fp32 rows where they lie, bf16 rows widened into `widened`.
template <typename Scalar, int D>
inline void rows_as_float(const Scalar* const rows[kLanes], float (*widened)[D], const float* out[kLanes]) {
  for (int j = 0; j < kLanes; ++j) {
    if constexpr (std::is_same_v<Scalar, float>) {
      out[j] = rows[j];
    } else {
      for (int c = 0; c < D / kLanes; ++c) _mm256_storeu_ps(widened[j] + c * kLanes, load_as_float(rows[j] + c * kLanes));
      out[j] = widened[j];
    }
  }
}

// The dot products of one query row (D floats) with eight key rows: each key's products
// summed across lanes, all eight at once.
template <int D>
inline __m256 dot_eight(const float* query, const float* const keys[kLanes]) {
  __m256 acc[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    acc[j] = _mm256_mul_ps(_mm256_loadu_ps(query), _mm256_loadu_ps(keys[j]));
    for (int c = 1; c < D / kLanes; ++c)
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(query + c * kLanes), _mm256_loadu_ps(keys[j] + c * kLanes), acc[j]);
  }
  return sums_of_eight(acc);
}

// o[i] += sum over keys [0, num_keys) of p[i][key] * value(key), for kRows rows of
// probabilities (row i at p + i * p_stride) and kVectors registers of a value row
// (value(key) points at them); the accumulators stay in registers.
template <int kRows, int kVectors, typename ValueRow>
inline void add_weighted_values(__m256 (&o)[kRows][kVectors], const float* p, int64_t p_stride,
                                int64_t num_keys, ValueRow value) {
  for (int64_t key = 0; key < num_keys; ++key) {
    const auto* row = value(key);
    __m256 v[kVectors];
    for (int d = 0; d < kVectors; ++d) v[d] = load_as_float(row + d * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const __m256 weight = _mm256_broadcast_ss(p + i * p_stride + key);
      for (int d = 0; d < kVectors; ++d) o[i][d] = _mm256_fmadd_ps(weight, v[d], o[i][d]);
    }
  }
}

// Runs job.template operator()<Scalar, D>() for q's dtype and head dim, the kernels' only
// template parameters.
template <typename Job>
void for_dtype_and_head_dim(const at::Tensor& q, Job&& job) {
  auto for_head_dim = [&]<typename Scalar>() {
    switch (q.size(2)) {
      case 32: return job.template operator()<Scalar, 32>();
      case 64: return job.template operator()<Scalar, 64>();
      case 128: return job.template operator()<Scalar, 128>();
      default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not one of 32, 64, 128");
    }
  };
  if (q.scalar_type() == at::kBFloat16) for_head_dim.template operator()<at::BFloat16>();
  else if (q.scalar_type() == at::kFloat) for_head_dim.template operator()<float>();
  else TORCH_CHECK(false, "dtype ", q.scalar_type(), " is not bfloat16 or float32");
}

}  // namespace baton_rows
