// A step of at most 16 tokens of a dense decoder (torch_shift/models/decoder.py's DecoderLM without experts or
// attention sinks: Llama, Mistral, Qwen2, Qwen3) in one call: embedding, every layer and the LM head's rows run
// here, through the kernels an eager forward calls one by one from Python (the GEMV, RMSNorm and rotary kernels,
// the installed step's paged attention), so the result is bitwise the eager forward's.
//
// Why: a batch-1 decode step of the 106M model spends about 1.7 ms beside its weight reads, much of it in the
// interpreter and the dispatcher between the kernels, which run cold after each weight streams through the caches;
// on the default 2M model the eager forward is two thirds of the step (docs/performance.md, issue 20).
//
// The model is described once (ts_decoder_create: addresses of its weights, which the caller keeps alive), then each
// step passes its token ids, positions and logits rows. One step at a time per decoder (its scratch is its own).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

extern "C" int ts_packed_gemv(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight,
                              int64_t N, int64_t K, const void* bias, void* out, int64_t out_row_stride);
extern "C" int ts_argmax(int dtype, const void* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out);
extern "C" int ts_rms_norm(int dtype, const void* x, int64_t outer, int64_t inner, int64_t outer_stride,
                           int64_t inner_stride, int64_t dim, const void* weight, float eps, int64_t lanes, void* out);
extern "C" int ts_rotary(int dtype, const void* x, int64_t tokens, int64_t heads, int64_t token_stride,
                         int64_t head_stride, int64_t dim, const int64_t* positions, const float* cos_sin,
                         int64_t table_positions, void* out);
extern "C" int ts_step_attention(int64_t layer_idx, const void* q, int64_t q_row_stride, int64_t q_head_stride,
                                 const void* k, int64_t k_row_stride, int64_t k_head_stride, const void* v,
                                 int64_t v_row_stride, int64_t v_head_stride, int64_t num_tokens, int64_t num_heads,
                                 int64_t head_dim, int64_t window, void* out);

#if defined(__x86_64__)
#include <immintrin.h>
// PyTorch's vectorised exp on AVX-512 (Vectorized<float>::exp), exported by libtorch_cpu; weak: a torch built
// without it leaves it null, and the decoder declines (ts_decoder_available)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#endif

#include "cpu_no_contract.h"  // PyTorch's separate operators round each result

namespace {

constexpr int64_t kMaxTokens = 16;  // linear.py's GEMV_MAX_ROWS: every matmul of the step runs the GEMV

// the fields of one layer in the array ts_decoder_create reads (torch_shift/models/native_decoder.py writes it)
enum LayerField {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kKvLayer, kWindow, kO, kOBias, kPostNorm, kGateUp, kDown, kLayerFields
};
// and of the model
enum ModelField {
  kDtype, kHidden, kHeads, kKvHeads, kHeadDim, kIntermediate, kVocab, kLanes, kPositions, kEmbed, kFinalNorm, kLmHead,
  kCosSin, kModelFields
};

struct Layer {
  const void* input_norm;
  const void* qkv;
  const void* qkv_bias;
  const void* q_norm;  // null: none (Qwen3 has them)
  const void* k_norm;
  int64_t kv_layer;
  int64_t window;  // -1: the step's
  const void* o;
  const void* o_bias;
  const void* post_norm;
  const void* gate_up;
  const void* down;
};

struct Decoder {
  int dtype;  // 0 float32, 1 bfloat16
  int64_t elem, hidden, heads, kv_heads, head_dim, intermediate, vocab, lanes, positions;
  float eps;
  const void* embed;
  const void* final_norm;
  const void* lm_head;
  const float* cos_sin;
  std::vector<Layer> layers;
  // scratch for kMaxTokens tokens
  std::vector<char> x, h, qkv, q, k, attn, gate_up, act;

  int64_t qkv_rows() const { return (heads + 2 * kv_heads) * head_dim; }
  char* row(std::vector<char>& buffer, int64_t r, int64_t width) { return buffer.data() + r * width * elem; }
};

inline float load(const void* p, int64_t i, int dtype) {
  return dtype == 0 ? static_cast<const float*>(p)[i] : to_float(static_cast<const bf16_t*>(p)[i]);
}
inline void store(void* p, int64_t i, float v, int dtype) {
  if (dtype == 0)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<bf16_t*>(p)[i] = to_bf16(v);
}

// out = a + b, rounded to the dtype (the residual's `x + f(x)`)
void add(const void* a, const void* b, void* out, int64_t n, int dtype) {
  for (int64_t i = 0; i < n; ++i) store(out, i, load(a, i, dtype) + load(b, i, dtype), dtype);
}

#if defined(__x86_64__)
// x / (1 + exp(-x)) on 16 floats as PyTorch's vectorised silu computes them (Vectorized<float>: neg, exp, add, div)
__attribute__((target("avx512f"))) inline void silu16(const float* x, float* out) {
  const __m512 v = _mm512_loadu_ps(x);
  const __m512 e = Sleef_expf16_u10(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v),
                                                                         _mm512_set1_epi32(INT32_MIN))));
  _mm512_storeu_ps(out, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}
#endif

// silu(x) in the vectorised loop's runs and its scalar remainder (see silu_mul), from element `begin` of a row
void silu_segment(const void* gate, int64_t begin, int64_t n, int dtype, float* out) {
#if defined(__x86_64__)
  const int64_t run = dtype == 0 ? 32 : 64;
  float in[64];
  int64_t i = 0;
  for (; i + run <= n; i += run) {
    for (int64_t j = 0; j < run; ++j) in[j] = load(gate, begin + i + j, dtype);
    for (int64_t j = 0; j < run; j += 16) silu16(in + j, out + i + j);
  }
  for (; i < n; ++i) {
    const float v = load(gate, begin + i, dtype);
    out[i] = v / (1.0f + std::exp(-v));
  }
#else
  (void)gate, (void)begin, (void)n, (void)dtype, (void)out;
#endif
}

// out[t, :I] = silu(gate_up[t, :I]) * gate_up[t, I:], each operator's result rounded to the dtype, as
// `F.silu(gate) * up` computes it on a thread running `threads` OpenMP threads. PyTorch's silu takes a row's elements
// in runs of two vectors (32 floats, or 64 bfloat16 as two float halves) with its vectorised exp, and the rest one at
// a time with std::exp, which rounds some values differently; and above 32768 elements TensorIterator splits the
// elements into one equal part per thread (at::parallel_for), a part may start inside a row, and each piece of a row
// starts its runs where it starts.
void silu_mul(const void* gate_up, void* out, int64_t tokens, int64_t I, int dtype, int threads) {
  constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE
  const int64_t numel = tokens * I;
  int64_t part = numel;
  if (numel > kGrain && threads > 1) {
    const int64_t parts = std::min<int64_t>(threads, (numel + kGrain - 1) / kGrain);
    part = (numel + parts - 1) / parts;
  }
  std::vector<float> silu(I);
  for (int64_t start = 0; start < numel; start += part) {
    const int64_t end = std::min(numel, start + part);
    for (int64_t e = start; e < end;) {
      const int64_t t = e / I, col = e % I, n = std::min(end - e, I - col);
      silu_segment(static_cast<const char*>(gate_up) + t * 2 * I * (dtype == 0 ? 4 : 2), col, n, dtype, silu.data());
      for (int64_t i = 0; i < n; ++i) {
        const float s = dtype == 0 ? silu[i] : to_float(to_bf16(silu[i]));
        store(out, t * I + col + i, s * load(gate_up, t * 2 * I + I + col + i, dtype), dtype);
      }
      e += n;
    }
  }
}

int norm(const Decoder& d, const void* x, int64_t rows, const void* weight, void* out) {
  return ts_rms_norm(d.dtype, x, rows, 1, d.hidden, 0, d.hidden, weight, d.eps, d.lanes, out);
}

int layer_step(Decoder& d, const Layer& L, const int64_t* positions, int64_t T) {
  const int dt = d.dtype;
  const int64_t H = d.hidden, I = d.intermediate, hd = d.head_dim, rows = d.qkv_rows();
  const int64_t q_size = d.heads * hd, kv_size = d.kv_heads * hd;
  int rc;
  if ((rc = norm(d, d.x.data(), T, L.input_norm, d.h.data())) != 0) return rc;
  if ((rc = ts_packed_gemv(dt, d.h.data(), H, T, L.qkv, rows, H, L.qkv_bias, d.qkv.data(), rows)) != 0) return rc;
  const char* q = d.qkv.data();
  const char* k = q + q_size * d.elem;
  const char* v = k + kv_size * d.elem;
  int64_t q_stride = rows, k_stride = rows;
  if (L.q_norm != nullptr) {  // into h's and attn's room: free until the o projection
    if ((rc = ts_rms_norm(dt, q, T, d.heads, rows, hd, hd, L.q_norm, d.eps, d.lanes, d.attn.data())) != 0) return rc;
    if ((rc = ts_rms_norm(dt, k, T, d.kv_heads, rows, hd, hd, L.k_norm, d.eps, d.lanes, d.h.data())) != 0) return rc;
    q = d.attn.data(), k = d.h.data(), q_stride = q_size, k_stride = kv_size;
  }
  if ((rc = ts_rotary(dt, q, T, d.heads, q_stride, hd, hd, positions, d.cos_sin, d.positions, d.q.data())) != 0)
    return rc;
  if ((rc = ts_rotary(dt, k, T, d.kv_heads, k_stride, hd, hd, positions, d.cos_sin, d.positions, d.k.data())) != 0)
    return rc;
  if ((rc = ts_step_attention(L.kv_layer, d.q.data(), q_size, hd, d.k.data(), kv_size, hd, v, rows, hd, T, d.heads,
                              hd, L.window, d.attn.data())) != 0)
    return rc;
  if ((rc = ts_packed_gemv(dt, d.attn.data(), q_size, T, L.o, H, q_size, L.o_bias, d.h.data(), H)) != 0) return rc;
  add(d.x.data(), d.h.data(), d.x.data(), T * H, dt);
  if ((rc = norm(d, d.x.data(), T, L.post_norm, d.h.data())) != 0) return rc;
  if ((rc = ts_packed_gemv(dt, d.h.data(), H, T, L.gate_up, 2 * I, H, nullptr, d.gate_up.data(), 2 * I)) != 0)
    return rc;
  silu_mul(d.gate_up.data(), d.act.data(), T, I, dt, at::get_num_threads());
  if ((rc = ts_packed_gemv(dt, d.act.data(), I, T, L.down, H, I, nullptr, d.h.data(), H)) != 0) return rc;
  add(d.x.data(), d.h.data(), d.x.data(), T * H, dt);
  return 0;
}

}  // namespace

extern "C" {

// Whether this build and CPU run the decoder: 1, else 0 (no AVX-512, or no PyTorch exp to match).
int ts_decoder_available() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && Sleef_expf16_u10 != nullptr ? 1 : 0;
#else
  return 0;
#endif
}

// model: kModelFields int64 (ModelField; addresses as integers); layers: num_layers x kLayerFields. Returns the
// decoder, or null for a field out of range.
void* ts_decoder_create(const int64_t* model, const int64_t* layers, int64_t num_layers, float eps) {
  if (!ts_decoder_available() || (model[kDtype] != 0 && model[kDtype] != 1) || num_layers < 1) return nullptr;
  auto* d = new Decoder;
  auto ptr = [](int64_t address) { return reinterpret_cast<const void*>(address); };
  d->dtype = static_cast<int>(model[kDtype]);
  d->elem = d->dtype == 0 ? 4 : 2;
  d->hidden = model[kHidden], d->heads = model[kHeads], d->kv_heads = model[kKvHeads], d->head_dim = model[kHeadDim];
  d->intermediate = model[kIntermediate], d->vocab = model[kVocab], d->lanes = model[kLanes];
  d->positions = model[kPositions];
  d->eps = eps;
  d->embed = ptr(model[kEmbed]), d->final_norm = ptr(model[kFinalNorm]), d->lm_head = ptr(model[kLmHead]);
  d->cos_sin = static_cast<const float*>(ptr(model[kCosSin]));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* f = layers + l * kLayerFields;
    d->layers.push_back({ptr(f[kInputNorm]), ptr(f[kQkv]), ptr(f[kQkvBias]), ptr(f[kQNorm]), ptr(f[kKNorm]),
                         f[kKvLayer], f[kWindow], ptr(f[kO]), ptr(f[kOBias]), ptr(f[kPostNorm]), ptr(f[kGateUp]),
                         ptr(f[kDown])});
  }
  const int64_t widest = std::max({d->hidden, d->qkv_rows(), d->heads * d->head_dim});
  for (auto* buffer : {&d->x, &d->h, &d->qkv, &d->q, &d->k, &d->attn})
    buffer->resize(kMaxTokens * widest * d->elem);
  d->gate_up.resize(kMaxTokens * 2 * d->intermediate * d->elem);
  d->act.resize(kMaxTokens * d->intermediate * d->elem);
  return d;
}

void ts_decoder_destroy(void* decoder) { delete static_cast<Decoder*>(decoder); }

// One step: input_ids and positions [num_tokens] (int64), logits [num_logits, vocab] of the rows logits_rows
// (int64) in the model's dtype, and where argmax is not null each logits row's argmax (int64, as ts_argmax), found
// while the logits are in cache: called from Python after the step, the argmax took 100-120 us against 9-12 us
// for a second call (a bf16 batch-1 step of the 106M model, whose weights had gone through the caches;
// docs/performance.md). The step's paged attention must be installed (ts_install_paged_step). Returns 0; -200 for
// a token count out of range, -201 for a token id or row outside the vocabulary or the step; else the failing
// kernel's code.
int ts_decoder_step(void* decoder, const int64_t* input_ids, const int64_t* positions, int64_t num_tokens,
                    const int64_t* logits_rows, int64_t num_logits, void* logits, int64_t* argmax) {
  Decoder& d = *static_cast<Decoder*>(decoder);
  if (num_tokens < 1 || num_tokens > kMaxTokens || num_logits < 0 || num_logits > num_tokens) return -200;
  const int64_t H = d.hidden, row_bytes = H * d.elem;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (input_ids[t] < 0 || input_ids[t] >= d.vocab) return -201;
    std::memcpy(d.row(d.x, t, H), static_cast<const char*>(d.embed) + input_ids[t] * row_bytes, row_bytes);
  }
  for (const Layer& layer : d.layers) {
    const int rc = layer_step(d, layer, positions, num_tokens);
    if (rc != 0) return rc;
  }
  if (num_logits == 0) return 0;
  for (int64_t r = 0; r < num_logits; ++r) {  // the logits rows first: RMSNorm is row by row
    if (logits_rows[r] < 0 || logits_rows[r] >= num_tokens) return -201;
    std::memcpy(d.row(d.q, r, H), d.row(d.x, logits_rows[r], H), row_bytes);
  }
  int rc = norm(d, d.q.data(), num_logits, d.final_norm, d.h.data());
  if (rc != 0) return rc;
  rc = ts_packed_gemv(d.dtype, d.h.data(), H, num_logits, d.lm_head, d.vocab, H, nullptr, logits, d.vocab);
  if (rc != 0 || argmax == nullptr) return rc;
  return ts_argmax(d.dtype, logits, num_logits, d.vocab, d.vocab, argmax);
}

// silu_mul alone, for the check that it reproduces PyTorch's `F.silu(gate) * up` on this machine
// (native_decoder.py): gate_up [tokens, 2 * intermediate] -> out [tokens, intermediate]
int ts_decoder_silu_mul(int dtype, const void* gate_up, int64_t tokens, int64_t intermediate, void* out) {
  if (!ts_decoder_available() || (dtype != 0 && dtype != 1)) return -1;
  silu_mul(gate_up, out, tokens, intermediate, dtype, at::get_num_threads());
  return 0;
}

}  // extern "C"
