// The Python module of baton's CPU kernels (see cpu.py, which builds and loads it).
#include "cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("causal_attention", &causal_attention,
             "Bottom-right causal attention of q [T, H, D] over k, v [S, Hkv, D]");
  module.def("paged_decode_attention", &paged_decode_attention,
             "One token per sequence, q [B, H, D], over its blocks of the paged caches");
  module.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:] for x [rows, 2n]");
  module.def("rms_norm", &rms_norm, "Llama's RMSNorm of x [rows, width]");
  module.def("rotary_", &rotary_, "Rotary embedding in place on the first `heads` heads of each row");
}
