// What every instruction set's kernels share that is not vector code: their input checks, the
// paged cache's layout and how work items are ordered. One rule for every build.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace baton_kernels {

// q [B, H, D]; k_cache, v_cache [blocks, block_size, Hkv, D]; tables [B, W] int64;
// lengths [B] int64, each within its table's slots. At most max_group query heads per KV head.
inline void check_paged_decode_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& tables, const at::Tensor& lengths, int64_t max_group) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [batch, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous()
              && k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0
              && q.size(1) / k_cache.size(2) <= max_group, "head counts or dims disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.scalar_type() == at::kLong
              && tables.is_contiguous(), "block tables must be contiguous int64 [batch, width]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.scalar_type() == at::kLong
              && lengths.is_contiguous(), "lengths must be contiguous int64 [batch]");
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(length[b] >= 1 && length[b] <= tables.size(1) * k_cache.size(1),
                "length ", length[b], " of sequence ", b, " is not within its table's ",
                tables.size(1) * k_cache.size(1), " slots");
}

// q [T, H, D], k and v [S, Hkv, D], S >= T, one dtype; each token's heads side by side (rows
// may be strided: q, k and v as views of one fused projection).
inline void check_causal_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [len, heads, dim]");
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2) && x->stride(0) >= x->size(1) * x->size(2),
                "q, k, v must hold each token's heads side by side ([len, heads, dim] with dim and "
                "heads contiguous; rows may be strided)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
  TORCH_CHECK(k.size(0) >= q.size(0), "fewer keys (", k.size(0), ") than queries (", q.size(0), ")");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "head counts or dims disagree");
}

// Where each of a sequence's first `length` keys' rows of one KV head starts (in elements) in
// a paged cache [blocks, block_size, Hkv, D], in table order: the table walked once, no
// division per key.
inline void paged_key_offsets(const int64_t* table, int64_t block_size, int64_t Hkv, int64_t D,
                              int64_t head, int64_t length, std::vector<int64_t>& offsets) {
  offsets.resize(length);
  for (int64_t key = 0, block = 0; key < length; ++block) {
    const int64_t base = table[block] * block_size;
    for (int64_t slot = 0; slot < block_size && key < length; ++slot, ++key)
      offsets[key] = ((base + slot) * Hkv + head) * D;
  }
}

// Runs run(i, scratch) for i in [0, count), items handed out one at a time to torch's threads
// (each thread's Scratch made once): items that differ in cost end together.
template <typename Scratch, typename Run>
void for_each_item(int64_t count, Run&& run) {
  const int threads = std::max(1, at::get_num_threads());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1)) < count;) run(i, scratch);
  });
}

struct NoScratch {};
struct DecodeScratch {  // a thread's buffers for one sequence and KV head at a time
  std::vector<float> scores;
  std::vector<int64_t> offsets;
};

// What a paged decode kernel reads and writes, taken from its (checked) tensors.
template <typename Scalar>
struct PagedDecodeArgs {
  const Scalar* q;
  const Scalar* k_cache;
  const Scalar* v_cache;
  const int64_t* tables;
  const int64_t* lengths;
  Scalar* out;
  int64_t B, H, Hkv, G, W, block_size;
  float scale;

  void bind(const at::Tensor& q_, const at::Tensor& k_cache_, const at::Tensor& v_cache_,
            const at::Tensor& tables_, const at::Tensor& lengths_, at::Tensor& out_) {
    q = q_.data_ptr<Scalar>();
    k_cache = k_cache_.data_ptr<Scalar>();
    v_cache = v_cache_.data_ptr<Scalar>();
    tables = tables_.data_ptr<int64_t>();
    lengths = lengths_.data_ptr<int64_t>();
    out = out_.data_ptr<Scalar>();
    B = q_.size(0);
    H = q_.size(1);
    Hkv = k_cache_.size(2);
    G = H / Hkv;
    W = tables_.size(1);
    block_size = k_cache_.size(1);
    scale = 1.0f / std::sqrt(static_cast<float>(q_.size(2)));
  }

  // Runs item(b, head, scratch) (a DecodeScratch) for every sequence and KV head: one item per sequence,
  // longest first, handed out one at a time (lengths differ up to ~20x in a batch). Its KV
  // heads run back to back: a cache line holds every head of a token when heads are small,
  // and the next head finds it in L2 instead of memory.
  template <typename Item>
  void for_each_sequence(Item&& item) const {
    std::vector<int64_t> order(B);
    for (int64_t b = 0; b < B; ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return lengths[x] > lengths[y]; });
    for_each_item<DecodeScratch>(B, [&](int64_t i, DecodeScratch& scratch) {
      for (int64_t head = 0; head < Hkv; ++head) item(order[i], head, scratch);
    });
  }
};

// What a prompt kernel reads and writes, taken from its (checked) tensors.
template <typename Scalar>
struct CausalArgs {
  const Scalar* q;
  const Scalar* k;
  const Scalar* v;
  Scalar* out;
  int64_t T, S, H, Hkv, G;
  int64_t q_row, k_row, v_row;  // elements from one token's row to the next
  float scale;

  void bind(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, at::Tensor& out_) {
    q = q_.data_ptr<Scalar>();
    k = k_.data_ptr<Scalar>();
    v = v_.data_ptr<Scalar>();
    out = out_.data_ptr<Scalar>();
    q_row = q_.stride(0);
    k_row = k_.stride(0);
    v_row = v_.stride(0);
    T = q_.size(0);
    H = q_.size(1);
    S = k_.size(0);
    Hkv = k_.size(1);
    G = H / Hkv;
    scale = 1.0f / std::sqrt(static_cast<float>(q_.size(2)));
  }
};

// The prompt kernels' work items: one KV head and `count` query tokens from t0, the last
// query blocks first (a later block sees more keys), so items handed out one at a time
// end together: they differ in cost up to S / per_item times.
struct CausalItem { int64_t head, t0, count; };
inline std::vector<CausalItem> causal_items(int64_t T, int64_t Hkv, int64_t per_item) {
  std::vector<CausalItem> items;
  for (int64_t b = (T + per_item - 1) / per_item - 1; b >= 0; --b)
    for (int64_t head = 0; head < Hkv; ++head)
      items.push_back({head, b * per_item, std::min(per_item, T - b * per_item)});
  return items;
}

// The element-wise kernels' rows: x [rows, width], unit column stride, bf16 or fp32, width a
// multiple of 16 (one AVX-512 register; two AVX2 ones).
inline void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, width] with unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              name, " has dtype ", x.scalar_type(), ", not bfloat16 or float32");
  TORCH_CHECK(x.size(1) % 16 == 0, name, " width ", x.size(1), " is not a multiple of 16");
}

// silu_and_mul's x [rows, 2n]: gate then up, n a multiple of 16.
inline void check_silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 32 == 0, "x width ", x.size(1), " is not twice a multiple of 16");
}

// rms_norm's x [rows, width] (contiguous) and its weight [width].
inline void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous()
              && weight.scalar_type() == x.scalar_type(), "weight must be a contiguous [", x.size(1),
              "] of x's dtype");
}

// rotary_'s x [rows, >= heads * head_dim] and cos, sin [rows, head_dim], head_dim a multiple of 32.
inline void check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                         int64_t head_dim) {
  check_rows(x, "x");
  TORCH_CHECK(head_dim % 32 == 0, "head_dim ", head_dim, " is not a multiple of 32");
  TORCH_CHECK(heads >= 0 && heads * head_dim <= x.size(1), heads, " heads of ", head_dim,
              " do not fit a row of ", x.size(1));
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == head_dim && t->is_contiguous()
                && t->scalar_type() == x.scalar_type(), "cos and sin must be contiguous [", x.size(0), ", ",
                head_dim, "] of x's dtype");
}

// Runs body(Scalar{}) with x's dtype (bf16 or fp32, checked before) as Scalar.
template <typename Body>
void for_row_dtype(const at::Tensor& x, Body&& body) {
  if (x.scalar_type() == at::kBFloat16) body(at::BFloat16{});
  else body(float{});
}

// The element-wise kernels' rows in parallel tasks of 16 (small batches run inline).
template <typename F>
void over_rows(int64_t rows, const F& body) {
  at::parallel_for(0, rows, 16, body);
}

// The element-wise kernels' entry points, for either instruction set's row loops (generic
// lambdas over the row's scalar type):
//   silu_rows(x, x_stride, out, width, begin, end)
//   norm_row(x_row, weight, out_row, width, eps)
//   rotary_rows(x, stride, cos, sin, heads, head_dim, begin, end)
template <typename SiluRows>
at::Tensor silu_and_mul_with(const at::Tensor& x, SiluRows silu_rows) {
  check_silu_and_mul(x);
  const int64_t width = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  for_row_dtype(x, [&](auto scalar) {
    using T = decltype(scalar);
    over_rows(x.size(0), [&](int64_t b, int64_t e) {
      silu_rows(x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), width, b, e); });
  });
  return out;
}

template <typename NormRow>
at::Tensor rms_norm_with(const at::Tensor& x, const at::Tensor& weight, double eps, NormRow norm_row) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t width = x.size(1);
  for_row_dtype(x, [&](auto scalar) {
    using T = decltype(scalar);
    const T *in = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* o = out.data_ptr<T>();
    over_rows(x.size(0), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(in + r * width, w, o + r * width, width, static_cast<float>(eps)); });
  });
  return out;
}

template <typename RotaryRows>
void rotary_with(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim,
                 RotaryRows rotary_rows) {
  check_rotary(x, cos, sin, heads, head_dim);
  for_row_dtype(x, [&](auto scalar) {
    using T = decltype(scalar);
    over_rows(x.size(0), [&](int64_t b, int64_t e) {
      rotary_rows(x.data_ptr<T>(), x.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(), heads, head_dim, b, e); });
  });
}

}  // namespace baton_kernels
