// The kernels' entry points, as bindings.cpp exports them (cpu.py's Build lists which
// sources and kernels each instruction set's module holds, and defines BATON_WITH_<KERNEL>
// for those not in every build).
#pragma once

#include <torch/extension.h>

// every build: attention (causal_attention_*.cpp, decode_attention_*.cpp) and a Llama
// layer's element-wise steps (elementwise.cpp)
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);

// PyramidInfer's scores (attention_scores.cpp: the AVX-512 builds')
at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& query_positions,
                            const at::Tensor& weights, const at::Tensor& k,
                            const at::Tensor& key_positions, int64_t sliding_window);

// a linear layer over a few rows (few_rows_linear.cpp: the builds where oneDNN's and MKL's
// kernels read the weights slowly)
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
