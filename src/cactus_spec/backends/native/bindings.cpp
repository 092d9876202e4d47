// The extension's Python functions (see __init__.py).
#include "int8_linear.h"

torch::Tensor int8_block(const torch::Tensor& x, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& keys,
                         const torch::Tensor& values, const std::vector<int64_t>& rows,
                         const std::vector<int64_t>& starts,
                         const std::vector<torch::Tensor>& params, double eps, int64_t heads,
                         int64_t kv_heads);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_int8", &pack_int8, "an int8 [N, K] weight in int8_linear's layout");
  m.def("int8_linear", &int8_linear, "y = x W^T + b with packed int8 W and per-row uint8 x");
  m.def("int8_block", &int8_block, "one int8 decoder block over the layer's KV cache");
  m.def("has_vnni", &has_vnni, "whether the AVX512-VNNI path was compiled");
}
