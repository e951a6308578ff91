// The Python module of baton's CPU kernels for AVX2 CPUs (see cpu.py, which builds and loads
// it): the attention kernels; the element-wise steps and PyramidInfer's scores run on torch's
// kernels there.
//
// The kernels let go of the GIL while it runs, as torch's own ops do.
#include <torch/extension.h>

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& lengths);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("causal_attention", &causal_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
             "Bottom-right causal attention of q [T, H, D] over k, v [S, Hkv, D]");
  module.def("paged_decode_attention", &paged_decode_attention,
             pybind11::call_guard<pybind11::gil_scoped_release>(),
             "One token per sequence, q [B, H, D], over its blocks of the paged caches");
}
