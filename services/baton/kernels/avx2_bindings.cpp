// The Python module of baton's CPU kernels for AVX2 CPUs (see cpu.py, which builds and loads
// it): the attention kernels, a Llama layer's element-wise steps and the few-rows linear
// layer; PyramidInfer's scores run on torch's kernels there.
//
// Every kernel lets go of the GIL while it runs, as torch's own ops do.
#include <torch/extension.h>

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

namespace {
using released = pybind11::call_guard<pybind11::gil_scoped_release>;
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("causal_attention", &causal_attention, released(),
             "Bottom-right causal attention of q [T, H, D] over k, v [S, Hkv, D]");
  module.def("paged_decode_attention", &paged_decode_attention, released(),
             "One token per sequence, q [B, H, D], over its blocks of the paged caches");
  module.def("silu_and_mul", &silu_and_mul, released(), "silu(x[:, :n]) * x[:, n:] for x [rows, 2n]");
  module.def("rms_norm", &rms_norm, released(), "Llama's RMSNorm of x [rows, width]");
  module.def("rotary_", &rotary_, released(),
             "Rotary embedding in place on the first `heads` heads of each row");
  module.def("few_rows_linear", &few_rows_linear, released(),
             "x [R, in] @ weight [out, in].T (+ bias), for a few rows");
}
