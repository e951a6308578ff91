// Causal attention of a prompt slice in the AVX-512 builds (bf16 products on AVX512_BF16's
// dot-product instruction in the avx512_bf16 build, on two FMAs in the avx512 one).
//
// Why: torch's CPU flash kernel reaches ~50-110 GFLOP/s on small heads (head_dim 32-64),
// bf16 or fp32 alike, and was ~60% of a bf16 prefill iteration on the shipped model.
// Here the score and value products run on the CPU's dot-product instructions (bf16 pairs
// with fp32 accumulation, or fp32 FMA), with keys and values re-laid out once per call so
// that every inner loop is a broadcast and a load of 16 lanes. The scores of 4 query rows
// and a 64-key block stay in 16 registers, and each row's online softmax runs on them: the
// loops over a register tile must unroll completely, or GCC keeps the tile on the stack and
// stores it at every step (which once cost this kernel half its speed).
//
// Semantics: q [T, H, D], k/v [S, Hkv, D] (same dtype; each token's heads side by side, the
// rows may be strided, as views of one fused projection are), S >= T, the last T keys
// being the queries' own tokens: query t sees keys 0 .. S - T + t (bottom-right causal, as
// for a whole prompt or a chunk over its cached prefix). GQA: query head h reads KV head
// h / (H / Hkv). Softmax in fp32 (online, per block of keys); in bf16 the probabilities are
// rounded to bf16 before the value product, as torch's CPU flash kernel does. Returns
// [T, H, D] in q's dtype.

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

constexpr int kScoreRows = 4;     // query rows of a score tile (4 rows x 4 key tiles)
constexpr int kRowBlock = 8;      // query rows are padded to a multiple of every tile's rows
constexpr int kTargetRows = 64;   // query rows (query tokens x grouped heads) per work item

// --- One sequence's attention -----------------------------------------------------------

template <typename Type, int D>
struct Causal : baton_kernels::CausalArgs<typename Type::Scalar> {
  using Scalar = typename Type::Scalar;
  static constexpr int kDepth = Type::kDepth;
  static constexpr int kSteps = D / kDepth;      // depth steps of a score product
  static constexpr int kDimTiles = D / kTile;    // 16-dim registers of an output row
  static constexpr int kBlockTiles = kKeyBlock / kTile;  // 16-key tiles of a softmax block
  static constexpr int kProbWords = kKeyBlock / kDepth;  // a row's probabilities of a block
  // rows of a value-product tile: 16 accumulators (32 dims: 8 rows; 128 dims: 2)
  static constexpr int kValueRows = 16 / kDimTiles;
  static_assert(kRowBlock % kScoreRows == 0 && kRowBlock % kValueRows == 0,
                "padded rows must fill whole score and value tiles");

  using Args = baton_kernels::CausalArgs<Scalar>;
  using Args::q, Args::k, Args::v, Args::out, Args::T, Args::S, Args::H, Args::Hkv, Args::G;
  using Args::q_row, Args::k_row, Args::v_row, Args::scale;
  int64_t key_tiles, key_pad;
  std::vector<uint32_t> keys, values;  // re-laid out, per KV head (see the types above)

  void pack(int64_t head) {
    uint32_t* kp = keys.data() + head * key_tiles * kSteps * kTile;
    uint32_t* vp = values.data() + head * (key_pad / kDepth) * D;
    for (int64_t tile = 0; tile < key_tiles; ++tile) {
      for (int64_t j = 0; j < kTile; ++j) {
        int64_t key = tile * kTile + j;
        const Scalar* row = key < S ? k + key * k_row + head * D : nullptr;
        for (int step = 0; step < kSteps; ++step)
          kp[(tile * kSteps + step) * kTile + j] = row ? Type::word(row + step * kDepth) : Type::zero_word();
      }
    }
    for (int64_t group = 0; group < key_pad / kDepth; ++group) {
      for (int d = 0; d < D; ++d) {
        Scalar lanes[kDepth];
        for (int i = 0; i < kDepth; ++i) {
          int64_t key = group * kDepth + i;
          lanes[i] = key < S ? v[key * v_row + head * D + d] : Scalar(0);
        }
        vp[group * D + d] = Type::word(lanes);
      }
    }
  }

  // One work item: KV head `head`, queries [t0, t0 + count), all G query heads of that KV
  // head. Rows r = t_local * G + g.
  void run_item(int64_t head, int64_t t0, int64_t count) {
    const int64_t rows = count * G;
    const int64_t padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
    std::vector<uint32_t> query(padded_rows * kSteps);
    std::vector<float> acc(padded_rows * D, 0.0f);
    std::vector<uint32_t> probs(padded_rows * kProbWords);
    std::vector<float> row_max(padded_rows, -std::numeric_limits<float>::infinity());
    std::vector<float> row_sum(padded_rows, 0.0f);
    std::vector<int64_t> limit(padded_rows);  // last visible key of each row
    for (int64_t r = 0; r < padded_rows; ++r) {
      int64_t rr = std::min(r, rows - 1);  // padding rows repeat the last one
      int64_t t = t0 + rr / G, h = head * G + rr % G;
      const Scalar* row = q + t * q_row + h * D;
      for (int step = 0; step < kSteps; ++step) query[r * kSteps + step] = Type::word(row + step * kDepth);
      limit[r] = S - T + t;
    }
    const uint32_t* kp = keys.data() + head * key_tiles * kSteps * kTile;
    const uint32_t* vp = values.data() + head * (key_pad / kDepth) * D;
    const int64_t first_limit = S - T + t0, last_limit = S - T + t0 + count - 1;
    // Scores in base 2: exp(x * scale) = 2^(x * scale * log2 e).
    const __m512 scale_v = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t start = 0; start <= last_limit; start += kKeyBlock) {
      const bool masked = start + kKeyBlock - 1 > first_limit;
      const int64_t tile0 = start / kTile;
      // scores = q . k for 4 rows x the block's 4 tiles of keys, then each row's online
      // softmax while its scores are still in registers
      for (int64_t r0 = 0; r0 < padded_rows; r0 += kScoreRows) {
        // s stays in registers only if every loop over it unrolls completely; the softmax
        // below reads its copy in `tile` (a loop with branches per row)
        __m512 s[kScoreRows][kBlockTiles];
#pragma GCC unroll 4
        for (int i = 0; i < kScoreRows; ++i)
#pragma GCC unroll 4
          for (int j = 0; j < kBlockTiles; ++j) s[i][j] = _mm512_setzero_ps();
        const uint32_t* qr = query.data() + r0 * kSteps;
        for (int step = 0; step < kSteps; ++step) {
#pragma GCC unroll 4
          for (int j = 0; j < kBlockTiles; ++j) {
            const uint32_t* kt = kp + ((tile0 + j) * kSteps + step) * kTile;
#pragma GCC unroll 4
            for (int i = 0; i < kScoreRows; ++i) s[i][j] = Type::madd(s[i][j], qr[i * kSteps + step], kt);
          }
        }
        __m512 tile[kScoreRows][kBlockTiles];
#pragma GCC unroll 4
        for (int i = 0; i < kScoreRows; ++i)
#pragma GCC unroll 4
          for (int j = 0; j < kBlockTiles; ++j) tile[i][j] = _mm512_mul_ps(s[i][j], scale_v);
        for (int i = 0; i < kScoreRows; ++i) {
          const int64_t r = r0 + i;
          __m512 x[kBlockTiles];
          for (int j = 0; j < kBlockTiles; ++j) x[j] = tile[i][j];
          if (masked) {  // keys past the row's last visible one (and past S) get -inf
            const __m512i visible = _mm512_set1_epi32(static_cast<int>(
                std::clamp<int64_t>(limit[r] - start + 1, 0, kKeyBlock)));
            for (int j = 0; j < kBlockTiles; ++j) {
              const __mmask16 hidden = _mm512_cmpge_epi32_mask(
                  _mm512_add_epi32(lane, _mm512_set1_epi32(j * kTile)), visible);
              x[j] = _mm512_mask_blend_ps(hidden, x[j], neg_inf);
            }
          }
          __m512 m = x[0];
          for (int j = 1; j < kBlockTiles; ++j) m = _mm512_max_ps(m, x[j]);
          const float block_max = _mm512_reduce_max_ps(m);
          // The row's reference point moves when a block's maximum passes it by more than
          // the type's kRescaleSlack (base 2); most blocks then skip rescaling the row's sum
          // and accumulator.
          if (block_max > row_max[r] + Type::kRescaleSlack) {
            if (row_max[r] != -std::numeric_limits<float>::infinity()) {
              const float correction = std::exp2(row_max[r] - block_max);
              row_sum[r] *= correction;
              float* ar = acc.data() + r * D;
              const __m512 c = _mm512_set1_ps(correction);
              for (int d = 0; d < kDimTiles; ++d)
                _mm512_storeu_ps(ar + d * kTile, _mm512_mul_ps(_mm512_loadu_ps(ar + d * kTile), c));
            }
            row_max[r] = block_max;
          }
          const __m512 max_v = _mm512_set1_ps(row_max[r]);
          __m512 total = _mm512_setzero_ps();
          for (int j = 0; j < kBlockTiles; ++j) {
            x[j] = exp2_bounded(_mm512_sub_ps(x[j], max_v));
            total = _mm512_add_ps(total, x[j]);
          }
          row_sum[r] += _mm512_reduce_add_ps(total);
          Type::store_probabilities(x, probs.data() + r * kProbWords);
        }
      }
      // acc += p . v for kValueRows rows at a time, all dims
      const uint32_t* vb = vp + (start / kDepth) * D;
      // keys past the item's last visible one have probability 0 in every row
      const int groups = static_cast<int>((std::min<int64_t>(kKeyBlock, last_limit - start + 1) + kDepth - 1) / kDepth);
      for (int64_t r0 = 0; r0 < padded_rows; r0 += kValueRows) {
        __m512 o[kValueRows][kDimTiles];
        for (int i = 0; i < kValueRows; ++i)
          for (int d = 0; d < kDimTiles; ++d) o[i][d] = _mm512_loadu_ps(acc.data() + (r0 + i) * D + d * kTile);
        const uint32_t* pr = probs.data() + r0 * kProbWords;
        for (int g = 0; g < groups; ++g) {
          for (int d = 0; d < kDimTiles; ++d) {
            const uint32_t* vt = vb + g * D + d * kTile;
            for (int i = 0; i < kValueRows; ++i) o[i][d] = Type::madd(o[i][d], pr[i * kProbWords + g], vt);
          }
        }
        for (int i = 0; i < kValueRows; ++i)
          for (int d = 0; d < kDimTiles; ++d) _mm512_storeu_ps(acc.data() + (r0 + i) * D + d * kTile, o[i][d]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      int64_t t = t0 + r / G, h = head * G + r % G;
      Scalar* dst = out + (t * H + h) * D;
      const float inv = 1.0f / row_sum[r];
      for (int d = 0; d < D; ++d) dst[d] = static_cast<Scalar>(acc[r * D + d] * inv);
    }
  }

  void run() {
    key_tiles = (S + kKeyBlock - 1) / kKeyBlock * kBlockTiles;
    key_pad = key_tiles * kTile;
    keys.assign(Hkv * key_tiles * kSteps * kTile, 0);
    values.assign(Hkv * (key_pad / kDepth) * D, 0);
    const int64_t per_item = std::max<int64_t>(1, kTargetRows / G);
    const std::vector<baton_kernels::CausalItem> items = baton_kernels::causal_items(T, Hkv, per_item);
    using baton_kernels::NoScratch;
    baton_kernels::for_each_item<NoScratch>(Hkv, [&](int64_t head, NoScratch&) { pack(head); });
    baton_kernels::for_each_item<NoScratch>(static_cast<int64_t>(items.size()), [&](int64_t i, NoScratch&) {
      run_item(items[i].head, items[i].t0, items[i].count);
    });
  }
};

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  baton_kernels::check_causal_inputs(q, k, v);
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  for_dtype_and_head_dim(q, [&]<typename Type, int D>() {
    using Scalar = typename Type::Scalar;
    Causal<Type, D> job;
    job.bind(q, k, v, out);
    job.run();
  });
  return out;
}
