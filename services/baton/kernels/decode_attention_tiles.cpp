// Decode attention in the AVX-512 builds: one new token per sequence over its paged cache,
// read where it lies.
//
// q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, W] (int64);
// lengths [B] (int64): sequence b's keys are its first lengths[b] slots, in table order,
// and its new token sees them all (its own included, already written). One work item per
// sequence, its KV heads in turn: its G query heads' scores for every key (16 keys at a
// time: their rows loaded and transposed in registers, so the products are broadcasts
// again), then the softmax, then the value sum in fp32. Probabilities stay fp32.

#include "tiles.h"
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace baton_tiles;

constexpr int kMaxGroup = 16;  // query heads per KV head the decode kernel takes
constexpr int64_t kPrefetch = 32;  // keys ahead that the decode kernel asks the memory for

template <typename Type, int D>
struct PagedDecode : baton_kernels::PagedDecodeArgs<typename Type::Scalar> {
  using Scalar = typename Type::Scalar;
  static constexpr int kDepth = Type::kDepth;
  static constexpr int kWords = D / kDepth;   // 32-bit words of a key row
  static constexpr int kDimTiles = D / kTile;
  static constexpr int kRows = D <= 64 ? 4 : 2;  // query rows per register tile of the value sum

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

  void run_item(int64_t b, int64_t head, std::vector<float>& scores, std::vector<int64_t>& offsets) const {
    const int64_t length = lengths[b];
    const int64_t rows = (G + kRows - 1) / kRows * kRows;
    const int64_t padded = (length + kTile - 1) / kTile * kTile;
    scores.resize(rows * padded);
    key_offsets(b, head, length, offsets);
    uint32_t query[kMaxGroup][kWords];
    for (int64_t g = 0; g < rows; ++g)
      for (int w = 0; w < kWords; ++w)
        query[g][w] = g < G ? Type::word(q + (b * H + head * G + g) * D + w * kDepth) : 0;
    // scores[g][key] = scale * q_g . k_key, 16 keys at a time
    for (int64_t start = 0; start < length; start += kTile) {
      const Scalar* key_rows[kTile];
      for (int j = 0; j < kTile; ++j) {
        key_rows[j] = k_cache + offsets[std::min(start + j, length - 1)];
        // The blocks lie anywhere in the pool, so no hardware prefetcher sees the next one
        // coming: ask for the rows two tiles ahead.
        prefetch_row(k_cache + offsets[std::min(start + kPrefetch + j, length - 1)]);
      }
      __m512 acc[kMaxGroup];
      for (int64_t g = 0; g < rows; ++g) acc[g] = _mm512_setzero_ps();
      for (int chunk = 0; chunk < kWords / kTile; ++chunk) {
        __m512i columns[kTile];  // after the transpose: word `chunk * 16 + i` of the 16 keys
        for (int j = 0; j < kTile; ++j)
          columns[j] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(key_rows[j]) + chunk * kTile);
        transpose16(columns);
        for (int64_t g = 0; g < rows; ++g) {
          __m512 a = acc[g];
          for (int i = 0; i < kTile; ++i)
            a = Type::madd(a, query[g][chunk * kTile + i], columns[i]);
          acc[g] = a;
        }
      }
      for (int64_t g = 0; g < rows; ++g)
        _mm512_storeu_ps(scores.data() + g * padded + start, _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
    }
    float inverse_sum[kMaxGroup];
    for (int64_t g = 0; g < rows; ++g) inverse_sum[g] = 1.0f / softmax_numerators(scores.data() + g * padded, length);
    // out[g] = sum_key p[g][key] v_key, kRows query rows at a time
    for (int64_t g0 = 0; g0 < rows; g0 += kRows) {
      __m512 o[kRows][kDimTiles];
      for (int i = 0; i < kRows; ++i)
        for (int d = 0; d < kDimTiles; ++d) o[i][d] = _mm512_setzero_ps();
      for (int64_t key = 0; key < length; ++key) {
        const Scalar* value = v_cache + offsets[key];
        prefetch_row(v_cache + offsets[std::min(key + kPrefetch, length - 1)]);
        __m512 v[kDimTiles];
        for (int d = 0; d < kDimTiles; ++d) v[d] = load_as_float(value + d * kTile);
        for (int i = 0; i < kRows; ++i) {
          const __m512 p = _mm512_set1_ps(scores[(g0 + i) * padded + key]);
          for (int d = 0; d < kDimTiles; ++d) o[i][d] = _mm512_fmadd_ps(p, v[d], o[i][d]);
        }
      }
      for (int i = 0; i < kRows && g0 + i < G; ++i) {
        Scalar* dst = out + (b * H + head * G + g0 + i) * D;
        float row[D];
        for (int d = 0; d < kDimTiles; ++d)
          _mm512_storeu_ps(row + d * kTile, _mm512_mul_ps(o[i][d], _mm512_set1_ps(inverse_sum[g0 + i])));
        for (int d = 0; d < D; ++d) dst[d] = static_cast<Scalar>(row[d]);
      }
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
  for_dtype_and_head_dim(q, [&]<typename Type, int D>() {
    using Scalar = typename Type::Scalar;
    PagedDecode<Type, D> job;
    job.bind(q, k_cache, v_cache, tables, lengths, out);
    job.run();
  });
  return out;
}
