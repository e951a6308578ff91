// A linear layer over a few rows (a decode step's batch), in the AVX2 and avx512 builds:
// y [R, out] = x [R, in] @ weight [out, in].T (+ bias).
//
// Why: with a handful of rows the product is a pass over the weight, and the pass is the
// cost. oneDNN's packed kernels and MKL's small-M ones read the shipped model's weights at
// ~10 GB/s from the L3 cache on the development machines (AMD EPYC, AVX2 only), a batch-1
// decode step's 17 projections taking ~1.6 ms; this kernel reads each weight row once,
// where it lies, for every row of x at once, and takes ~0.45 ms (figures in
// docs/runtime.md, "On CPUs with AVX2 only").
//
// How: the outputs in groups of one register's lanes (8 with AVX2, 16 with AVX-512), split
// between torch's threads. Within a group, the rows of x in tiles of 4, 2 or 1, each tile with
// one accumulator per lane (with 8 lanes: 2 outputs x 4 rows, 4 x 2 or 8 x 1) that hold
// lane-wise partial dot products, summed across lanes for all of them at once at the end; the group's weight rows stay in L1 from one tile to the next. fp32 throughout
// (bf16 widened on load), so the dot products equal F.linear's to fp32 rounding (another
// summation order).

#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

using namespace baton_vec;

constexpr int64_t kGroup = kLanes;  // outputs of one group: one register of results
constexpr int64_t kGroupsPerTask = 64 / kGroup;  // at least 64 outputs a parallel task

template <typename Scalar>
struct FewRowsLinear {
  const Scalar* x;
  const Scalar* weight;
  const Scalar* bias;  // or nullptr
  Scalar* y;
  int64_t rows, in, out, x_row;

  // kRows rows from r, kOutputs outputs from o (kRows * kOutputs == kLanes).
  template <int kRows>
  void tile(int64_t r, int64_t o) const {
    constexpr int kOutputs = kLanes / kRows;
    Vec acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = zero();
    const Scalar* w = weight + o * in;
    for (int64_t i = 0; i < in; i += kLanes) {
      Vec xs[kRows];
      for (int k = 0; k < kRows; ++k) xs[k] = load_as_float(x + (r + k) * x_row + i);
      for (int j = 0; j < kOutputs; ++j) {
        const Vec wv = load_as_float(w + j * in + i);
        for (int k = 0; k < kRows; ++k) acc[k * kOutputs + j] = fmadd(xs[k], wv, acc[k * kOutputs + j]);
      }
    }
    // lane k * kOutputs + j: row r + k, output o + j
    float sums[kLanes];
    store(sums, sums_of_lanes(acc));
    for (int k = 0; k < kRows; ++k)
      for (int j = 0; j < kOutputs; ++j) {
        const float b = bias ? static_cast<float>(bias[o + j]) : 0.0f;
        y[(r + k) * out + o + j] = static_cast<Scalar>(sums[k * kOutputs + j] + b);
      }
  }

  // One group of kGroup outputs from o, for every row.
  void group(int64_t o) const {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      for (int64_t j = 0; j < kGroup; j += kLanes / 4) tile<4>(r, o + j);
    for (; r + 2 <= rows; r += 2)
      for (int64_t j = 0; j < kGroup; j += kLanes / 2) tile<2>(r, o + j);
    for (; r < rows; ++r) tile<1>(r, o);
  }

  // The outputs past the last whole group, one dot product at a time.
  void remainder(int64_t from) const {
    for (int64_t o = from; o < out; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        Vec acc = zero();
        for (int64_t i = 0; i < in; i += kLanes)
          acc = fmadd(load_as_float(x + r * x_row + i), load_as_float(weight + o * in + i), acc);
        const float b = bias ? static_cast<float>(bias[o]) : 0.0f;
        y[r * out + o] = static_cast<Scalar>(reduce_add(acc) + b);
      }
  }

  void run() const {
    const int64_t groups = out / kGroup;
    at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) group(g * kGroup);
    });
    remainder(groups * kGroup);
  }
};

}  // namespace

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in] with unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x has dtype ", x.scalar_type(), ", not bfloat16 or float32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1)
              && weight.scalar_type() == x.scalar_type(), "weight must be a contiguous [out, ", x.size(1),
              "] of x's dtype");
  TORCH_CHECK(x.size(1) % kLanes == 0, "in features ", x.size(1), " is not a multiple of ", kLanes);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous()
                && bias->scalar_type() == x.scalar_type(), "bias must be a contiguous [", weight.size(0),
                "] of x's dtype");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  auto run = [&](auto scalar) {
    using Scalar = decltype(scalar);
    FewRowsLinear<Scalar> job{x.data_ptr<Scalar>(), weight.data_ptr<Scalar>(),
                              has_bias ? bias->data_ptr<Scalar>() : nullptr, y.data_ptr<Scalar>(),
                              x.size(0), x.size(1), weight.size(0), x.stride(0)};
    job.run();
  };
  if (x.scalar_type() == at::kBFloat16) run(at::BFloat16{});
  else run(float{});
  return y;
}
