// Decode attention in the AVX2 build: one new token per sequence over its paged cache, read
// where it lies (decode_attention_tiles.cpp is the AVX-512 builds').
//
// q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, W] (int64);
// lengths [B] (int64): sequence b's keys are its first lengths[b] slots, in table order,
// and its new token sees them all (its own included, already written). One work item per
// sequence, its KV heads in turn: its G query heads' scores for every key (8 keys at a time,
// each key's products summed across lanes for all 8 at once), then the softmax, then the
// value sum. Everything is computed in fp32; bf16 keys and values are widened on load.

#include "rows.h"
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace baton_rows;

constexpr int kMaxGroup = 16;  // query heads per KV head the decode kernel takes
constexpr int64_t kPrefetch = 16;  // keys ahead that the kernel asks the memory for

template <typename Scalar, int D>
struct PagedDecode : baton_kernels::PagedDecodeArgs<Scalar> {
  static constexpr int kVectors = D / kLanes;  // registers of one row
  // The value sum keeps Rows x kPassVectors accumulators in registers (at most 12 of 16):
  // up to 3 query rows of 32 dims, or one row of 64.
  static constexpr int kPassVectors = kVectors < 8 ? kVectors : 8;
  static constexpr int kMaxRows = kPassVectors <= 4 ? 12 / kPassVectors : 1;
  // Rows a pass: the most that divide G (no pass computes a row of zeros), else the most.
  int rows_per_pass() const {
    const int most = static_cast<int>(std::min<int64_t>(kMaxRows, G));
    for (int rows = most; rows > 1; --rows)
      if (G % rows == 0) return rows;
    return most;
  }

  using Args = baton_kernels::PagedDecodeArgs<Scalar>;
  using Args::q, Args::k_cache, Args::v_cache, Args::tables, Args::lengths, Args::out;
  using Args::B, Args::H, Args::Hkv, Args::G, Args::W, Args::block_size, Args::scale;

  static inline void prefetch_row(const Scalar* row) {
    for (size_t byte = 0; byte < D * sizeof(Scalar); byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T0);
  }

  void key_offsets(int64_t b, int64_t head, int64_t length, std::vector<int64_t>& offsets) const {
    baton_kernels::paged_key_offsets(tables + b * W, block_size, Hkv, D, head, length, offsets);
  }

  // scores[g][key] = scale * q_g . k_key for every key, 8 keys at a time.
  void scores_of(const float (*query)[D], int64_t length, const std::vector<int64_t>& offsets,
                 float* scores, int64_t padded) const {
    float widened[kLanes][D];  // bf16 key rows as fp32
    for (int64_t start = 0; start < length; start += kLanes) {
      const Scalar* rows[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        rows[j] = k_cache + offsets[std::min<int64_t>(start + j, length - 1)];
        // The blocks lie anywhere in the pool, so no hardware prefetcher sees the next one
        // coming: ask for the rows ahead.
        prefetch_row(k_cache + offsets[std::min<int64_t>(start + kPrefetch + j, length - 1)]);
      }
      const float* keys[kLanes];
      rows_as_float<Scalar, D>(rows, widened, keys);
      for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(scores + g * padded + start, dot_eight<D>(query[g], keys));
    }
  }

  // out[g] = sum_key p[g][key] v_key / sum[g], kRows query rows and kPassVectors registers
  // of dims at a time.
  template <int kRows>
  void values_of(int64_t b, int64_t head, int64_t length, const std::vector<int64_t>& offsets,
                 const float* scores, int64_t padded, const float* inverse_sum) const {
    for (int dims = 0; dims < kVectors; dims += kPassVectors) {
      for (int64_t g0 = 0; g0 < G; g0 += kRows) {
        __m256 o[kRows][kPassVectors];
        for (int i = 0; i < kRows; ++i)
          for (int d = 0; d < kPassVectors; ++d) o[i][d] = _mm256_setzero_ps();
        add_weighted_values(o, scores + g0 * padded, padded, length, [&](int64_t key) {
          if (g0 == 0) prefetch_row(v_cache + offsets[std::min(key + kPrefetch, length - 1)]);
          return v_cache + offsets[key] + dims * kLanes;
        });  // rows past G hold zeros
        for (int i = 0; i < kRows && g0 + i < G; ++i) {
          Scalar* dst = out + (b * H + head * G + g0 + i) * D + dims * kLanes;
          const __m256 inverse = _mm256_set1_ps(inverse_sum[g0 + i]);
          for (int d = 0; d < kPassVectors; ++d) store_from_float(dst + d * kLanes, _mm256_mul_ps(o[i][d], inverse));
        }
      }
    }
  }

  void run_item(int64_t b, int64_t head, std::vector<float>& scores, std::vector<int64_t>& offsets) const {
    const int64_t length = lengths[b];
    const int rows_a_pass = rows_per_pass();
    const int64_t rows = (G + rows_a_pass - 1) / rows_a_pass * rows_a_pass;
    const int64_t padded = (length + kLanes - 1) / kLanes * kLanes + kLanes;  // softmax pads to here
    scores.assign(rows * padded, 0.0f);  // rows past G stay zero: the value sum adds nothing
    key_offsets(b, head, length, offsets);
    alignas(32) float query[kMaxGroup][D];
    for (int64_t g = 0; g < G; ++g)
      for (int d = 0; d < D; ++d) query[g][d] = static_cast<float>(q[(b * H + head * G + g) * D + d]) * scale;
    scores_of(query, length, offsets, scores.data(), padded);
    float inverse_sum[kMaxGroup];
    for (int64_t g = 0; g < G; ++g) inverse_sum[g] = 1.0f / softmax_numerators(scores.data() + g * padded, length);
    auto values = [&]<int kRows>() {
      if constexpr (kRows <= kMaxRows) values_of<kRows>(b, head, length, offsets, scores.data(), padded, inverse_sum);
    };
    switch (rows_a_pass) {
      case 3: values.template operator()<3>(); break;
      case 2: values.template operator()<2>(); break;
      default: values.template operator()<1>(); break;
    }
  }

  void run() const {
    this->for_each_sequence([&](int64_t b, int64_t head, baton_kernels::DecodeScratch& scratch) {
      run_item(b, head, scratch.scores, scratch.offsets);
    });
  }
};

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths) {
  baton_kernels::check_paged_decode_inputs(q, k_cache, v_cache, tables, lengths, kMaxGroup);
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  for_dtype_and_head_dim(q, [&]<typename Scalar, int D>() {
    PagedDecode<Scalar, D> job;
    job.bind(q, k_cache, v_cache, tables, lengths, out);
    job.run();
  });
  return out;
}
