// The extension's Python functions (see __init__.py). Each runs without the GIL: a block
// over a long prompt takes seconds, which the server's event loop (tokenising, answering
// 400s) must not wait for.
#include "amx.h"
#include "block.h"
#include "linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto free = py::call_guard<py::gil_scoped_release>();
  m.def("pack_int8", &pack_int8, "an int8 [N, K] weight in int8_linear's layout", free);
  m.def("int8_linear", &int8_linear, "y = x W^T + b with packed int8 W and per-row uint8 x", free);
  m.def("int8_block", int8_block, "one int8 decoder block over the layer's KV cache", free);
  m.def("pack_int4", &pack_int4, "int4 codes and group scales in int4_linear's layout", free);
  m.def("int4_linear", &int4_linear, "y = x W^T + b with packed int4 W and per-row uint8 x", free);
  m.def("int4_block", int4_block, "one int4 decoder block over the layer's KV cache", free);
  m.def("int_simd", &int_simd, "the instructions the int8 and int4 products use", free);
  m.def("pack_bf16", &pack_bf16, "a bfloat16 [N, K] weight in bf16_linear's layout", free);
  m.def("bf16_linear", &bf16_linear, "y = x W^T + b in bfloat16 on AMX tiles", free);
  m.def("bf16_block", bf16_block, "one bfloat16 decoder block over the layer's KV cache", free);
  m.def("has_bf16", &has_bf16, "whether bf16_linear runs here (AMX or AVX512-BF16)", free);
  py::class_<DecoderStack>(m, "DecoderStack", "a model's decoder blocks of one kind in one call")
      .def(py::init<const std::string&, std::vector<std::vector<torch::Tensor>>, double, int64_t,
                    int64_t>())
      .def("__call__", &DecoderStack::forward, free);
  m.def("has_amx", &has_amx, "whether AMX tiles were compiled in and granted", free);
}
