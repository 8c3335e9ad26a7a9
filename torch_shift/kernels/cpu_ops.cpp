// The CPU implementation of the operator torch_shift::packed_linear (defined, with its Python implementation, in
// torch_shift/models/linear.py), registered with PyTorch's dispatcher: a compiled forward's call, or an eager
// model's, reaches the GEMV kernel (cpu_linear.cpp) or oneDNN's packed matmul without running Python.
//
// Why: a decode step of the 106M model streams 2-11 MB of weights between two linear layers, which flushes the
// core's L2, so the code between the kernels runs cold; the operator's Python implementation and its ctypes call cost
// 120-180 us cold against 4-7 us warm (docs/performance.md, issue 20). Built as its own library (it needs torch's
// full headers): where it does not build, the Python implementation serves.
//
// A packed weight is known by the handle the Python side gives it: register_packed(weight, handle, ...) when it
// is packed, unregister_packed(handle) when it is freed.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

extern "C" int ts_packed_gemv(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight,
                              int64_t N, int64_t K, const void* bias, void* out, int64_t out_row_stride);

namespace {

struct Packed {
  at::Tensor weight;         // oneDNN's blocked layout (an opaque mkldnn tensor)
  const void* gemv_weight;   // its data, which the GEMV kernel reads in place
  int dtype_code;            // the GEMV kernel's: 0 float32, 1 bfloat16
  int64_t gemv_max_rows;     // matmuls of up to this many rows run the GEMV (linear.py's GEMV_MAX_ROWS; 0: none)
  at::ScalarType dtype;
  int64_t out_features, in_features;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Packed>& registry() {
  static std::unordered_map<int64_t, Packed> packed;
  return packed;
}

// weight_address: the opaque tensor's data (torch.ops.mkldnn.data_ptr); dtype_code 0 float32, 1 bfloat16
void register_packed(const at::Tensor& weight, int64_t handle, int64_t weight_address, int64_t gemv_max_rows,
                     int64_t out_features, int64_t in_features, int64_t dtype_code) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[handle] = Packed{weight, reinterpret_cast<const void*>(weight_address), static_cast<int>(dtype_code),
                              gemv_max_rows, dtype_code == 1 ? at::kBFloat16 : at::kFloat, out_features,
                              in_features};
}

void unregister_packed(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(handle);
}

// mkldnn::_linear_pointwise(x, weight, bias, "none", [], None), called boxed: its C++ signature's string type has
// changed between torch versions, its schema has not (and a matmul of more than 16 rows dwarfs the boxing)
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// linear.py's PackedWeight.run, in C++
at::Tensor packed_linear(const at::Tensor& x, int64_t handle, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  const Packed* packed;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(handle);
    TORCH_CHECK(it != registry().end(), "torch_shift::packed_linear: no packed weight ", handle);
    packed = &it->second;  // entries are erased only when their PackedWeight is freed, never while it runs
  }
  TORCH_CHECK(out_features == packed->out_features, "packed_linear: weight ", handle, " has ",
              packed->out_features, " outputs, not ", out_features);
  at::Tensor input = x.contiguous();
  TORCH_CHECK(input.size(-1) == packed->in_features, "packed_linear: input of ", input.size(-1),
              " features for a weight of ", packed->in_features);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out_features;
  const int64_t rows = input.numel() / packed->in_features;
  if (rows == 0) return at::empty(sizes, input.options());  // oneDNN refuses an empty matmul
  const bool bias_matches = !bias.has_value() || bias->scalar_type() == packed->dtype;
  if (rows <= packed->gemv_max_rows && input.scalar_type() == packed->dtype && bias_matches) {
    at::Tensor out = at::empty(sizes, input.options());
    at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
    int status = ts_packed_gemv(packed->dtype_code, input.data_ptr(), packed->in_features, rows,
                                packed->gemv_weight, out_features, packed->in_features,
                                b.defined() ? b.data_ptr() : nullptr, out.data_ptr(), out_features);
    TORCH_CHECK(status == 0, "packed_linear: the GEMV kernel declined weight ", handle);
    return out;
  }
  return onednn_linear(input, packed->weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_shift_cpu, m) {
  m.def("register_packed(Tensor weight, int handle, int weight_address, int gemv_max_rows, int out_features, "
        "int in_features, int dtype_code) -> ()",
        &register_packed);
  m.def("unregister_packed(int handle) -> ()", &unregister_packed);
}

TORCH_LIBRARY_IMPL(torch_shift, CPU, m) { m.impl("packed_linear", &packed_linear); }
