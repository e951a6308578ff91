// The Python module of baton's CPU kernels, one per instruction set (see cpu.py, which builds
// and loads it): every build holds the attention and element-wise kernels, and those its
// Build adds (BATON_WITH_<KERNEL>); ``lanes`` is its registers' fp32 lanes (8 or 16).
//
// Every kernel lets go of the GIL while it runs, as torch's own ops do: a decode pod's
// event loop (streaming tokens to the gateway) then runs beside the engine's forward
// instead of waiting for each kernel to end.
#include "kernels.h"
#include "vec.h"

namespace {
using released = pybind11::call_guard<pybind11::gil_scoped_release>;
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.attr("lanes") = baton_vec::kLanes;
  module.def("causal_attention", &causal_attention, released(),
             "Bottom-right causal attention of q [T, H, D] over k, v [S, Hkv, D]");
  module.def("paged_decode_attention", &paged_decode_attention, released(),
             "One token per sequence, q [B, H, D], over its blocks of the paged caches");
  module.def("silu_and_mul", &silu_and_mul, released(), "silu(x[:, :n]) * x[:, n:] for x [rows, 2n]");
  module.def("rms_norm", &rms_norm, released(), "Llama's RMSNorm of x [rows, width]");
  module.def("rotary_", &rotary_, released(),
             "Rotary embedding in place on the first `heads` heads of each row");
#ifdef BATON_WITH_ATTENTION_SCORES
  module.def("attention_scores", &attention_scores, released(),
             "Weighted, head-averaged attention of recent queries q [R, H, D] to keys k [S, Hkv, D]");
#endif
#ifdef BATON_WITH_FEW_ROWS_LINEAR
  module.def("few_rows_linear", &few_rows_linear, released(),
             "x [R, in] @ weight [out, in].T (+ bias), for a few rows");
#endif
}
