// PyramidInfer's selector in the AVX-512 builds: the weighted, head-averaged attention
// that a few recent queries pay to every key (baton/pyramid/scoring.py says what and why).
//
// q [R, H, D]; query_positions [R] (int64); weights [R] (fp32); k [S, Hkv, D];
// key_positions [S] (int64); sliding_window (0: none). Returns scores [S] fp32:
//
//   scores[s] = sum_r weights[r] / H * sum_h softmax_s(q[r, h] . k[s, h / G] / sqrt(D))
//
// over the keys each query sees (a key at or before its position, and inside the window).
// torch's version materialises [Hkv, R * G, S] logits and walks them five times (mask,
// softmax, weights, a matrix-vector product); here each KV head's keys are transposed once
// into 16-key tiles, and a work item (a few query rows of one KV head, at most 16 query
// vectors) computes its logits tile by tile, takes each vector's softmax in place and adds
// the weighted probabilities to its thread's scores, which are summed at the end.

#include "tiles.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace {

using namespace baton_tiles;

constexpr int kMaxVectors = 16;  // query vectors (rows x heads of a group) per work item

template <typename Type, int D>
struct AttentionScores {
  using Scalar = typename Type::Scalar;
  static constexpr int kDepth = Type::kDepth;
  static constexpr int kWords = D / kDepth;  // 32-bit words of a key row

  const Scalar* q;
  const int64_t* query_positions;
  const float* weights;
  const Scalar* k;
  const int64_t* key_positions;
  float* out;
  int64_t R, H, Hkv, G, S, window;
  float scale;

  int64_t tiles() const { return (S + kTile - 1) / kTile; }

  // Every KV head's keys as 16-key tiles, [Hkv][tiles][kWords][16] words, so that the products
  // are broadcasts of a query word against 16 keys; padding keys are zero. Tiles are shared
  // out among the threads (a long context's keys are tens of MB).
  std::vector<uint32_t> transposed_keys() const {
    std::vector<uint32_t> keys(Hkv * tiles() * kWords * kTile);
    at::parallel_for(0, Hkv * tiles(), 64, [&](int64_t begin, int64_t end) {
      const Scalar zero_row[D] = {};
      for (int64_t item = begin; item < end; ++item) {
        const int64_t head = item / tiles(), tile = item % tiles();
        uint32_t* dst = keys.data() + item * kWords * kTile;
        for (int chunk = 0; chunk < kWords / kTile; ++chunk) {
          __m512i columns[kTile];
          for (int j = 0; j < kTile; ++j) {
            const int64_t key = tile * kTile + j;
            const Scalar* row = key < S ? k + (key * Hkv + head) * D : zero_row;
            columns[j] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(row) + chunk * kTile);
          }
          transpose16(columns);
          for (int i = 0; i < kTile; ++i)
            _mm512_storeu_si512(dst + (chunk * kTile + i) * kTile, columns[i]);
        }
      }
    });
    return keys;
  }

  // Key positions as int32 tiles; padding keys get a position no query sees.
  std::vector<int32_t> padded_positions() const {
    std::vector<int32_t> positions(tiles() * kTile, std::numeric_limits<int32_t>::max());
    for (int64_t key = 0; key < S; ++key) positions[key] = static_cast<int32_t>(key_positions[key]);
    return positions;
  }

  // Query rows [first, first + rows) of KV head `head`: their G heads each, as vectors
  // row-major (vector = row * G + g).
  void run_item(int64_t first, int64_t rows, int64_t head, const uint32_t* keys,
                const int32_t* positions, std::vector<float>& logits, float* scores) const {
    const int64_t vectors = rows * G;
    const int64_t padded = tiles() * kTile;
    logits.resize(vectors * padded);
    uint32_t query[kMaxVectors][kWords];
    for (int64_t n = 0; n < vectors; ++n)
      for (int w = 0; w < kWords; ++w)
        query[n][w] = Type::word(q + ((first + n / G) * H + head * G + n % G) * D + w * kDepth);
    __m512i seen_from[kMaxVectors], seen_to[kMaxVectors];  // a key is seen when from < p <= to
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t position = static_cast<int32_t>(query_positions[first + r]);
      const int32_t from = window > 0 ? position - static_cast<int32_t>(window)
                                      : std::numeric_limits<int32_t>::min();
      seen_from[r] = _mm512_set1_epi32(from);
      seen_to[r] = _mm512_set1_epi32(position);
    }
    const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 scaling = _mm512_set1_ps(scale);
    const uint32_t* head_keys = keys + head * tiles() * kWords * kTile;
    for (int64_t tile = 0; tile < tiles(); ++tile) {
      const uint32_t* columns = head_keys + tile * kWords * kTile;
      __m512 acc[kMaxVectors];
      for (int64_t n = 0; n < vectors; ++n) acc[n] = _mm512_setzero_ps();
      for (int w = 0; w < kWords; ++w) {
        const __m512i column = _mm512_loadu_si512(columns + w * kTile);
        for (int64_t n = 0; n < vectors; ++n) acc[n] = Type::madd(acc[n], query[n][w], column);
      }
      const __m512i key_position = _mm512_loadu_si512(positions + tile * kTile);
      for (int64_t r = 0; r < rows; ++r) {
        const __mmask16 seen = _mm512_cmple_epi32_mask(key_position, seen_to[r]) &
                               _mm512_cmpgt_epi32_mask(key_position, seen_from[r]);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t n = r * G + g;
          _mm512_storeu_ps(logits.data() + n * padded + tile * kTile,
                           _mm512_mask_mul_ps(minus_infinity, seen, acc[n], scaling));
        }
      }
    }
    // weight of each vector's probabilities: its row's weight over H and over its softmax's sum
    float coefficient[kMaxVectors];
    for (int64_t n = 0; n < vectors; ++n) {
      const float total = softmax_numerators(logits.data() + n * padded, padded);
      coefficient[n] = total > 0.0f ? weights[first + n / G] / (static_cast<float>(H) * total) : 0.0f;
    }
    for (int64_t start = 0; start < padded; start += kTile) {
      __m512 sum = _mm512_loadu_ps(scores + start);
      for (int64_t n = 0; n < vectors; ++n) {
        if (coefficient[n] == 0.0f) continue;  // a vector that saw no key
        sum = _mm512_fmadd_ps(_mm512_set1_ps(coefficient[n]), _mm512_loadu_ps(logits.data() + n * padded + start), sum);
      }
      _mm512_storeu_ps(scores + start, sum);
    }
  }

  void run() {
    const std::vector<uint32_t> keys = transposed_keys();
    const std::vector<int32_t> positions = padded_positions();
    const int64_t padded = tiles() * kTile;
    const int64_t rows_per_item = std::max<int64_t>(1, kMaxVectors / G);
    const int64_t row_blocks = (R + rows_per_item - 1) / rows_per_item;
    const int64_t items = row_blocks * Hkv;
    std::vector<float> total(padded, 0.0f);
    std::mutex merge;
    const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), items));
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> logits, scores(padded, 0.0f);
      for (int64_t i; (i = next.fetch_add(1)) < items;) {
        const int64_t first = (i / Hkv) * rows_per_item;
        run_item(first, std::min(rows_per_item, R - first), i % Hkv, keys.data(), positions.data(),
                 logits, scores.data());
      }
      std::lock_guard<std::mutex> lock(merge);
      for (int64_t s = 0; s < padded; ++s) total[s] += scores[s];
    });
    std::copy(total.begin(), total.begin() + S, out);
  }
};

}  // namespace

at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& query_positions,
                            const at::Tensor& weights, const at::Tensor& k,
                            const at::Tensor& key_positions, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [queries, heads, dim]");
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous(), "k must be a contiguous [keys, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0
              && q.size(1) / k.size(1) <= kMaxVectors, "head counts or dims disagree");
  TORCH_CHECK(query_positions.dim() == 1 && query_positions.size(0) == q.size(0)
              && query_positions.scalar_type() == at::kLong && query_positions.is_contiguous(),
              "query_positions must be contiguous int64 [queries]");
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == q.size(0)
              && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights must be contiguous float32 [queries]");
  TORCH_CHECK(key_positions.dim() == 1 && key_positions.size(0) == k.size(0)
              && key_positions.scalar_type() == at::kLong && key_positions.is_contiguous(),
              "key_positions must be contiguous int64 [keys]");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", sliding_window);
  at::Tensor out = at::zeros({k.size(0)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0 || k.size(0) == 0) return out;
  for_dtype_and_head_dim(q, [&]<typename Type, int D>() {
    using Scalar = typename Type::Scalar;
    AttentionScores<Type, D> job;
    job.q = q.data_ptr<Scalar>();
    job.query_positions = query_positions.data_ptr<int64_t>();
    job.weights = weights.data_ptr<float>();
    job.k = k.data_ptr<Scalar>();
    job.key_positions = key_positions.data_ptr<int64_t>();
    job.out = out.data_ptr<float>();
    job.R = q.size(0);
    job.H = q.size(1);
    job.Hkv = k.size(1);
    job.G = job.H / job.Hkv;
    job.S = k.size(0);
    job.window = sliding_window;
    job.scale = 1.0f / std::sqrt(static_cast<float>(D));
    job.run();
  });
  return out;
}
