// The CPU implementations of the operators torch_shift::packed_linear (defined, with its Python implementation, in
// torch_shift/models/linear.py) and torch_shift::attention (torch_shift/compilation.py), registered with PyTorch's
// dispatcher: a compiled forward's call, or an eager model's, reaches the GEMV kernel (cpu_linear.cpp), oneDNN's
// packed matmul or the paged attention kernel (cpu_attention.cpp) without running Python.
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
#include <c10/core/CPUAllocator.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <climits>
#include <sched.h>
#ifdef __linux__
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

extern "C" int ts_packed_gemv(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight,
                              int64_t N, int64_t K, const void* bias, void* out, int64_t out_row_stride);
extern "C" int ts_blocked_linear(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight,
                                 int64_t N, int64_t K, const void* bias, void* out, int64_t out_row_stride,
                                 int64_t gemv_rows);
extern "C" int ts_paged_attention(int dtype, void* out, int64_t out_row_stride, int64_t out_head_stride, const void* q,
                                  int64_t q_row_stride, int64_t q_head_stride, const void* k_cache, const void* v_cache,
                                  const int64_t* k_layout, const int64_t* v_layout, int64_t num_runs,
                                  const int32_t* query_start, const int32_t* query_len, const int32_t* num_computed,
                                  const int32_t* block_table, int64_t block_table_stride,
                                  const int32_t* block_table_row, int64_t block_size, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t sliding_window, float scale,
                                  const float* sinks);
extern "C" int ts_write_kv(int dtype, void* k_cache, void* v_cache, const int64_t* k_layout, const int64_t* v_layout,
                           const void* k, int64_t k_row_stride, int64_t k_head_stride, const void* v,
                           int64_t v_row_stride, int64_t v_head_stride, const int64_t* slot_mapping,
                           int64_t num_tokens, int64_t block_size, int64_t num_kv_heads, int64_t head_dim);

extern "C" int ts_rms_norm(int dtype, const void* x, int64_t outer, int64_t inner, int64_t outer_stride,
                           int64_t inner_stride, int64_t dim, const void* weight, float eps, int64_t lanes, void* out);
extern "C" int ts_add_rms_norm(int dtype, const void* x, const void* residual, int64_t rows, int64_t dim,
                               const void* weight, float eps, int64_t lanes, void* sum, void* out);
extern "C" int ts_rotary(int dtype, const void* x, int64_t tokens, int64_t heads, int64_t token_stride,
                         int64_t head_stride, int64_t dim, const int64_t* positions, const float* cos_sin,
                         int64_t table_positions, void* out);
extern "C" int ts_decoder_silu_mul(int dtype, int lanes, const void* gate_up, int64_t tokens, int64_t intermediate,
                                   void* out);

namespace {

struct Packed {
  at::Tensor weight;         // oneDNN's blocked layout (an opaque mkldnn tensor), or torch_shift's 16-feature blocks
  const void* gemv_weight;   // its data, which the GEMV kernel reads in place
  int dtype_code;            // the GEMV kernel's: 0 float32, 1 bfloat16, 4 bfloat16 packed for AMX; in 16-feature
                             // blocks 2 bfloat16, 3 float32
  int64_t gemv_max_rows;     // matmuls of up to this many rows run the GEMV (PackedWeight.gemv_max_rows; 0: none)
  at::ScalarType dtype;
  int64_t out_features, in_features;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Packed>& registry() {
  static std::unordered_map<int64_t, Packed> packed;
  return packed;
}

// weight_address: the opaque tensor's data (torch.ops.mkldnn.data_ptr); dtype_code as Packed's
void register_packed(const at::Tensor& weight, int64_t handle, int64_t weight_address, int64_t gemv_max_rows,
                     int64_t out_features, int64_t in_features, int64_t dtype_code) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[handle] = Packed{weight, reinterpret_cast<const void*>(weight_address), static_cast<int>(dtype_code),
                              gemv_max_rows, dtype_code == 0 || dtype_code == 3 ? at::kFloat : at::kBFloat16,
                              out_features,
                              in_features};
}

void unregister_packed(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(handle);
}

// `op` called boxed with `args`: its result
at::Tensor call_boxed(const c10::OperatorHandle& op, std::initializer_list<c10::IValue> args) {
  torch::jit::Stack stack(args);
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// mkldnn::_linear_pointwise(x, weight, bias, "none", [], None), called boxed: its C++ signature's string type has
// changed between torch versions, its schema has not (and a matmul of more rows than the GEMV takes dwarfs the boxing)
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return call_boxed(op, {x, weight, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                         c10::List<std::optional<at::Scalar>>(), c10::IValue()});
}

// packed weight `handle` (`op` names the caller in the error where there is none)
const Packed& find_packed(int64_t handle, const char* op) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(handle);
  TORCH_CHECK(it != registry().end(), op, ": no packed weight ", handle);
  return it->second;  // entries are erased only when their PackedWeight is freed, never while it runs
}

// x through packed weight `handle`, found (find_packed)
at::Tensor run_packed(const Packed* packed, int64_t handle, const at::Tensor& x,
                      const std::optional<at::Tensor>& bias) {
  const int64_t out_features = packed->out_features;
  at::Tensor input = x.contiguous();
  TORCH_CHECK(input.size(-1) == packed->in_features, "packed_linear: input of ", input.size(-1),
              " features for a weight of ", packed->in_features);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = out_features;
  const int64_t rows = input.numel() / packed->in_features;
  if (rows == 0) return at::empty(sizes, input.options());  // oneDNN refuses an empty matmul
  const bool bias_matches = !bias.has_value() || bias->scalar_type() == packed->dtype;
  if (packed->dtype_code == 2 || packed->dtype_code == 3) {  // every matmul through the blocked kernel (linear.py's PackedWeight.run)
    if (input.scalar_type() != packed->dtype || !bias_matches) {
      at::Tensor dense = packed->weight.transpose(1, 2).reshape({-1, packed->in_features}).narrow(0, 0, out_features);
      return at::linear(input, dense.to(input.scalar_type()), bias);
    }
    at::Tensor out = at::empty(sizes, input.options());
    at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
    int status = ts_blocked_linear(packed->dtype_code == 3 ? 0 : 1, input.data_ptr(), packed->in_features, rows,
                                   packed->gemv_weight, out_features, packed->in_features,
                                   b.defined() ? b.data_ptr() : nullptr, out.data_ptr(), out_features,
                                   packed->gemv_max_rows);
    TORCH_CHECK(status == 0, "packed_linear: the blocked kernel declined weight ", handle);
    return out;
  }
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

// linear.py's PackedWeight.run, in C++
at::Tensor packed_linear(const at::Tensor& x, int64_t handle, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  const Packed& packed = find_packed(handle, "torch_shift::packed_linear");
  TORCH_CHECK(out_features == packed.out_features, "packed_linear: weight ", handle, " has ", packed.out_features,
              " outputs, not ", out_features);
  return run_packed(&packed, handle, x, bias);
}

// The step's paged attention (torch_shift/attention/cpu.py's CpuPagedAttention, which keeps these arrays alive while
// it is installed), or none: then a call runs the step's attention in Python (torch_shift::attention_python), as for
// the Ulysses all-to-alls around it, SDPA, or a warm-up's. One step at a time: a process's forwards run on one thread.
struct PagedStep {
  int dtype_code;  // cpu_attention.cpp's: 0 float32, 1 bfloat16, 2 float16
  at::ScalarType dtype;
  char* k_base;
  char* v_base;
  int64_t k_layer_bytes, v_layer_bytes;
  const int64_t* k_layout;
  const int64_t* v_layout;
  int64_t num_runs;
  const int32_t* query_start;
  const int32_t* query_len;
  const int32_t* num_computed;
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* block_table_row;
  int64_t block_size, num_kv_heads;
  const int64_t* slot_mapping;
  int64_t sliding_window;  // the step's (0: none); a layer's own window, where the model passes one, wins
};
bool step_installed = false;
PagedStep step;

at::Tensor python_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                            const std::optional<at::Tensor>& sinks, std::optional<int64_t> sliding_window) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torch_shift::attention_python", "");
  return call_boxed(op, {q, k, v, layer_idx, sinks.has_value() ? c10::IValue(*sinks) : c10::IValue(),
                         sliding_window.has_value() ? c10::IValue(*sliding_window) : c10::IValue()});
}

// A step's KV write and attention for one layer: q [tokens, heads, head_dim] into out (a token's heads one after
// another, `out_row_stride` elements apart; -1: contiguous, of q's shape); `sinks` one float per head or null;
// `window` -1 for the step's. 0, or cpu_attention.cpp's error.
int attend(const PagedStep& step, int64_t layer_idx, const void* q, int64_t q_row_stride, int64_t q_head_stride,
           const void* k, int64_t k_row_stride, int64_t k_head_stride, const void* v, int64_t v_row_stride,
           int64_t v_head_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim, const float* sinks,
           int64_t window, void* out, int64_t out_row_stride = -1) {
  char* k_layer = step.k_base + layer_idx * step.k_layer_bytes;
  char* v_layer = step.v_base + layer_idx * step.v_layer_bytes;
  int rc = ts_write_kv(step.dtype_code, k_layer, v_layer, step.k_layout, step.v_layout, k, k_row_stride, k_head_stride,
                       v, v_row_stride, v_head_stride, step.slot_mapping, num_tokens, step.block_size,
                       step.num_kv_heads, head_dim);
  if (rc != 0) return rc;
  return ts_paged_attention(step.dtype_code, out, out_row_stride >= 0 ? out_row_stride : num_heads * head_dim,
                            head_dim, q, q_row_stride, q_head_stride,
                            k_layer, v_layer, step.k_layout, step.v_layout, step.num_runs, step.query_start,
                            step.query_len, step.num_computed, step.block_table, step.block_table_stride,
                            step.block_table_row, step.block_size, num_heads, step.num_kv_heads, head_dim,
                            window >= 0 ? window : step.sliding_window,
                            static_cast<float>(1.0 / std::sqrt(double(head_dim))), sinks);
}

// A copy of the installed step that owns its arrays: the C++ decoder's step that runs on a thread of its own while
// the engine installs the next one (cpu_decoder.cpp, asynchronous scheduling)
struct PagedStepCopy {
  PagedStep step;
  std::vector<int32_t> ints;  // query_start | query_len | num_computed | block-table rows | those rows of the table
  std::vector<int64_t> slots;
  int32_t num_computed = 0;  // a one-run step's cached tokens as filled (ts_paged_step_copy_narrow moves them)
};

bool ulysses_installed = false;  // the step's attention is Ulysses' around the paged step (ulysses_attention)
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                             const std::optional<at::Tensor>& sinks, std::optional<int64_t> sliding_window);

// CpuPagedAttention.__call__, in C++
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                     const std::optional<at::Tensor>& sinks, std::optional<int64_t> sliding_window) {
  if (!step_installed) return python_attention(q, k, v, layer_idx, sinks, sliding_window);
  if (ulysses_installed) return ulysses_attention(q, k, v, layer_idx, sinks, sliding_window);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.scalar_type() == step.dtype &&
                  k.scalar_type() == step.dtype && v.scalar_type() == step.dtype,
              "torch_shift::attention: q, k and v of the cache's dtype, each head's dims contiguous");
  at::Tensor sinks_f32;  // kept alive until the kernel returns
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, "torch_shift::attention: one sink per head");
    sinks_f32 = sinks->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, q.options());
  const int rc = attend(step, layer_idx, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                                  k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), num_tokens, num_heads, head_dim,
                                  sinks_f32.defined() ? sinks_f32.data_ptr<float>() : nullptr,
                                  sliding_window.has_value() ? *sliding_window : -1, out.data_ptr());
  TORCH_CHECK(rc == 0, "torch_shift::attention: the KV write or attention kernel failed (", rc, ")");
  return out;
}

// The elementwise operators of a compiled CPU forward (torch_shift/models/fused.py: cpu_rms_norm, cpu_add_rms_norm,
// cpu_rotary, cpu_silu_mul), in C++ where their kernels apply, else their Python implementations (registered as
// <name>_python).
// Python, cold after each weight streamed through the caches, cost 58-100 us a call at a TP-2 rank's decode step of
// the 106M model: 2.4 ms of a 20 ms step for its 33 calls (docs/performance.md, issue 20).
int sum_lanes = 0;  // fused.py's _sum_lanes(): the vector width of PyTorch's sum on this machine (0: unknown)
std::mutex silu_mutex;
std::unordered_map<int64_t, int>& silu_lanes() {  // (dtype code, intermediate) -> fused.py's _silu_lanes (0: none)
  static std::unordered_map<int64_t, int> lanes;
  return lanes;
}
int64_t silu_key(int dtype_code, int64_t intermediate) { return intermediate * 4 + dtype_code; }

int elementwise_code(at::ScalarType dtype) {
  return dtype == at::kFloat ? 0 : dtype == at::kBFloat16 ? 1 : -1;
}

c10::OperatorHandle python_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int code = elementwise_code(x.scalar_type());
  if (code < 0 || sum_lanes == 0 || (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) ||
      (x.dim() != 2 && x.dim() != 3) || x.stride(-1) != 1 || weight.scalar_type() != x.scalar_type() ||
      !weight.is_contiguous() || weight.dim() != 1 || weight.size(0) != x.size(-1) || x.size(-1) >= 32768 ||
      !weight.device().is_cpu()) {
    static const c10::OperatorHandle op = python_op("torch_shift::cpu_rms_norm_python");
    return call_boxed(op, {x, weight, eps});
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const bool heads = x.dim() == 3;
  const int status = ts_rms_norm(code, x.data_ptr(), x.size(0), heads ? x.size(1) : 1, x.stride(0),
                                 heads ? x.stride(1) : 0, x.size(-1), weight.data_ptr(), static_cast<float>(eps),
                                 sum_lanes, out.data_ptr());
  TORCH_CHECK(status == 0, "torch_shift::cpu_rms_norm: the kernel failed (", status, ")");
  return out;
}

// (RMSNorm(x + residual), x + residual): fused.py's add_rms_norm
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  const int code = elementwise_code(x.scalar_type());
  if (code < 0 || sum_lanes == 0 ||
      (at::GradMode::is_enabled() && (x.requires_grad() || residual.requires_grad() || weight.requires_grad())) ||
      x.dim() < 1 || !x.is_contiguous() || !residual.is_contiguous() || residual.sizes() != x.sizes() ||
      residual.scalar_type() != x.scalar_type() || weight.scalar_type() != x.scalar_type() ||
      !weight.is_contiguous() || weight.dim() != 1 || weight.size(0) != x.size(-1) || x.size(-1) >= 32768 ||
      !weight.device().is_cpu() || !residual.device().is_cpu()) {
    static const c10::OperatorHandle op = python_op("torch_shift::cpu_add_rms_norm_python");
    torch::jit::Stack stack{x, residual, weight, eps};
    op.callBoxed(&stack);
    return {stack[0].toTensor(), stack[1].toTensor()};
  }
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t dim = x.size(-1), rows = dim > 0 ? x.numel() / dim : 0;
  const int status = ts_add_rms_norm(code, x.data_ptr(), residual.data_ptr(), rows, dim, weight.data_ptr(),
                                     static_cast<float>(eps), sum_lanes, sum.data_ptr(), out.data_ptr());
  TORCH_CHECK(status == 0, "torch_shift::cpu_add_rms_norm: the kernel failed (", status, ")");
  return {out, sum};
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_sin) {
  const int code = elementwise_code(q.scalar_type());
  if (code < 0 || k.scalar_type() != q.scalar_type() || q.dim() != 3 || k.dim() != 3 || q.stride(-1) != 1 ||
      k.stride(-1) != 1 || q.size(-1) % 2 != 0 || k.size(-1) != q.size(-1) ||
      cos_sin.scalar_type() != at::kFloat || !cos_sin.is_contiguous() || cos_sin.dim() != 3 ||
      cos_sin.size(-1) != q.size(-1) || !cos_sin.device().is_cpu() || positions.dim() != 1 ||
      positions.size(0) != q.size(0) || !positions.device().is_cpu() ||
      (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad()))) {
    static const c10::OperatorHandle op = python_op("torch_shift::cpu_rotary_python");
    torch::jit::Stack stack{positions, q, k, cos_sin};
    op.callBoxed(&stack);
    return {stack[0].toTensor(), stack[1].toTensor()};
  }
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  std::tuple<at::Tensor, at::Tensor> rotated;
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& x = i == 0 ? q : k;
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    const int status = ts_rotary(code, x.data_ptr(), x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2),
                                 pos.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), cos_sin.size(1), out.data_ptr());
    TORCH_CHECK_INDEX(status != -3, "a position is outside the rotary table of ", cos_sin.size(1), " positions");
    TORCH_CHECK(status == 0, "torch_shift::cpu_rotary: the kernel failed (", status, ")");
    (i == 0 ? std::get<0>(rotated) : std::get<1>(rotated)) = out;
  }
  return rotated;
}

// silu(gate) * up of gate_up [..., 2 * intermediate]; into `into` where given (contiguous, of the result's shape)
at::Tensor silu_mul_into(const at::Tensor& gate_up, const at::Tensor* into) {
  const int code = elementwise_code(gate_up.scalar_type());
  const int64_t intermediate = gate_up.dim() >= 2 ? gate_up.size(-1) / 2 : 0;
  int lanes = 0;
  if (code >= 0 && gate_up.dim() >= 2 && !gate_up.requires_grad()) {
    std::lock_guard<std::mutex> lock(silu_mutex);
    auto it = silu_lanes().find(silu_key(code, intermediate));
    lanes = it == silu_lanes().end() ? 0 : it->second;
  }
  if (lanes == 0) {  // the Python implementation, which finds the lanes (ts_note_silu_lanes) or computes without them
    static const c10::OperatorHandle op = python_op("torch_shift::cpu_silu_mul_python");
    at::Tensor result = call_boxed(op, {gate_up});
    return into != nullptr ? into->copy_(result) : result;
  }
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() = intermediate;
  TORCH_CHECK(into == nullptr || (into->is_contiguous() && into->sizes() == at::IntArrayRef(sizes)),
              "torch_shift::cpu_silu_mul: the output must be contiguous, of the result's shape");
  at::Tensor out = into != nullptr ? *into
                                   : at::empty(sizes, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;  // a rank's forward of no rows (Ulysses with fewer tokens than ranks)
  const at::Tensor input = gate_up.contiguous();
  const int status = ts_decoder_silu_mul(code, lanes, input.data_ptr(), input.numel() / input.size(-1), intermediate,
                                         out.data_ptr());
  TORCH_CHECK(status == 0, "torch_shift::cpu_silu_mul: the kernel failed (", status, ")");
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return silu_mul_into(gate_up, nullptr); }

// torch_shift::cpu_gate_up_silu (fused.py's gate_up_silu): the packed gate/up projection and `silu(gate) * up` of
// `chunk_rows` rows at a time, each chunk's projection still in the caches when it is activated
at::Tensor gate_up_silu(const at::Tensor& x, int64_t handle, int64_t out_features, int64_t chunk_rows) {
  const int64_t in_features = x.size(-1);
  const int64_t rows = in_features > 0 ? x.numel() / in_features : 0;
  if (rows <= chunk_rows) return silu_mul(packed_linear(x, handle, out_features, std::nullopt));
  const at::Tensor input = x.contiguous().view({rows, in_features});
  at::Tensor out = at::empty({rows, out_features / 2}, x.options());
  const int64_t count = (rows + chunk_rows - 1) / chunk_rows;  // chunks of equal rows or one more, as fused.py's
  for (int64_t i = 0, start = 0; i < count; ++i) {
    const int64_t n = rows / count + (i < rows % count);
    const at::Tensor part = out.narrow(0, start, n);  // activated straight into the output's rows
    silu_mul_into(packed_linear(input.narrow(0, start, n), handle, out_features, std::nullopt), &part);
    start += n;
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features / 2;
  return out.view(sizes);
}

// torch_shift::sparse_moe (torch_shift/models/moe.py: route, then run_experts) in C++ where each expert's weights are
// packed (their handles given): the same ATen operators in the same order, so the same bits, without the Python that
// took 0.35-0.4 ms of each layer's call in a batch-1 decode step of an 8-layer Mixtral. Experts of stacked, unpacked
// weights run in Python (torch_shift::sparse_moe_python).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& router_logits, int64_t top_k, bool norm_topk_prob,
                                         bool float32_routing_weights, const std::string& routing) {
  if (routing == "topk_softmax") {
    auto [top_logits, expert_ids] = at::topk(router_logits, top_k, -1);
    return {at::softmax(top_logits, -1, top_logits.scalar_type()), expert_ids};
  }
  TORCH_CHECK(routing == "softmax_topk", "torch_shift::sparse_moe: unknown routing ", routing);
  auto [weights, expert_ids] = at::topk(at::softmax(router_logits.to(at::kFloat), -1), top_k, -1);
  if (norm_topk_prob) weights = at::div(weights, at::sum(weights, {-1}, true));
  if (!float32_routing_weights) weights = weights.to(router_logits.scalar_type());
  return {weights, expert_ids};
}

// moe.py's gated: SiLU(gate) * up, or GPT-OSS's clamped SwiGLU
at::Tensor gated(const at::Tensor& gate_up, const std::optional<double>& swiglu_limit, double swiglu_alpha) {
  if (!swiglu_limit.has_value()) return silu_mul(gate_up);
  const int64_t half = gate_up.size(-1) / 2;
  const at::Tensor gate = at::clamp(gate_up.narrow(-1, 0, half), std::nullopt, *swiglu_limit);
  const at::Tensor up = at::clamp(gate_up.narrow(-1, half, half), -*swiglu_limit, *swiglu_limit);
  return at::mul(at::add(up, 1), at::mul(gate, at::sigmoid(at::mul(gate, swiglu_alpha))));
}

// an int[] argument: a compiled graph's C++ wrapper passes it as a list of IValues
std::vector<int64_t> int_list(const c10::IValue& value) {
  if (value.isIntList()) return value.toIntVector();
  std::vector<int64_t> ints;
  for (const c10::IValue& element : value.toListRef())
    ints.push_back(element.isSymInt() ? element.toSymInt().guard_int(__FILE__, __LINE__) : element.toInt());
  return ints;
}

// arguments as the operator's schema: x, router_logits, gate_up_proj, down_proj, top_k, norm_topk_prob,
// float32_routing_weights, gate_up_handles, down_handles, routing, gate_up_bias, down_bias, swiglu_limit,
// swiglu_alpha (boxed: the C++ type of a `str` argument has changed between torch versions)
void sparse_moe(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  constexpr size_t kArgs = 14;
  auto args = torch::jit::last(*stack, kArgs);
  const std::vector<int64_t> gate_up_handles = int_list(args[7]), down_handles = int_list(args[8]);
  if (gate_up_handles.empty()) {
    static const c10::OperatorHandle op = python_op("torch_shift::sparse_moe_python");
    op.callBoxed(stack);
    return;
  }
  const at::Tensor x = args[0].toTensor();
  const int64_t top_k = args[4].toInt();
  const std::optional<at::Tensor> gate_up_bias = args[10].isNone() ? std::nullopt
                                                                   : std::optional<at::Tensor>(args[10].toTensor());
  const std::optional<at::Tensor> down_bias = args[11].isNone() ? std::nullopt
                                                                : std::optional<at::Tensor>(args[11].toTensor());
  const std::optional<double> swiglu_limit = args[12].isNone() ? std::nullopt
                                                               : std::optional<double>(args[12].toDouble());
  const double swiglu_alpha = args[13].toDouble();
  auto [routing_weights, expert_ids] = route(args[1].toTensor(), top_k, args[5].toBool(), args[6].toBool(),
                                             args[9].toStringRef());
  // run_experts: the token-expert pairs grouped by expert, each expert's rows in one matmul per projection, the
  // weighted outputs summed per token in float32 and rounded to the model's dtype once
  const int64_t num_tokens = expert_ids.size(0), num_experts = static_cast<int64_t>(gate_up_handles.size());
  const at::Tensor pair_expert = expert_ids.flatten();
  const at::Tensor order = at::argsort(pair_expert, /*stable=*/true);
  const at::Tensor pair_token = at::div(order, top_k, "floor");
  const at::Tensor pair_weight = routing_weights.flatten().index_select(0, order);
  const at::Tensor counts = at::bincount(pair_expert, {}, num_experts).contiguous();
  const int64_t* count = counts.data_ptr<int64_t>();
  at::Tensor out = at::zeros({num_tokens, x.size(-1)}, x.options().dtype(at::kFloat));
  for (int64_t expert = 0, start = 0; expert < num_experts; start += count[expert], ++expert) {
    if (count[expert] == 0) continue;
    const at::Tensor tokens = pair_token.narrow(0, start, count[expert]);
    const int64_t gate_up_handle = gate_up_handles[expert], down_handle = down_handles[expert];
    at::Tensor gate_up = run_packed(&find_packed(gate_up_handle, "torch_shift::sparse_moe"), gate_up_handle,
                                    x.index_select(0, tokens), std::nullopt);
    if (gate_up_bias.has_value()) gate_up = at::add(gate_up, gate_up_bias->select(0, expert));
    at::Tensor expert_out = run_packed(&find_packed(down_handle, "torch_shift::sparse_moe"), down_handle,
                                       gated(gate_up, swiglu_limit, swiglu_alpha), std::nullopt);
    if (down_bias.has_value()) expert_out = at::add(expert_out, down_bias->select(0, expert));
    out.index_add_(0, tokens, at::mul(expert_out, pair_weight.narrow(0, start, count[expert]).unsqueeze(1))
                                  .to(at::kFloat));
  }
  torch::jit::drop(*stack, kArgs);
  torch::jit::push(*stack, out.to(x.scalar_type()));
}

// torch_shift::shm_all_reduce (torch_shift/parallel/shm.py's ShmCommunicator.all_reduce) in C++ for messages that fit
// a slot: the same protocol, the same words in the segment, the same sum. It spins for its peers for up to
// kSpinNs, then hands the collective it published to Python (shm_all_reduce_resume), which waits with the
// communicator's deadline and liveness checks and reports a peer whose fields differ. Python, cold after each weight
// streamed through the caches, cost about 100 us a call at a TP-2 rank's decode step of the 106M model (16 a step).
struct ShmComm {
  char* segment;
  int64_t rank, world_size, slot_bytes, header_bytes, row_words, first_parity_word, parity_words;
  int64_t* counters;  // [the last step published, collectives so far], shared with the Python communicator
  int64_t float32_signature, bfloat16_signature;  // all_reduce's
  int64_t float32_a2a_signature, bfloat16_a2a_signature;  // all_to_all's
  int64_t float32_gather_signature, bfloat16_gather_signature;  // all_gather's
};
constexpr int64_t kSeqWord = 0, kSleepingWord = 4;  // shm.py's header row
constexpr int64_t kSignatureWord = 0, kNbytesWord = 1, kAuxWord = 2, kSplitsWord = 3;  // and parity block
constexpr int64_t kSpinNs = 1'000'000;
// An idle rank's wait (ShmStep::publish_and_wait): SP-2 batch-1 decode's rank without tokens waits about a layer's
// linears for each layer's q/k/v (1.3 ms of the 106M model in float32). Spinning for 1 ms and then waiting in Python,
// it took that time from the working rank's decode pool worker on its core; asleep here, it does not (float32 steps
// of 10.0-14.0 ms before, 8.0-8.7 after, with the decoder's own changes; docs/performance.md). A compiled forward's
// call holds the GIL while it sleeps, at most kIdleSleepNs; then Python's wait (deadline, liveness) takes over.
constexpr int64_t kIdleSpinNs = 50'000, kIdleSleepNs = 50'000'000, kMaxSleepNs = 10'000'000;
std::mutex shm_mutex;
std::unordered_map<int64_t, ShmComm>& shm_comms() {
  static std::unordered_map<int64_t, ShmComm> comms;
  return comms;
}

int64_t load_word(const int64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

std::optional<ShmComm> find_comm(int64_t communicator) {
  std::lock_guard<std::mutex> lock(shm_mutex);
  auto it = shm_comms().find(communicator);
  if (it == shm_comms().end()) return std::nullopt;
  return it->second;
}

// An idle rank's recent waits that outlasted the spin: the shortest of them is when its peers are next expected to
// publish (a layer's linears on the working rank: the layers are alike). It sleeps until kIdleWakeEarlyNs before that,
// then spins until kIdleSpinLateNs after, then sleeps until woken (the wait across a step's end, longer). Asleep
// until the peer's publish woke it, the working rank's exchange took 0.16 ms a layer for about 0.04 ms of work.
// SP-2 batch-1 decode, alternated: bf16 4.8-5.5 ms a step against 5.6-7.0 asleep until woken, float32 8.0-8.7
// against 8.1-9.4. One forward thread a process: a rank's Ulysses waits are one at a time.
struct IdleWaits {
  int64_t lengths[8] = {};
  int next = 0;
  int64_t expected() const { return *std::min_element(std::begin(lengths), std::end(lengths)); }
  void add(int64_t ns) {
    if (ns <= kIdleSpinNs) return;
    lengths[next] = ns;
    next = (next + 1) % 8;
  }
};
IdleWaits idle_waits;
constexpr int64_t kIdleWakeEarlyNs = 150'000, kIdleSpinLateNs = 300'000;

// One step of the protocol (shm.py): the step's number, and where this rank's slot and a rank's fields are
struct ShmStep {
  const ShmComm& c;
  int64_t step, parity;
  explicit ShmStep(const ShmComm& comm) : c(comm), step(comm.counters[0] + 1), parity(step & 1) {
    c.counters[1] += 1;  // a collective (one step: the message fits a slot)
  }
  char* slot(int64_t rank) const { return c.segment + c.header_bytes + (parity * c.world_size + rank) * c.slot_bytes; }
  int64_t* block(int64_t rank) const {
    return reinterpret_cast<int64_t*>(c.segment) + rank * c.row_words + c.first_parity_word + parity * c.parity_words;
  }
  // The step's fields, then the counter (after the data in this rank's slot); waits up to kSpinNs for every peer to
  // publish the step with the same signature, size and `aux`. False where one did not: the caller hands the rest to
  // Python, which waits with the communicator's deadline and liveness checks and reports a peer whose fields differ.
  // `part_bytes` (>= 0): an all-to-all's split sizes, equal parts of that many bytes to every rank. `idle`: a rank
  // with nothing to do until its peers publish (an SP rank without tokens: ulysses_attention) spins only kIdleSpinNs,
  // then sleeps as shm.py's waits do, up to kIdleSleepNs before Python takes over.
  bool publish_and_wait(int64_t signature, int64_t nbytes, int64_t aux, int64_t part_bytes = -1, bool idle = false) {
    const int64_t* header = reinterpret_cast<const int64_t*>(c.segment);
    if (part_bytes >= 0)
      for (int64_t j = 0; j < c.world_size; ++j) block(c.rank)[kSplitsWord + j] = part_bytes;
    block(c.rank)[kSignatureWord] = signature;
    block(c.rank)[kNbytesWord] = nbytes;
    block(c.rank)[kAuxWord] = aux;
    // sequentially consistent: the counter is visible before the sleeping words are read (shm.py's "Waking")
    int64_t* seq = reinterpret_cast<int64_t*>(c.segment) + c.rank * c.row_words + kSeqWord;
    __atomic_store_n(seq, step, __ATOMIC_SEQ_CST);
    c.counters[0] = step;
#ifdef __linux__  // (the communicator serves x86-64 Linux only)
    for (int64_t p = 0; p < c.world_size; ++p) {
      if (p != c.rank && __atomic_load_n(header + p * c.row_words + kSleepingWord, __ATOMIC_SEQ_CST)) {
        syscall(SYS_futex, seq, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);  // the low 32 bits: x86-64 is little-endian
        break;
      }
    }
#endif
    const auto start = std::chrono::steady_clock::now();
    const int64_t spin = idle ? kIdleSpinNs : kSpinNs, limit = idle ? kIdleSpinNs + kIdleSleepNs : kSpinNs;
    const int64_t expected = idle ? idle_waits.expected() : 0;
    for (int64_t p = 0; p < c.world_size; ++p) {
      if (p == c.rank) continue;
      const int64_t* peer_seq = header + p * c.row_words + kSeqWord;
      while (load_word(peer_seq) < step) {
        const int64_t waited = (std::chrono::steady_clock::now() - start).count();
        if (waited > limit) return false;
        if (waited < spin || (waited >= expected - kIdleWakeEarlyNs && waited < expected + kIdleSpinLateNs))
          sched_yield();  // as the Python wait: more ranks than cores still make progress
        else if (waited < expected - kIdleWakeEarlyNs)
          sleep_on(peer_seq, expected - kIdleWakeEarlyNs - waited);  // woken by the timer, or by the peer
        else
          sleep_on(peer_seq, std::min(kMaxSleepNs, limit - waited));
      }
      if (block(p)[kSignatureWord] != signature || block(p)[kNbytesWord] != nbytes || block(p)[kAuxWord] != aux)
        return false;
    }
    if (idle) idle_waits.add((std::chrono::steady_clock::now() - start).count());
    return true;
  }

  // Sleep until the peer of counter `peer_seq` publishes (its publish wakes this rank), at most `timeout_ns`; at once
  // if it published this step meanwhile (shm.py's _sleep_on: the sleeping word, then the counter read again, which
  // the kernel compares once more)
  void sleep_on(const int64_t* peer_seq, int64_t timeout_ns) const {
#ifdef __linux__
    int64_t* sleeping = reinterpret_cast<int64_t*>(c.segment) + c.rank * c.row_words + kSleepingWord;
    __atomic_store_n(sleeping, 1, __ATOMIC_SEQ_CST);
    const int64_t seen = __atomic_load_n(peer_seq, __ATOMIC_SEQ_CST);
    if (seen < step) {
      const timespec timeout{static_cast<time_t>(timeout_ns / 1'000'000'000),
                             static_cast<long>(timeout_ns % 1'000'000'000)};
      const uint32_t low = static_cast<uint32_t>(seen & 0xFFFFFFFF);
      if (syscall(SYS_futex, peer_seq, FUTEX_WAIT, low, &timeout, nullptr, 0) != 0 && errno != EAGAIN &&
          errno != ETIMEDOUT && errno != EINTR) {
        const timespec nap{0, std::min<long>(1'000'000, static_cast<long>(timeout_ns))};
        nanosleep(&nap, nullptr);  // futexes refused (a sandbox): naps of at most 1 ms, as shm.py's
      }
    }
    __atomic_store_n(sleeping, 0, __ATOMIC_SEQ_CST);
#else
    (void)peer_seq, (void)timeout_ns;
    sched_yield();
#endif
  }
};

at::Tensor shm_all_reduce(const at::Tensor& x, int64_t communicator) {
  const std::optional<ShmComm> found = find_comm(communicator);
  const int64_t nbytes = x.numel() * x.element_size();
  const bool float32 = x.scalar_type() == at::kFloat;
  if (!found || (!float32 && x.scalar_type() != at::kBFloat16) || nbytes > found->slot_bytes || x.requires_grad() ||
      !x.device().is_cpu() || x.layout() != at::kStrided) {
    static const c10::OperatorHandle op = python_op("torch_shift::shm_all_reduce_python");
    return call_boxed(op, {x, communicator});
  }
  ShmStep s(*found);
  const at::Tensor input = x.contiguous();
  std::memcpy(s.slot(s.c.rank), input.data_ptr(), nbytes);
  if (!s.publish_and_wait(float32 ? s.c.float32_signature : s.c.bfloat16_signature, nbytes, 0)) {
    static const c10::OperatorHandle op = python_op("torch_shift::shm_all_reduce_resume");
    return call_boxed(op, {x, communicator, s.step});
  }
  // every rank adds the contributions in group-rank order: bit-identical sums, as the Python implementation's
  auto row = [&](int64_t p) { return at::from_blob(s.slot(p), x.sizes(), x.options()); };
  at::Tensor out = at::add(row(0), row(1));
  for (int64_t p = 2; p < s.c.world_size; ++p) out.add_(row(p));
  return out;
}

// The C++ decoder's all-reduce on a rank of a tensor-parallel layout (cpu_decoder.cpp: the o and down projections'
// partial outputs, `rows` x `cols` in place): shm_all_reduce's protocol and sum, so the same bits as the compiled
// forward's RowParallelLinear. 0, or -300 where the collective failed (a peer died or stalled past the communicator's
// deadline: its Python wait raised), the message in ts_collective_error.
std::string collective_error;

// `collective()` for the decoder's C callers, which nothing may unwind through: 0, or -300 with the exception's message
// (or `what` where it has none) in collective_error
template <typename Collective>
int collective_code(const char* what, Collective collective) {
  try {
    collective();
    return 0;
  } catch (const std::exception& e) {
    collective_error = e.what();
  } catch (...) {
    collective_error = what;
  }
  return -300;
}

}  // namespace

extern "C" int ts_decoder_all_reduce(int64_t communicator, int dtype, void* data, int64_t rows, int64_t cols) {
  return collective_code("the all-reduce failed", [&] {
    const at::Tensor x = at::from_blob(data, {rows, cols}, at::TensorOptions().dtype(dtype == 0 ? at::kFloat
                                                                                                   : at::kBFloat16));
    const at::Tensor out = shm_all_reduce(x, communicator).contiguous();
    std::memcpy(data, out.data_ptr(), x.numel() * x.element_size());
  });
}

// The C++ decoder's gather of a vocabulary-sharded LM head's logits (cpu_decoder.cpp): each rank's `rows` x `cols`
// shard `data` (the decoder's dtype) into out [rows, out_cols], rank p's columns at p x cols, the padding past out_cols
// dropped; the protocol of ShmCommunicator.all_gather (stacked in group-rank order, which is vocabulary order), so a
// peer that gathers through Python meets it. 0, or -300 as ts_decoder_all_reduce.
extern "C" int ts_decoder_all_gather(int64_t communicator, int dtype, const void* data, int64_t rows, int64_t cols,
                                     void* out, int64_t out_cols) {
  return collective_code("the all-gather failed", [&] {
    const at::ScalarType scalar = dtype == 0 ? at::kFloat : at::kBFloat16;
    const int64_t element = c10::elementSize(scalar), nbytes = rows * cols * element;
    const std::optional<ShmComm> found = find_comm(communicator);
    TORCH_CHECK(!found || found->world_size * cols >= out_cols,
                "torch_shift: the ranks' shards of the vocabulary do not cover it");
    const auto part_of = [&](int64_t world, auto part) {  // part(p): rank p's [rows, cols], contiguous
      for (int64_t p = 0; p < world; ++p) {
        const int64_t n = std::min(cols, out_cols - p * cols);
        for (int64_t r = 0; n > 0 && r < rows; ++r)
          std::memcpy(static_cast<char*>(out) + (r * out_cols + p * cols) * element, part(p) + r * cols * element,
                      n * element);
      }
    };
    const at::Tensor x = at::from_blob(const_cast<void*>(data), {rows, cols}, at::TensorOptions().dtype(scalar));
    if (!found || nbytes > found->slot_bytes) {
      static const c10::OperatorHandle op = python_op("torch_shift::shm_all_gather");
      const at::Tensor gathered = call_boxed(op, {x, communicator, found ? found->world_size : 0}).contiguous();
      const char* bytes = static_cast<const char*>(gathered.data_ptr());
      return part_of(gathered.size(0), [&](int64_t p) { return bytes + p * nbytes; });
    }
    ShmStep s(*found);
    std::memcpy(s.slot(s.c.rank), data, nbytes);
    if (!s.publish_and_wait(dtype == 0 ? s.c.float32_gather_signature : s.c.bfloat16_gather_signature, nbytes, 0)) {
      static const c10::OperatorHandle op = python_op("torch_shift::shm_all_gather_resume");
      const at::Tensor gathered = call_boxed(op, {x, communicator, s.step}).contiguous();
      const char* bytes = static_cast<const char*>(gathered.data_ptr());
      return part_of(s.c.world_size, [&](int64_t p) { return bytes + p * nbytes; });
    }
    part_of(s.c.world_size, [&](int64_t p) { return static_cast<const char*>(s.slot(p)); });
  });
}

extern "C" const char* ts_collective_error() { return collective_error.c_str(); }

namespace {

// torch_shift/parallel/ulysses.py's UlyssesAttention in C++ for a compiled forward's step whose messages fit a slot
// (UlyssesAttention.install_native): the two all-to-alls of equal parts through the shared-memory communicator of the
// SP group (the protocol of ShmCommunicator.all_to_all, with its rows written into and read out of the slots in place)
// around the installed paged step's attention. In Python the pair and its packing cost a batch-1 decode step of the
// 106M model in SP-2 about 0.45 ms a layer (docs/performance.md).
struct UlyssesStep {
  int64_t communicator, sp_rank;
  std::vector<int64_t> counts;  // tokens held by each SP rank, in token order
  at::Tensor kv_send_index;  // undefined: identity
  // where this rank holds every token of the step and reads the SP group's shared KV (torch_shift.parallel.shared_kv):
  // the cache of each head chunk's rank (the step's k_base and v_base there); empty: the all-to-alls
  std::vector<char*> chunk_k_bases, chunk_v_bases;
};
UlyssesStep ulysses;

// Ulysses' step where this rank holds all of its tokens and every SP rank's cache is mapped here: each head chunk's
// KV write and attention into that chunk's rank's cache, as that rank would run them after the first all-to-all (the
// same kernel on the same rows: the same bits), and no all-to-all at all
at::Tensor solo_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                          const std::optional<at::Tensor>& sinks, std::optional<int64_t> sliding_window) {
  const int64_t sp = static_cast<int64_t>(ulysses.counts.size());
  const int64_t n = q_in.size(0), num_heads = q_in.size(1), head_dim = q_in.size(2);
  const int64_t hq = num_heads / sp, hkv = k.size(1) / sp;
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  at::Tensor sinks_f32;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, "torch_shift::attention: one sink per head");
    sinks_f32 = sinks->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({n, num_heads, head_dim}, q.options());
  const int64_t element = q.element_size();
  for (int64_t p = 0; p < sp; ++p) {
    PagedStep chunk = step;
    chunk.k_base = ulysses.chunk_k_bases[p];
    chunk.v_base = ulysses.chunk_v_bases[p];
    const char* qb = static_cast<const char*>(q.data_ptr()) + p * hq * q.stride(1) * element;
    const char* kb = static_cast<const char*>(k.data_ptr()) + p * hkv * k.stride(1) * element;
    const char* vb = static_cast<const char*>(v.data_ptr()) + p * hkv * v.stride(1) * element;
    char* ob = static_cast<char*>(out.data_ptr()) + p * hq * head_dim * element;
    const int rc = attend(chunk, layer_idx, qb, q.stride(0), q.stride(1), kb, k.stride(0), k.stride(1), vb,
                          v.stride(0), v.stride(1), n, hq, head_dim,
                          sinks_f32.defined() ? sinks_f32.data_ptr<float>() + p * hq : nullptr,
                          sliding_window.has_value() ? *sliding_window : -1, ob, num_heads * head_dim);
    TORCH_CHECK(rc == 0, "torch_shift::attention: the KV write or attention kernel failed (", rc, ")");
  }
  return out;
}

// The rest of an all-to-all this rank published as step `s` with its message (`rows` x `row_bytes` bytes) in its slot:
// in Python where a peer was late, else in place: `read(p, part)` for each rank p's part for this rank (1 / world)
template <typename Read>
void finish_all_to_all(ShmStep& s, int64_t rows, int64_t row_bytes, at::ScalarType dtype, int64_t signature,
                       bool idle, Read read) {
  const int64_t nbytes = rows * row_bytes, part_bytes = nbytes / s.c.world_size;
  if (s.publish_and_wait(signature, nbytes, 1, part_bytes, idle)) {
    for (int64_t p = 0; p < s.c.world_size; ++p) read(p, s.slot(p) + s.c.rank * part_bytes);
    return;
  }
  const int64_t element = c10::elementSize(dtype);
  at::Tensor message = at::from_blob(s.slot(s.c.rank), {rows, row_bytes / element}, at::TensorOptions().dtype(dtype))
                           .clone();
  static const c10::OperatorHandle op = python_op("torch_shift::shm_all_to_all_resume");
  at::Tensor received = call_boxed(op, {message, ulysses.communicator, s.step}).contiguous();
  const char* bytes = static_cast<const char*>(received.data_ptr());
  for (int64_t p = 0; p < s.c.world_size; ++p) read(p, bytes + p * part_bytes);
}

at::Tensor ulysses_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             int64_t layer_idx, const std::optional<at::Tensor>& sinks,
                             std::optional<int64_t> sliding_window) {
  const int64_t sp = static_cast<int64_t>(ulysses.counts.size()), sp_rank = ulysses.sp_rank;
  const int64_t n_local = q_in.size(0), n_max = ulysses.counts[0], num_heads = q_in.size(1), head_dim = q_in.size(2);
  at::Tensor k = k_in, v = v_in;
  if (ulysses.kv_send_index.defined()) {
    k = k.index_select(1, ulysses.kv_send_index);
    v = v.index_select(1, ulysses.kv_send_index);
  }
  if (!ulysses.chunk_k_bases.empty()) {  // the peers take no part in this step: no fallback to the exchanges
    TORCH_CHECK(n_local == ulysses.counts[sp_rank] && n_local == n_max && q_in.scalar_type() == step.dtype &&
                    k.scalar_type() == step.dtype && v.scalar_type() == step.dtype,
                "torch_shift::attention: a step on one SP rank given another rank's tokens or another dtype");
    return solo_attention(q_in, k.stride(2) == 1 ? k : k.contiguous(), v.stride(2) == 1 ? v : v.contiguous(),
                          layer_idx, sinks, sliding_window);
  }
  const std::optional<ShmComm> found = find_comm(ulysses.communicator);
  const int64_t hq = num_heads / sp, hkv = k.size(1) / sp, element = q_in.element_size();
  const int64_t q_bytes = hq * head_dim * element, kv_bytes = hkv * head_dim * element;
  const int64_t row_bytes = q_bytes + 2 * kv_bytes, out_row_bytes = q_bytes;
  const bool float32 = q_in.scalar_type() == at::kFloat;
  if (!found || found->rank != sp_rank || found->world_size != sp || n_local != ulysses.counts[sp_rank] ||
      sp * n_max * row_bytes > found->slot_bytes || (!float32 && q_in.scalar_type() != at::kBFloat16) ||
      q_in.scalar_type() != step.dtype || k.scalar_type() != step.dtype || v.scalar_type() != step.dtype) {
    return python_attention(q_in, k_in, v_in, layer_idx, sinks, sliding_window);
  }
  const ShmComm& c = *found;
  const int64_t signature = float32 ? c.float32_a2a_signature : c.bfloat16_a2a_signature;
  // each head's dims contiguous, a token's heads one after another: a head chunk of a token is one run of bytes
  const at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == head_dim ? q_in : q_in.contiguous();
  if (!(k.stride(2) == 1 && k.stride(1) == head_dim)) k = k.contiguous();
  if (!(v.stride(2) == 1 && v.stride(1) == head_dim)) v = v.contiguous();
  std::vector<int64_t> first(sp + 1, 0);  // the first token of each SP rank's, and n
  for (int64_t p = 0; p < sp; ++p) first[p + 1] = first[p] + ulysses.counts[p];
  const int64_t n = first[sp];

  // 1. to the rank of each head chunk: message [SP parts (head chunk)][n_max rows][q | k | v of the chunk]
  ShmStep out1(c);
  char* mine = out1.slot(c.rank);
  const char* qb = static_cast<const char*>(q.data_ptr());
  const char* kb = static_cast<const char*>(k.data_ptr());
  const char* vb = static_cast<const char*>(v.data_ptr());
  for (int64_t j = 0; j < sp; ++j) {
    for (int64_t i = 0; i < n_local; ++i) {
      char* row = mine + (j * n_max + i) * row_bytes;  // rows from n_local to n_max: padding that nothing reads
      std::memcpy(row, qb + i * q.stride(0) * element + j * q_bytes, q_bytes);
      std::memcpy(row + q_bytes, kb + i * k.stride(0) * element + j * kv_bytes, kv_bytes);
      std::memcpy(row + q_bytes + kv_bytes, vb + i * v.stride(0) * element + j * kv_bytes, kv_bytes);
    }
  }
  // every rank's tokens of this rank's head chunk, in token order
  at::Tensor gathered = at::empty({n, row_bytes / element}, q.options());
  char* gb = static_cast<char*>(gathered.data_ptr());
  // a rank without tokens waits for the others' q/k/v through their layer's linears: asleep, its core theirs
  const bool idle = n_local == 0;
  finish_all_to_all(out1, sp * n_max, row_bytes, q.scalar_type(), signature, idle, [&](int64_t p, const char* part) {
    std::memcpy(gb + first[p] * row_bytes, part, ulysses.counts[p] * row_bytes);
  });

  // 2. attention of the head chunk over the step's tokens (writing their K/V into this rank's cache)
  at::Tensor sinks_f32;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, "torch_shift::attention: one sink per head");
    sinks_f32 = sinks->narrow(0, sp_rank * hq, hq).to(at::kFloat).contiguous();
  }
  at::Tensor attended = at::empty({n, hq, head_dim}, q.options());
  const int64_t row = row_bytes / element;
  const int rc = attend(step, layer_idx, gb, row, head_dim, gb + q_bytes, row, head_dim, gb + q_bytes + kv_bytes, row,
                        head_dim, n, hq, head_dim, sinks_f32.defined() ? sinks_f32.data_ptr<float>() : nullptr,
                        sliding_window.has_value() ? *sliding_window : -1, attended.data_ptr());
  TORCH_CHECK(rc == 0, "torch_shift::attention: the KV write or attention kernel failed (", rc, ")");

  // 3. back to the ranks that hold the tokens: message [SP parts (SP rank)][n_max rows][the chunk's outputs]
  ShmStep out2(c);
  mine = out2.slot(c.rank);
  const char* ab = static_cast<const char*>(attended.data_ptr());
  for (int64_t p = 0; p < sp; ++p)
    std::memcpy(mine + p * n_max * out_row_bytes, ab + first[p] * out_row_bytes, ulysses.counts[p] * out_row_bytes);
  at::Tensor out = at::empty({n_local, num_heads, head_dim}, q.options());
  char* ob = static_cast<char*>(out.data_ptr());
  finish_all_to_all(out2, sp * n_max, out_row_bytes, q.scalar_type(), signature, idle,
                    [&](int64_t p, const char* part) {
    for (int64_t i = 0; i < n_local; ++i)  // head chunk p of this rank's token i
      std::memcpy(ob + (i * num_heads * head_dim) * element + p * out_row_bytes, part + i * out_row_bytes,
                  out_row_bytes);
  });
  return out;
}

// CPU implementations of torch_shift operators, registered with PyTorch's dispatcher once per `library` (`add`
// registers them on it): 0, or -1 where PyTorch refused them (a C++ exception must not cross into ctypes)
template <typename Add>
int register_once(torch::Library*& library, Add add) {
  if (library != nullptr) return 0;
  try {
    library = new torch::Library(torch::Library::IMPL, "torch_shift", c10::DispatchKey::CPU, __FILE__, __LINE__);
    add(*library);
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Packed weights on huge pages. oneDNN allocates a packed weight through PyTorch's CPU allocator (ATen's
// IDeepRegistration.cpp), at a 64-byte alignment: a weight of a few MB then starts and ends inside 2 MiB pages that
// only 4 KiB pages can back, and a TP-2 rank's weights of the 106M model streamed a third of their bytes so, at 0.6x
// the rate of huge pages on one thread of a Zen 4 EPYC (docs/performance.md, issue 20). While a thread is inside
// ts_huge_page_scope, its allocations of kArenaMin or more are mapped one after another in address space reserved
// for them (HugePageArena) and advised huge pages, so that consecutive weights share the huge page at their boundary
// (collapsed into one as the later is mapped); a freed one's memory goes back to the system. Every other allocation,
// on any thread, is the default allocator's. The allocator stands in for the default one from the first scope on
// until a scope ends with no block of the arena alive, and only where the default one is installed: oneDNN frees its
// buffers through the raw deleter of whichever allocator is installed then, and this one's sends the arena's blocks
// back to it and the rest to the default's. (Another CPU allocator installed over it while blocks live would be
// handed the arena's blocks by oneDNN's frees: PyTorch's mobile allocator, for one.)
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kArenaMin = size_t{64} << 10;  // smaller allocations stay in the caches through a step
constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE, which older headers lack
thread_local int huge_page_depth = 0;
c10::DeleterFnPtr default_raw_deleter = nullptr;  // the default allocator's, once this one stood in for it
std::mutex huge_page_mutex;  // the scopes' count and the allocator's installation

#ifdef __linux__
// Address space reserved once, before the allocator first stands in (PROT_NONE: no memory, nothing charged; 1 TiB,
// else 64 GiB; none where the process's address space is limited, RLIMIT_AS, which the reservation would count
// against), handed out upwards and never reused: a block is made readable and writable at `next` (charged then,
// failing without a hole where memory is refused), and made PROT_NONE again when freed, its memory given back, so
// that every address inside the reservation is the arena's. Where there is none, or it is spent, allocations of 2 MiB
// or more are 2 MiB-aligned blocks of their own (HugePageAllocator::aligned), the others the default allocator's.
struct HugePageArena {
  std::atomic<char*> base{nullptr}, end{nullptr};  // the reservation (end stored last)
  char* next = nullptr;
  size_t page = 4096;
  std::unordered_map<const void*, size_t> blocks;  // the live blocks' sizes
  std::mutex mutex;

  void reserve() {
    const long page_size = sysconf(_SC_PAGESIZE);
    if (page_size > 0) page = static_cast<size_t>(page_size);
    rlimit limit{};
    if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur != RLIM_INFINITY) return;
    for (const size_t bytes : {size_t{1} << 40, size_t{64} << 30}) {
      void* at = mmap(nullptr, bytes + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (at == MAP_FAILED) continue;
      char* first = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(at) + kHugePage - 1) / kHugePage * kHugePage);
      next = first;
      base.store(first, std::memory_order_release);
      end.store(first + bytes, std::memory_order_release);
      return;
    }
  }

  // A block of at least `nbytes` made writable and advised, and its size; null where the arena has no room or the
  // system refused the memory
  char* map(size_t nbytes, size_t* size) {
    *size = (nbytes + page - 1) / page * page;
    char* block;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (next == nullptr || *size > static_cast<size_t>(end.load(std::memory_order_relaxed) - next)) return nullptr;
      block = next;
      if (mprotect(block, *size, PROT_READ | PROT_WRITE) != 0) return nullptr;
      next += *size;
      blocks[block] = *size;
    }
    // refused where the kernel has no transparent huge pages (MADV_COLLAPSE: before Linux 6.1): no error. The huge
    // page at the block's start holds the tail of the block before, written on 4 KiB pages (a fault maps a huge page
    // only where all of it lies inside one mapping): collapsed now that it does.
    madvise(block, *size, MADV_HUGEPAGE);
    const uintptr_t start = reinterpret_cast<uintptr_t>(block);
    if (start % kHugePage != 0)
      madvise(reinterpret_cast<char*>(start / kHugePage * kHugePage), kHugePage, kMadvCollapse);
    return block;
  }

  bool owns(const void* data) const {
    const char* last = end.load(std::memory_order_acquire);
    const char* p = static_cast<const char*>(data);
    return last != nullptr && p >= base.load(std::memory_order_acquire) && p < last;
  }

  void unmap(void* data) {
    size_t size;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = blocks.find(data);
      TORCH_INTERNAL_ASSERT(it != blocks.end(), "a block the huge-page arena did not hand out");
      size = it->second;
      blocks.erase(it);
    }
    madvise(data, size, MADV_DONTNEED);  // the memory back (also where the next call is refused)
    mprotect(data, size, PROT_NONE);     // and its charge
  }

  size_t live() {
    std::lock_guard<std::mutex> lock(mutex);
    return blocks.size();
  }
};
HugePageArena& huge_page_arena = *new HugePageArena;  // never destroyed: blocks may be freed at exit

// In a forked child: a lock another thread of the parent held at the fork is free (only the forking thread exists)
void reset_huge_page_locks() {
  new (&huge_page_arena.mutex) std::mutex;
  new (&huge_page_mutex) std::mutex;
}
#endif

// HugePageAllocator's deleter, its DataPtrs' and its raw one (oneDNN's frees)
void free_huge_page_block(void* data) {
#ifdef __linux__
  if (huge_page_arena.owns(data)) {
    c10::profiledCPUMemoryReporter().Delete(data);
    huge_page_arena.unmap(data);
    return;
  }
#endif
  default_raw_deleter(data);
}

struct HugePageAllocator final : c10::Allocator {
  c10::Allocator* fallback = nullptr;  // the default CPU allocator

  c10::DataPtr allocate(size_t nbytes) override {
#ifdef __linux__
    if (huge_page_depth > 0 && nbytes >= kArenaMin) {
      size_t size = 0;
      if (char* data = huge_page_arena.map(nbytes, &size)) {
        c10::profiledCPUMemoryReporter().New(data, size);  // as the default's
        return {data, data, free_huge_page_block, c10::Device(c10::DeviceType::CPU)};
      }
      if (nbytes >= kHugePage) return aligned(nbytes);
    }
#endif
    return fallback->allocate(nbytes);
  }

#ifdef __linux__
  // Without the arena: a block of its own on a 2 MiB boundary, its last huge page whole where that wastes at most an
  // eighth of the allocation, else its 4 KiB pages
  c10::DataPtr aligned(size_t nbytes) {
    const size_t rounded = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
    const size_t size = (rounded - nbytes) * 8 <= nbytes ? rounded : nbytes;
    void* data = nullptr;
    if (posix_memalign(&data, kHugePage, size) != 0) return fallback->allocate(nbytes);
    // where glibc serves the block from its heap, some of it may be 4 KiB pages written before: collapsed now, as
    // they would be only up to the weight's last whole page after it is written (PackedWeight)
    const size_t whole = size / kHugePage * kHugePage;
    madvise(data, whole, MADV_HUGEPAGE);
    madvise(data, whole, kMadvCollapse);
    c10::profiledCPUMemoryReporter().New(data, size);  // as the default's: its deleter reports the free
    return {data, data, default_raw_deleter, c10::Device(c10::DeviceType::CPU)};
  }
#endif

  c10::DeleterFnPtr raw_deleter() const override { return free_huge_page_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HugePageAllocator& huge_page_allocator = *new HugePageAllocator;  // never destroyed: it may stay installed at exit
int huge_page_scopes = 0;  // threads' scopes open

}  // namespace

extern "C" {

// The C++ decoder's matmul of more rows than the GEMV takes (cpu_decoder.cpp's linear, bfloat16 packed for AMX): x
// [rows, K] (row stride x_stride, the decoder's dtype: 0 float32, 1 bfloat16) by packed weight `handle`, plus `bias`
// (N values, or null), as packed_linear runs it for the eager forward (the same bits), into out (row stride
// out_stride). 0, or -1 where it failed.
int ts_packed_linear_rows(int64_t handle, int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t K,
                          int64_t N, const void* bias, void* out, int64_t out_stride) {
  try {
    c10::InferenceMode guard;
    const auto options = at::TensorOptions().dtype(dtype == 0 ? at::kFloat : at::kBFloat16);
    const at::Tensor input = at::from_blob(const_cast<void*>(x), {rows, K}, {x_stride, 1}, options);
    std::optional<at::Tensor> b;
    if (bias != nullptr) b = at::from_blob(const_cast<void*>(bias), {N}, options);
    const at::Tensor result = packed_linear(input, handle, N, b).contiguous();
    const int64_t element = result.element_size(), row_bytes = N * element;
    const char* from = static_cast<const char*>(result.data_ptr());
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(out) + r * out_stride * element, from + r * row_bytes, row_bytes);
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Enter (enter 1) or leave (0) a scope in which this thread's allocations through PyTorch's CPU allocator of
// kArenaMin or more land on huge pages (HugePageAllocator). 1 where the scope entered does so; 0 where another CPU
// allocator than PyTorch's default (or this one) is installed, which stays (leaving such a scope changes nothing).
int ts_huge_page_scope(int enter) {
  std::lock_guard<std::mutex> lock(huge_page_mutex);
  if (!enter) {
    if (huge_page_depth == 0) return 0;
    --huge_page_depth;
    --huge_page_scopes;
#ifdef __linux__
    const bool blocks_live = huge_page_arena.live() > 0;
#else
    const bool blocks_live = false;
#endif
    // the default back once no block of the arena lives, unless another allocator was installed meanwhile
    if (huge_page_scopes == 0 && !blocks_live && c10::GetAllocator(c10::DeviceType::CPU) == &huge_page_allocator)
      c10::SetAllocator(c10::DeviceType::CPU, huge_page_allocator.fallback);
    return 1;
  }
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  if (current != &huge_page_allocator) {
    if (current != c10::GetDefaultCPUAllocator()) return 0;
#ifdef __linux__
    static const bool reserved = [] {
      pthread_atfork(nullptr, nullptr, reset_huge_page_locks);
      huge_page_arena.reserve();
      return true;
    }();
    (void)reserved;
#endif
    huge_page_allocator.fallback = current;
    default_raw_deleter = current->raw_deleter();
    c10::SetAllocator(c10::DeviceType::CPU, &huge_page_allocator);
    if (c10::GetAllocator(c10::DeviceType::CPU) != &huge_page_allocator) return 0;  // one of higher priority holds
  }
  ++huge_page_scopes;
  ++huge_page_depth;
  return 1;
}

// ShmCommunicator.register_native: communicator `id`'s segment, layout and counters (see ShmComm); replaces an
// earlier registration of the id
void ts_shm_register(int64_t id, int64_t segment, int64_t rank, int64_t world_size, int64_t slot_bytes,
                     int64_t header_bytes, int64_t row_words, int64_t first_parity_word, int64_t parity_words,
                     int64_t counters, int64_t float32_signature, int64_t bfloat16_signature,
                     int64_t float32_a2a_signature, int64_t bfloat16_a2a_signature,
                     int64_t float32_gather_signature, int64_t bfloat16_gather_signature) {
  std::lock_guard<std::mutex> lock(shm_mutex);
  shm_comms()[id] = ShmComm{reinterpret_cast<char*>(segment), rank, world_size, slot_bytes, header_bytes, row_words,
                            first_parity_word, parity_words, reinterpret_cast<int64_t*>(counters),
                            float32_signature, bfloat16_signature, float32_a2a_signature, bfloat16_a2a_signature,
                            float32_gather_signature, bfloat16_gather_signature};
}

void ts_shm_unregister(int64_t id) {
  std::lock_guard<std::mutex> lock(shm_mutex);
  shm_comms().erase(id);
}

// Registers the C++ implementation of torch_shift::shm_all_reduce on the CPU (once torch_shift.parallel.comm has
// defined it and its _python and _resume twins). 0, or -1 where PyTorch refused it.
int ts_register_all_reduce() {
  static torch::Library* library = nullptr;
  return register_once(library, [](torch::Library& m) { m.impl("shm_all_reduce", TORCH_FN(shm_all_reduce)); });
}

// fused.py's _silu_lanes(dtype, intermediate) for the C++ cpu_silu_mul: lanes 8 or 16, or 0 where none reproduces
// PyTorch (the Python implementation serves those)
void ts_note_silu_lanes(int dtype_code, int64_t intermediate, int lanes) {
  std::lock_guard<std::mutex> lock(silu_mutex);
  silu_lanes()[silu_key(dtype_code, intermediate)] = lanes;
}

// Registers the C++ implementations of torch_shift::cpu_rms_norm, cpu_add_rms_norm, cpu_rotary, cpu_silu_mul (with
// <name>_python twins for where their kernels do not apply) and cpu_gate_up_silu (packed_linear and silu_mul in
// chunks) on the CPU, once fused.py has defined them; `lanes`: fused.py's _sum_lanes() (0: RMSNorm stays in Python).
// 0, or -1 where PyTorch refused them.
int ts_register_elementwise(int lanes) {
  static torch::Library* library = nullptr;
  sum_lanes = lanes;
  return register_once(library, [](torch::Library& m) {
    m.impl("cpu_rms_norm", TORCH_FN(rms_norm));
    m.impl("cpu_add_rms_norm", TORCH_FN(add_rms_norm));
    m.impl("cpu_rotary", TORCH_FN(rotary));
    m.impl("cpu_silu_mul", TORCH_FN(silu_mul));
    m.impl("cpu_gate_up_silu", TORCH_FN(gate_up_silu));
  });
}

// CpuPagedAttention.install_native: its arrays' addresses (see PagedStep)
void ts_install_paged_step(int dtype_code, int64_t k_base, int64_t v_base, int64_t k_layer_bytes,
                           int64_t v_layer_bytes, int64_t k_layout, int64_t v_layout, int64_t num_runs,
                           int64_t query_start, int64_t query_len, int64_t num_computed, int64_t block_table,
                           int64_t block_table_stride, int64_t block_table_row, int64_t block_size,
                           int64_t num_kv_heads, int64_t slot_mapping, int64_t sliding_window) {
  auto i32 = [](int64_t address) { return reinterpret_cast<const int32_t*>(address); };
  auto i64 = [](int64_t address) { return reinterpret_cast<const int64_t*>(address); };
  step = PagedStep{dtype_code, dtype_code == 1 ? at::kBFloat16 : dtype_code == 2 ? at::kHalf : at::kFloat,
                   reinterpret_cast<char*>(k_base), reinterpret_cast<char*>(v_base), k_layer_bytes, v_layer_bytes,
                   i64(k_layout), i64(v_layout), num_runs, i32(query_start), i32(query_len), i32(num_computed),
                   i32(block_table), block_table_stride, i32(block_table_row), block_size, num_kv_heads,
                   i64(slot_mapping), sliding_window};
  step_installed = true;
  ulysses_installed = false;  // until ts_install_ulysses
}

void ts_uninstall_paged_step() {
  step_installed = false;
  ulysses_installed = false;
}

// UlyssesAttention.install_native, after its paged step's install: the step's attention calls run Ulysses' all-to-alls
// through shared-memory communicator `communicator` around it (ulysses_attention) until the step is uninstalled
// (`chunk_k_bases`, `chunk_v_bases`: SP values each, where this rank holds every token and reads each head chunk's rank's
// cache at those addresses, the step's others alike: solo_attention; null: the all-to-alls)
void ts_install_ulysses(int64_t communicator, int64_t sp, int64_t sp_rank, const int64_t* counts,
                        const int64_t* kv_send_index, int64_t kv_send_len, const int64_t* chunk_k_bases,
                        const int64_t* chunk_v_bases) {
  ulysses.communicator = communicator;
  ulysses.sp_rank = sp_rank;
  ulysses.counts.assign(counts, counts + sp);
  ulysses.kv_send_index = kv_send_len > 0 ? at::from_blob(const_cast<int64_t*>(kv_send_index), {kv_send_len},
                                                          at::kLong).clone()
                                          : at::Tensor();
  ulysses.chunk_k_bases.clear();
  ulysses.chunk_v_bases.clear();
  if (chunk_k_bases != nullptr) {
    for (int64_t p = 0; p < sp; ++p) {
      ulysses.chunk_k_bases.push_back(reinterpret_cast<char*>(chunk_k_bases[p]));
      ulysses.chunk_v_bases.push_back(reinterpret_cast<char*>(chunk_v_bases[p]));
    }
  }
  ulysses_installed = step_installed;
}

// Whether the installed step's attention runs Ulysses' all-to-alls (ts_install_ulysses), for the native decoder
int ts_ulysses_installed() { return ulysses_installed ? 1 : 0; }

// A copy of the installed step for the native decoder (PagedStepCopy): new, refilled from the installed step (0, or
// -100 where none is installed), deleted
void* ts_paged_step_copy_new() { return new PagedStepCopy; }
void ts_paged_step_copy_delete(void* copy) { delete static_cast<PagedStepCopy*>(copy); }
int ts_paged_step_copy_fill(void* copy) {
  if (!step_installed) return -100;
  PagedStepCopy& c = *static_cast<PagedStepCopy*>(copy);
  const int64_t runs = step.num_runs, width = step.block_table_stride;
  c.ints.resize(4 * runs + runs * width);
  int32_t* ints = c.ints.data();
  std::copy(step.query_start, step.query_start + runs, ints);
  std::copy(step.query_len, step.query_len + runs, ints + runs);
  std::copy(step.num_computed, step.num_computed + runs, ints + 2 * runs);
  int32_t* table = ints + 4 * runs;
  for (int64_t r = 0; r < runs; ++r) {
    ints[3 * runs + r] = static_cast<int32_t>(r);
    const int32_t* row = step.block_table + int64_t(step.block_table_row[r]) * width;
    std::copy(row, row + width, table + r * width);
  }
  const int64_t tokens = runs > 0 ? int64_t(step.query_start[runs - 1]) + step.query_len[runs - 1] : 0;
  c.slots.assign(step.slot_mapping, step.slot_mapping + tokens);
  c.step = step;
  c.step.query_start = ints, c.step.query_len = ints + runs, c.step.num_computed = ints + 2 * runs;
  c.step.block_table_row = ints + 3 * runs, c.step.block_table = table;
  c.step.slot_mapping = c.slots.data();
  c.num_computed = runs == 1 ? ints[2] : 0;
  return 0;
}

// A one-run copy narrowed to its tokens [first, first + num_tokens), as a step of those tokens alone: the tokens
// before them cached (a check of proposed tokens run in stages: cpu_decoder.cpp). 0, or -200 for a copy of several
// runs or tokens outside its run.
int ts_paged_step_copy_narrow(void* copy, int64_t first, int64_t num_tokens) {
  PagedStepCopy& c = *static_cast<PagedStepCopy*>(copy);
  if (c.step.num_runs != 1 || first < 0 || num_tokens < 1 || first + num_tokens > int64_t(c.slots.size())) return -200;
  c.ints[1] = static_cast<int32_t>(num_tokens);
  c.ints[2] = c.num_computed + static_cast<int32_t>(first);
  c.step.slot_mapping = c.slots.data() + first;
  return 0;
}

// `attend` for the native decoder (cpu_decoder.cpp): the step of `copy` (a PagedStepCopy), or the installed one where
// it is null, with Ulysses' all-to-alls around it where those are installed (a sequence-parallel rank's tokens:
// ulysses_attention, which sends each head chunk its share of the `num_kv_heads` heads of k and v); -100 where none is
// installed, -300 where an all-to-all failed (ts_collective_error)
int ts_step_attention(const void* copy, int64_t layer_idx, const void* q, int64_t q_row_stride, int64_t q_head_stride,
                      const void* k, int64_t k_row_stride, int64_t k_head_stride, const void* v, int64_t v_row_stride,
                      int64_t v_head_stride, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t window, void* out) {
  if (copy == nullptr && !step_installed) return -100;
  if (copy == nullptr && ulysses_installed) {
    return collective_code("Ulysses' all-to-all failed", [&] {
      const at::TensorOptions options = at::TensorOptions().dtype(step.dtype);
      auto view = [&](const void* p, int64_t heads, int64_t row_stride, int64_t head_stride) {
        return at::from_blob(const_cast<void*>(p), {num_tokens, heads, head_dim}, {row_stride, head_stride, 1},
                             options);
      };
      const at::Tensor attended = ulysses_attention(
          view(q, num_heads, q_row_stride, q_head_stride), view(k, num_kv_heads, k_row_stride, k_head_stride),
          view(v, num_kv_heads, v_row_stride, v_head_stride), layer_idx, std::nullopt,
          window >= 0 ? std::optional<int64_t>(window) : std::nullopt);
      std::memcpy(out, attended.contiguous().data_ptr(), attended.numel() * attended.element_size());
    });
  }
  const PagedStep& s = copy != nullptr ? static_cast<const PagedStepCopy*>(copy)->step : step;
  return attend(s, layer_idx, q, q_row_stride, q_head_stride, k, k_row_stride, k_head_stride, v, v_row_stride,
                v_head_stride, num_tokens, num_heads, head_dim, nullptr, window, out);
}

// Registers the C++ implementation of torch_shift::sparse_moe on the CPU (once torch_shift/models/moe.py has defined it
// and torch_shift::sparse_moe_python). 0, or -1 where PyTorch refused it.
int ts_register_moe() {
  static torch::Library* library = nullptr;
  return register_once(library, [](torch::Library& m) {
    m.impl("sparse_moe", torch::CppFunction::makeFromBoxedFunction<&sparse_moe>());
  });
}

// Registers the C++ implementation of torch_shift::attention on the CPU; called once torch_shift/compilation.py has
// defined it and torch_shift::attention_python. 0, or -1 where PyTorch refused it.
int ts_register_attention() {
  static torch::Library* library = nullptr;
  return register_once(library, [](torch::Library& m) { m.impl("attention", TORCH_FN(attention)); });
}

}  // extern "C"

TORCH_LIBRARY_FRAGMENT(torch_shift_cpu, m) {
  m.def("register_packed(Tensor weight, int handle, int weight_address, int gemv_max_rows, int out_features, "
        "int in_features, int dtype_code) -> ()",
        &register_packed);
  m.def("unregister_packed(int handle) -> ()", &unregister_packed);
}

TORCH_LIBRARY_IMPL(torch_shift, CPU, m) { m.impl("packed_linear", &packed_linear); }
