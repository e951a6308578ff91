// Causal attention of a prompt slice on x86 CPUs with AVX-512 (bf16 via AVX512_BF16).
//
// Why: torch's CPU flash kernel reaches ~50-110 GFLOP/s on small heads (head_dim 32-64),
// bf16 or fp32 alike, and was ~60% of a bf16 prefill iteration on the shipped model.
// Here the score and value products run on the CPU's dot-product instructions (bf16 pairs
// with fp32 accumulation, or fp32 FMA), with keys and values re-laid out once per call so
// that every inner loop is a broadcast and a load of 16 lanes.
//
// Semantics: q [T, H, D], k/v [S, Hkv, D] (contiguous, same dtype), S >= T, the last T keys
// being the queries' own tokens: query t sees keys 0 .. S - T + t (bottom-right causal, as
// for a whole prompt or a chunk over its cached prefix). GQA: query head h reads KV head
// h / (H / Hkv). Softmax in fp32 (online, per block of keys); in bf16 the probabilities are
// rounded to bf16 before the value product, as torch's CPU flash kernel does. Returns
// [T, H, D] in q's dtype.

#include "cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace baton_cpu;

constexpr int kKeyBlock = 64;     // keys per softmax block (4 tiles of 16)
constexpr int kTile = 16;         // keys (or value dims) per 512-bit register of fp32
constexpr int kRowBlock = 4;      // query rows per register tile
constexpr int kTargetRows = 64;   // query rows (query tokens x grouped heads) per work item

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
  static inline void store_probabilities(const float* p, uint32_t* words) {
    // kKeyBlock probabilities -> kKeyBlock/2 bf16 pairs (cvtne2ps: round to nearest even)
    for (int i = 0; i < kKeyBlock; i += 32) {
      // cvtne2ps_pbh(a, b): bf16 elements 0-15 from b, 16-31 from a, so the 32 probabilities
      // stay in order and word j holds keys (i + 2j, i + 2j + 1), the low half first.
      __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + i + 16), _mm512_loadu_ps(p + i));
      _mm512_storeu_si512(words + i / 2, (__m512i)packed);
    }
  }
};

struct Fp32 {
  using Scalar = float;
  static constexpr int kDepth = 1;
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
  static inline void store_probabilities(const float* p, uint32_t* words) {
    std::memcpy(words, p, kKeyBlock * sizeof(float));
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

// --- One sequence's attention -----------------------------------------------------------

template <typename Type, int D>
struct Causal {
  using Scalar = typename Type::Scalar;
  static constexpr int kDepth = Type::kDepth;
  static constexpr int kSteps = D / kDepth;      // depth steps of a score product
  static constexpr int kDimTiles = D / kTile;    // 16-dim registers of an output row

  const Scalar* q;
  const Scalar* k;
  const Scalar* v;
  Scalar* out;
  int64_t T, S, H, Hkv, G;
  float scale;
  int64_t key_tiles, key_pad;
  std::vector<uint32_t> keys, values;  // re-laid out, per KV head (see the types above)

  void pack(int64_t head) {
    uint32_t* kp = keys.data() + head * key_tiles * kSteps * kTile;
    uint32_t* vp = values.data() + head * (key_pad / kDepth) * D;
    for (int64_t tile = 0; tile < key_tiles; ++tile) {
      for (int64_t j = 0; j < kTile; ++j) {
        int64_t key = tile * kTile + j;
        const Scalar* row = key < S ? k + (key * Hkv + head) * D : nullptr;
        for (int step = 0; step < kSteps; ++step)
          kp[(tile * kSteps + step) * kTile + j] = row ? Type::word(row + step * kDepth) : Type::zero_word();
      }
    }
    for (int64_t group = 0; group < key_pad / kDepth; ++group) {
      for (int d = 0; d < D; ++d) {
        Scalar lanes[kDepth];
        for (int i = 0; i < kDepth; ++i) {
          int64_t key = group * kDepth + i;
          lanes[i] = key < S ? v[(key * Hkv + head) * D + d] : Scalar(0);
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
    std::vector<float> scores(padded_rows * kKeyBlock), acc(padded_rows * D, 0.0f);
    std::vector<uint32_t> probs(padded_rows * (kKeyBlock / kDepth));
    std::vector<float> row_max(padded_rows, -std::numeric_limits<float>::infinity());
    std::vector<float> row_sum(padded_rows, 0.0f);
    std::vector<int64_t> limit(padded_rows);  // last visible key of each row
    for (int64_t r = 0; r < padded_rows; ++r) {
      int64_t rr = std::min(r, rows - 1);  // padding rows repeat the last one
      int64_t t = t0 + rr / G, h = head * G + rr % G;
      const Scalar* row = q + (t * H + h) * D;
      for (int step = 0; step < kSteps; ++step) query[r * kSteps + step] = Type::word(row + step * kDepth);
      limit[r] = S - T + t;
    }
    const uint32_t* kp = keys.data() + head * key_tiles * kSteps * kTile;
    const uint32_t* vp = values.data() + head * (key_pad / kDepth) * D;
    const int64_t first_limit = S - T + t0, last_limit = S - T + t0 + count - 1;
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t start = 0; start <= last_limit; start += kKeyBlock) {
      const bool masked = start + kKeyBlock - 1 > first_limit;
      const int64_t tile0 = start / kTile;
      const int tiles = static_cast<int>(std::min<int64_t>(kKeyBlock / kTile, key_tiles - tile0));
      // scores = q . k for 4 rows x 4 tiles of keys at a time
      for (int64_t r0 = 0; r0 < padded_rows; r0 += kRowBlock) {
        __m512 s[kRowBlock][4];
        for (int i = 0; i < kRowBlock; ++i)
          for (int j = 0; j < 4; ++j) s[i][j] = _mm512_setzero_ps();
        const uint32_t* qr = query.data() + r0 * kSteps;
        for (int step = 0; step < kSteps; ++step) {
          for (int j = 0; j < tiles; ++j) {
            const uint32_t* kt = kp + ((tile0 + j) * kSteps + step) * kTile;
            for (int i = 0; i < kRowBlock; ++i) s[i][j] = Type::madd(s[i][j], qr[i * kSteps + step], kt);
          }
        }
        for (int i = 0; i < kRowBlock; ++i)
          for (int j = 0; j < 4; ++j)
            _mm512_storeu_ps(scores.data() + (r0 + i) * kKeyBlock + j * kTile,
                             j < tiles ? _mm512_mul_ps(s[i][j], scale_v)
                                       : _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
      }
      // online softmax per row
      for (int64_t r = 0; r < padded_rows; ++r) {
        float* sr = scores.data() + r * kKeyBlock;
        if (masked) {
          const int64_t visible = limit[r] - start + 1;  // keys [0, visible) of the block
          for (int64_t j = std::max<int64_t>(visible, 0); j < kKeyBlock; ++j)
            sr[j] = -std::numeric_limits<float>::infinity();
        }
        __m512 m = _mm512_loadu_ps(sr);
        for (int j = 1; j < kKeyBlock / kTile; ++j) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + j * kTile));
        const float block_max = _mm512_reduce_max_ps(m);
        const float new_max = std::max(row_max[r], block_max);
        const __m512 max_v = _mm512_set1_ps(new_max);
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < kKeyBlock / kTile; ++j) {
          __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + j * kTile), max_v));
          _mm512_storeu_ps(sr + j * kTile, p);
          total = _mm512_add_ps(total, p);
        }
        const float correction = std::exp(row_max[r] - new_max);  // 0 on the first block
        row_sum[r] = row_sum[r] * correction + _mm512_reduce_add_ps(total);
        row_max[r] = new_max;
        if (correction != 1.0f) {
          float* ar = acc.data() + r * D;
          const __m512 c = _mm512_set1_ps(correction);
          for (int d = 0; d < kDimTiles; ++d)
            _mm512_storeu_ps(ar + d * kTile, _mm512_mul_ps(_mm512_loadu_ps(ar + d * kTile), c));
        }
        Type::store_probabilities(sr, probs.data() + r * (kKeyBlock / kDepth));
      }
      // acc += p . v for 4 rows at a time, all dims
      const uint32_t* vb = vp + (start / kDepth) * D;
      const int groups = tiles * kTile / kDepth;
      for (int64_t r0 = 0; r0 < padded_rows; r0 += kRowBlock) {
        __m512 o[kRowBlock][kDimTiles];
        for (int i = 0; i < kRowBlock; ++i)
          for (int d = 0; d < kDimTiles; ++d) o[i][d] = _mm512_loadu_ps(acc.data() + (r0 + i) * D + d * kTile);
        const uint32_t* pr = probs.data() + r0 * (kKeyBlock / kDepth);
        for (int g = 0; g < groups; ++g) {
          for (int d = 0; d < kDimTiles; ++d) {
            const uint32_t* vt = vb + g * D + d * kTile;
            for (int i = 0; i < kRowBlock; ++i) o[i][d] = Type::madd(o[i][d], pr[i * (kKeyBlock / kDepth) + g], vt);
          }
        }
        for (int i = 0; i < kRowBlock; ++i)
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
    key_tiles = (S + kTile - 1) / kTile;
    key_pad = key_tiles * kTile;
    keys.assign(Hkv * key_tiles * kSteps * kTile, 0);
    values.assign(Hkv * (key_pad / kDepth) * D, 0);
    const int64_t per_item = std::max<int64_t>(1, kTargetRows / G);
    const int64_t q_blocks = (T + per_item - 1) / per_item;
    // Work items, the longest first (a later query block sees more keys), handed out one at
    // a time: items differ in cost up to S / per_item times, and a static split would leave
    // one core waiting for the other.
    struct Item { int64_t head, t0, count; };
    std::vector<Item> items;
    for (int64_t b = q_blocks - 1; b >= 0; --b)
      for (int64_t head = 0; head < Hkv; ++head)
        items.push_back({head, b * per_item, std::min(per_item, T - b * per_item)});
    const int threads = std::max(1, at::get_num_threads());
    std::atomic<int64_t> next_head{0}, next_item{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t head; (head = next_head.fetch_add(1)) < Hkv;) pack(head);
    });
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next_item.fetch_add(1)) < static_cast<int64_t>(items.size());)
        run_item(items[i].head, items[i].t0, items[i].count);
    });
  }
};

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [len, heads, dim]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
  TORCH_CHECK(k.size(0) >= q.size(0), "fewer keys (", k.size(0), ") than queries (", q.size(0), ")");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "head counts or dims disagree");
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  for_dtype_and_head_dim(q, [&]<typename Type, int D>() {
    using Scalar = typename Type::Scalar;
    Causal<Type, D> job;
    job.q = q.data_ptr<Scalar>();
    job.k = k.data_ptr<Scalar>();
    job.v = v.data_ptr<Scalar>();
    job.out = out.data_ptr<Scalar>();
    job.T = q.size(0);
    job.H = q.size(1);
    job.S = k.size(0);
    job.Hkv = k.size(1);
    job.G = job.H / job.Hkv;
    job.scale = 1.0f / std::sqrt(static_cast<float>(D));
    job.run();
  });
  return out;
}

namespace {

// --- Decode: one new token per sequence over its paged cache, read in place --------------
//
// q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; block_tables [B, W] (int64);
// lengths [B] (int64): sequence b's keys are its first lengths[b] slots, in table order,
// and its new token sees them all (its own included, already written). One work item per
// (sequence, KV head): its G query heads' scores for every key (16 keys at a time: their
// rows loaded and transposed in registers, so the products are broadcasts again), then
// the softmax, then the value sum in fp32. Probabilities stay fp32.

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

constexpr int kMaxGroup = 16;  // query heads per KV head the decode kernel takes
constexpr int64_t kPrefetch = 32;  // keys ahead that the decode kernel asks the memory for

template <typename Type, int D>
struct PagedDecode {
  using Scalar = typename Type::Scalar;
  static constexpr int kDepth = Type::kDepth;
  static constexpr int kWords = D / kDepth;   // 32-bit words of a key row
  static constexpr int kDimTiles = D / kTile;
  static constexpr int kRows = D <= 64 ? 4 : 2;  // query rows per register tile of the value sum

  const Scalar* q;
  const Scalar* k_cache;
  const Scalar* v_cache;
  const int64_t* tables;
  const int64_t* lengths;
  Scalar* out;
  int64_t B, H, Hkv, G, W, block_size;
  float scale;

  static inline void prefetch_row(const Scalar* row) {
    for (size_t byte = 0; byte < D * sizeof(Scalar); byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T0);
  }

  // Where each key's row of this KV head starts (in elements), walking the block table once:
  // no division per key.
  void key_offsets(int64_t b, int64_t head, int64_t length, std::vector<int64_t>& offsets) const {
    offsets.resize(length);
    const int64_t* table = tables + b * W;
    for (int64_t key = 0, block = 0; key < length; ++block) {
      const int64_t base = table[block] * block_size;
      for (int64_t slot = 0; slot < block_size && key < length; ++slot, ++key)
        offsets[key] = ((base + slot) * Hkv + head) * D;
    }
  }

  void run_item(int64_t b, int64_t head, std::vector<float>& scores, std::vector<int64_t>& offsets) {
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
    // softmax per query row over [0, length)
    const int64_t full = length / kTile * kTile;
    const __mmask16 tail = static_cast<__mmask16>((1u << (length - full)) - 1);
    float inverse_sum[kMaxGroup];
    for (int64_t g = 0; g < rows; ++g) {
      float* sg = scores.data() + g * padded;
      __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < full; j += kTile) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + j));
      if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, sg + full));
      const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
      __m512 total = _mm512_setzero_ps();
      for (int64_t j = 0; j < full; j += kTile) {
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + j), row_max));
        _mm512_storeu_ps(sg + j, p);
        total = _mm512_add_ps(total, p);
      }
      if (tail) {
        __m512 p = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + full), row_max)));
        _mm512_mask_storeu_ps(sg + full, tail, p);
        total = _mm512_add_ps(total, p);
      }
      inverse_sum[g] = 1.0f / _mm512_reduce_add_ps(total);
    }
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

  void run() {
    // One item per sequence, longest first, handed out one at a time (lengths differ up to
    // ~20x in a batch). Its KV heads run back to back: a cache line holds every head of a
    // token when heads are small, and the next head finds it in L2 instead of memory.
    std::vector<int64_t> order(B);
    for (int64_t b = 0; b < B; ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return lengths[x] > lengths[y]; });
    const int threads = std::max(1, at::get_num_threads());
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<float> scores;
      std::vector<int64_t> offsets;
      for (int64_t i; (i = next.fetch_add(1)) < B;)
        for (int64_t head = 0; head < Hkv; ++head) run_item(order[i], head, scores, offsets);
    });
  }
};

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [batch, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous()
              && k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0
              && q.size(1) / k_cache.size(2) <= kMaxGroup, "head counts or dims disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.scalar_type() == at::kLong
              && tables.is_contiguous(), "block tables must be contiguous int64 [batch, width]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.scalar_type() == at::kLong
              && lengths.is_contiguous(), "lengths must be contiguous int64 [batch]");
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(length[b] >= 1 && length[b] <= tables.size(1) * k_cache.size(1),
                "length ", length[b], " of sequence ", b, " is not within its table's ",
                tables.size(1) * k_cache.size(1), " slots");
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  for_dtype_and_head_dim(q, [&]<typename Type, int D>() {
    using Scalar = typename Type::Scalar;
    PagedDecode<Type, D> job;
    job.q = q.data_ptr<Scalar>();
    job.k_cache = k_cache.data_ptr<Scalar>();
    job.v_cache = v_cache.data_ptr<Scalar>();
    job.tables = tables.data_ptr<int64_t>();
    job.lengths = lengths.data_ptr<int64_t>();
    job.out = out.data_ptr<Scalar>();
    job.B = q.size(0);
    job.H = q.size(1);
    job.Hkv = k_cache.size(2);
    job.G = job.H / job.Hkv;
    job.W = tables.size(1);
    job.block_size = k_cache.size(1);
    job.scale = 1.0f / std::sqrt(static_cast<float>(D));
    job.run();
  });
  return out;
}
