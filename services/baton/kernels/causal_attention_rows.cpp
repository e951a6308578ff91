// Causal attention of a prompt slice in the AVX2 build (causal_attention_tiles.cpp is the
// AVX-512 builds': its register tiles need 32 registers).
//
// Why: torch's CPU flash kernel reaches 35-70 GFLOP/s on small heads (head_dim 32) on these
// CPUs, a fifth of a prefill iteration on the shipped model.
//
// Semantics (as the AVX-512 kernel's): q [T, H, D], k/v [S, Hkv, D] (same dtype; each token's
// heads side by side, the rows may be strided), S >= T, the last T keys being the queries'
// own tokens: query t sees keys 0 .. S - T + t (bottom-right causal). GQA: query head h
// reads KV head h / (H / Hkv). Everything in fp32 (bf16 inputs widened on load; the
// probabilities are not rounded); returns [T, H, D] in q's dtype.
//
// How: a work item is one KV head and a few query tokens, their G query heads each: ~32
// query rows. Their scores for every visible key (8 keys at a time, each loaded once for all
// rows), then each row's softmax in one pass (the whole row is at hand, no online
// rescaling), then the value sum with a few rows' accumulators in registers.

#include "rows.h"
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace baton_rows;

constexpr int64_t kTargetRows = 32;  // query rows (query tokens x grouped heads) per work item

template <typename Scalar, int D>
struct Causal : baton_kernels::CausalArgs<Scalar> {
  static constexpr int kVectors = D / kLanes;  // registers of one row
  // The value sum keeps kRows x kPassVectors accumulators in registers (at most 12 of 16).
  static constexpr int kPassVectors = kVectors < 8 ? kVectors : 8;
  static constexpr int kRows = kPassVectors <= 4 ? 12 / kPassVectors : 1;

  using Args = baton_kernels::CausalArgs<Scalar>;
  using Args::q, Args::k, Args::v, Args::out, Args::T, Args::S, Args::H, Args::Hkv, Args::G;
  using Args::q_row, Args::k_row, Args::v_row, Args::scale;

  struct Scratch {
    std::vector<float> query, scores, inverse_sum;
    std::vector<int64_t> visible;  // keys each row sees
  };

  // One work item: KV head `head`, queries [t0, t0 + count), all G query heads of that KV
  // head. Rows r = t_local * G + g, so a row's visible keys never fall as r grows.
  void run_item(int64_t head, int64_t t0, int64_t count, Scratch& scratch) const {
    const int64_t rows = count * G;
    const int64_t padded_rows = (rows + kRows - 1) / kRows * kRows;
    const int64_t keys_seen = S - T + t0 + count;  // by the item's last row
    const int64_t padded = (keys_seen + kLanes - 1) / kLanes * kLanes + kLanes;  // softmax pads to here
    scratch.query.resize(rows * D);
    scratch.scores.assign(padded_rows * padded, 0.0f);  // rows past `rows` stay zero
    scratch.inverse_sum.assign(padded_rows, 0.0f);
    scratch.visible.resize(rows);
    float* query = scratch.query.data();
    float* scores = scratch.scores.data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / G, h = head * G + r % G;
      for (int d = 0; d < D; ++d) query[r * D + d] = static_cast<float>(q[t * q_row + h * D + d]) * scale;
      scratch.visible[r] = S - T + t + 1;
    }
    // scores[r][key] = scale * q_r . k_key, 8 keys at a time (keys past a row's last visible
    // one are left for the softmax to drop)
    float widened[kLanes][D];
    int64_t first_row = 0;  // the first row that sees a key of this tile
    for (int64_t start = 0; start < keys_seen; start += kLanes) {
      const Scalar* rows_of[kLanes];
      for (int j = 0; j < kLanes; ++j) rows_of[j] = k + std::min(start + j, keys_seen - 1) * k_row + head * D;
      const float* keys[kLanes];
      rows_as_float<Scalar, D>(rows_of, widened, keys);
      while (scratch.visible[first_row] <= start) ++first_row;
      for (int64_t r = first_row; r < rows; ++r)
        _mm256_storeu_ps(scores + r * padded + start, dot_eight<D>(query + r * D, keys));
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * padded;
      const int64_t visible = scratch.visible[r];
      scratch.inverse_sum[r] = 1.0f / softmax_numerators(row, visible);
      std::fill(row + visible, row + padded, 0.0f);  // a pass of several rows reads them
    }
    // out[r] = sum_key p[r][key] v_key / sum[r], kRows rows and kPassVectors registers at a time
    for (int dims = 0; dims < kVectors; dims += kPassVectors) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        __m256 o[kRows][kPassVectors];
        for (int i = 0; i < kRows; ++i)
          for (int d = 0; d < kPassVectors; ++d) o[i][d] = _mm256_setzero_ps();
        const int64_t last = std::min(r0 + kRows, rows) - 1;
        add_weighted_values(o, scores + r0 * padded, padded, scratch.visible[last],
                            [&](int64_t key) { return v + key * v_row + head * D + dims * kLanes; });
        for (int i = 0; i < kRows && r0 + i < rows; ++i) {
          const int64_t t = t0 + (r0 + i) / G, h = head * G + (r0 + i) % G;
          Scalar* dst = out + (t * H + h) * D + dims * kLanes;
          const __m256 inverse = _mm256_set1_ps(scratch.inverse_sum[r0 + i]);
          for (int d = 0; d < kPassVectors; ++d) store_from_float(dst + d * kLanes, _mm256_mul_ps(o[i][d], inverse));
        }
      }
    }
  }

  void run() const {
    const int64_t per_item = std::max<int64_t>(1, kTargetRows / G);
    const std::vector<baton_kernels::CausalItem> items = baton_kernels::causal_items(T, Hkv, per_item);
    baton_kernels::for_each_item<Scratch>(static_cast<int64_t>(items.size()), [&](int64_t i, Scratch& scratch) {
      run_item(items[i].head, items[i].t0, items[i].count, scratch);
    });
  }
};

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  baton_kernels::check_causal_inputs(q, k, v);
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  for_dtype_and_head_dim(q, [&]<typename Scalar, int D>() {
    Causal<Scalar, D> job;
    job.bind(q, k, v, out);
    job.run();
  });
  return out;
}
