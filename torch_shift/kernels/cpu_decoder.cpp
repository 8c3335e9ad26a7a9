// A step of at most kMaxTokens tokens of a dense decoder (torch_shift/models/decoder.py's DecoderLM without experts or
// attention sinks: Llama, Mistral, Qwen2, Qwen3) in one call: embedding, every layer and the LM head's rows run
// here, through the kernels an eager forward calls one by one from Python (the GEMV, RMSNorm and rotary kernels,
// the installed step's paged attention), so the result is bitwise the eager forward's. On a rank of a
// tensor-parallel layout the model is its shard, and the o and down projections' partial outputs are summed
// through the layout's shared-memory all-reduce (cpu_ops.cpp's ts_decoder_all_reduce), as the forward's are. On a rank
// of a sequence-parallel layout the step is its share of the tokens, each layer's attention runs Ulysses' all-to-alls
// around the paged kernel (cpu_ops.cpp's, installed for the step), and the result is the rows' hidden states.
//
// Why: a batch-1 decode step of the 106M model spends about 1.7 ms beside its weight reads, much of it in the
// interpreter and the dispatcher between the kernels, which run cold after each weight streams through the caches;
// on the default 2M model the eager forward is two thirds of the step (docs/performance.md, issue 20).
//
// The model is described once (ts_decoder_create: addresses of its weights, which the caller keeps alive), then each
// step passes its token ids, positions and logits rows. One step at a time per decoder (its scratch is its own).
// With AVX-512 its weights are in oneDNN's layout for the GEMV kernel; with AVX2 in torch_shift's 16-feature blocks
// (cpu_linear.cpp), and SiLU reproduces PyTorch's AVX2 build (8-float exp) instead of its AVX-512 one.
//
// A step may also be launched (ts_decoder_launch) to run on a thread of the decoder's own while the engine's thread
// returns to prepare the next one, as a GPU runs a step while its host schedules the next (asynchronous scheduling):
// the engine's thread then helps with the step's GEMVs once it waits for it (ts_decoder_wait), so that the two
// cores stream weights together again. A bf16 batch-1 step of the 106M model spends about 0.7 ms of its 7.6 in the
// engine's Python, during which the pool otherwise only prefetches (docs/performance.md, issue 20).

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <unistd.h>

#include "cpu_threads.h"
#endif

#include "cpu_common.h"

extern "C" int ts_packed_gemv(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight,
                              int64_t N, int64_t K, const void* bias, void* out, int64_t out_row_stride);
extern "C" int ts_blocked_linear(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight,
                                 int64_t N, int64_t K, const void* bias, void* out, int64_t out_row_stride,
                                 int64_t gemv_rows);
extern "C" int64_t ts_blocked_gemv_rows();
extern "C" int ts_argmax(int dtype, const void* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out);
extern "C" int ts_sample_rows(int dtype, const void* x, int64_t rows, int64_t cols, int64_t row_stride,
                              const float* draws, int64_t* out);
extern "C" int ts_rms_norm(int dtype, const void* x, int64_t outer, int64_t inner, int64_t outer_stride,
                           int64_t inner_stride, int64_t dim, const void* weight, float eps, int64_t lanes, void* out);
extern "C" int ts_add_rms_norm(int dtype, const void* x, const void* residual, int64_t rows, int64_t dim,
                               const void* weight, float eps, int64_t lanes, void* sum, void* out);
extern "C" int ts_rotary(int dtype, const void* x, int64_t tokens, int64_t heads, int64_t token_stride,
                         int64_t head_stride, int64_t dim, const int64_t* positions, const float* cos_sin,
                         int64_t table_positions, void* out);
extern "C" int ts_decoder_all_reduce(int64_t communicator, int dtype, void* data, int64_t rows, int64_t cols);
extern "C" int ts_decoder_all_gather(int64_t communicator, int dtype, const void* data, int64_t rows, int64_t cols,
                                     void* out, int64_t out_cols);
extern "C" int ts_ulysses_installed();
extern "C" int ts_packed_linear_rows(int64_t handle, int dtype, const void* x, int64_t x_stride, int64_t rows,
                                     int64_t K, int64_t N, const void* bias, void* out, int64_t out_stride);
extern "C" void* ts_paged_step_copy_new();
extern "C" void ts_paged_step_copy_delete(void* copy);
extern "C" int ts_paged_step_copy_fill(void* copy);
extern "C" int ts_paged_step_copy_narrow(void* copy, int64_t first, int64_t num_tokens);
extern "C" void ts_gemv_pool_always_caller();
extern "C" int64_t ts_suffix_draft(const int64_t* tokens, int64_t num_tokens, const int64_t* ends, int64_t num_ends,
                                   int64_t scan_len, const int64_t* context, int64_t context_len, int64_t first_len,
                                   int64_t min_count, int64_t max_depth, int64_t max_spec_tokens,
                                   double max_spec_factor, double min_token_prob, double beat, int64_t* out_tokens,
                                   double* out_scores, int64_t* out_match_len);
extern "C" int64_t ts_suffix_draft_global(void* index, const int64_t* tokens, int64_t num_tokens,
                                          const int64_t* context, int64_t context_len, int64_t max_depth,
                                          int64_t max_spec_tokens, double max_spec_factor, double min_token_prob,
                                          double beat, int64_t* out_tokens, double* out_scores,
                                          int64_t* out_match_len);
extern "C" void ts_gemv_pool_help(const std::atomic<int64_t>* counter, int64_t target);
extern "C" int ts_pool_run_pieces(int64_t pieces, void (*piece)(const void* ctx, int64_t b), const void* ctx);
extern "C" int ts_step_attention(const void* copy, int64_t layer_idx, const void* q, int64_t q_row_stride,
                                 int64_t q_head_stride, const void* k, int64_t k_row_stride, int64_t k_head_stride,
                                 const void* v, int64_t v_row_stride, int64_t v_head_stride, int64_t num_tokens,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window, void* out);

#if defined(__x86_64__)
#include <immintrin.h>
// PyTorch's vectorised exp (Vectorized<float>::exp) on AVX-512 and on AVX2, exported by libtorch_cpu; weak: a torch
// built without one leaves it null, and the decoder declines that width (ts_decoder_available)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif

#include "cpu_no_contract.h"  // PyTorch's separate operators round each result

namespace {

constexpr int64_t kMaxTokens = 64;       // native_decoder.py's MAX_TOKENS: a decoder's max_tokens at most
constexpr int64_t kQueue = 2;       // steps launched and not finished, at most: the one running and the next
constexpr int64_t kResults = 64;    // steps whose return codes are kept
constexpr int64_t kSpinBeforeSleepNs = 2'000'000;  // the decoder's thread sleeps after this without a step
constexpr int64_t kRunSteps = (int64_t(1) << 16) - 1;  // a run's steps (a check's stages) in its limit word's low bits

// torch_shift.parallel.runs' limit word, (run << 16) | steps, through which rank 0's interrupt ends a multi-step run
// (ts_decoder_steps) or a redrafting check (run_redrafting) after its current step. The leader writes it before step
// `done` (from 0) of `total`; every rank reads it after the step, whose collectives the leader joined after its write.
inline void lead_run_step(int64_t* limit, const int64_t* interrupt, int64_t run, int64_t total, int64_t done) {
  const int64_t tag = run << 16;
  if (done == 0) __atomic_store_n(limit, tag | total, __ATOMIC_RELEASE);
  if (__atomic_load_n(interrupt, __ATOMIC_ACQUIRE) != 0 &&
      (__atomic_load_n(limit, __ATOMIC_RELAXED) & kRunSteps) > done + 1)
    __atomic_store_n(limit, tag | (done + 1), __ATOMIC_RELEASE);
}

// Whether the run ends after its `done`-th step: its limit says so, or the leader went on to a later run.
inline bool run_ends_after(const int64_t* limit, int64_t run, int64_t done) {
  const int64_t word = __atomic_load_n(limit, __ATOMIC_ACQUIRE);
  return (word >> 16) != run || (word & kRunSteps) <= done;
}

// the fields of one layer in the array ts_decoder_create reads (torch_shift/models/native_decoder.py writes it)
enum LayerField {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kKvLayer, kWindow, kO, kOBias, kPostNorm, kGateUp, kDown, kQkvHandle,
  kOHandle, kGateUpHandle, kDownHandle, kLayerFields
};
// and of the model
enum ModelField {
  kDtype, kHidden, kHeads, kKvHeads, kHeadDim, kIntermediate, kVocab, kLanes, kPositions, kEmbed, kFinalNorm, kLmHead,
  kCosSin, kSiluLanes, kBlocked, kGemvCode, kMaxStepTokens, kCommunicator, kLmHeadRows, kGemvRows, kLmHeadHandle,
  kModelFields
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
  // the weights' handles (linear.py's PackedWeight.handle): a matmul of more rows than the GEMV takes runs oneDNN's
  int64_t qkv_handle, o_handle, gate_up_handle, down_handle;
};

// A batch-1 check whose stages after the first are drafted here (run_redrafting), with suffix decoding's rule over
// the request's own tokens (cpu_suffix.cpp; torch_shift/engine/spec_decode/suffix.py's local tree) and, with
// global_tree, over the outputs of earlier requests too (suffix.py's GlobalTree), as
// torch_shift.models.native_decoder.Redraft lays it out
struct Redraft {
  const int64_t* history;  // the request's tokens up to the step's first input id, included
  int64_t history_len;
  const int64_t* stop_ids;  // a stage that draws one of them ends the check (sorted)
  int64_t num_stops;
  int64_t fresh_tokens;  // the most proposals a stage checks after one that rejected a proposal
  int64_t more_tokens;   // after one that accepted every proposal
  int64_t max_stages;
  int64_t max_depth;     // the suffix tree's
  double max_spec_factor, min_token_prob;
  // nonzero: the drafts look in the global tree too, which one rank of the layout holds (global_tokens: its array of
  // global_size tokens, global_index its pairs' (cpu_suffix.cpp's PairIndex); null on the others), and over several
  // ranks that rank's drafts reach the others through the communicator (share_draft)
  int64_t global_tree;
  const int64_t* global_tokens;
  int64_t global_size;
  void* global_index;
  // written: [1 + 3 * max_stages], the stages run, then each one's proposed and accepted tokens and nanoseconds (its
  // draft's and its rows'), which price a check's tokens (Speculator.observe)
  int64_t* stages;
  // or null: the words through which rank 0 ends the check after its current stage, as a multi-step run's
  // (ts_decoder_steps; torch_shift.parallel.runs): the check's limit word, the interrupt, the check's run number and
  // whether this rank leads it
  int64_t* limit;
  const int64_t* interrupt;
  int64_t run;
  int64_t leader;
};

// A launched step: its inputs copied, the caller's outputs (alive until it waited for the step)
struct Launched {
  std::vector<int64_t> input_ids, positions, logits_rows;
  std::vector<int64_t> placeholders, sources;  // input ids the step before sampled: their indices, and its rows
  std::vector<float> draws;                    // ts_sample_rows' [5, logits rows], or empty: each row's argmax
  void* logits = nullptr;
  int64_t* argmax = nullptr;
  void* attention = nullptr;  // the paged step installed at launch, copied (cpu_ops.cpp's PagedStepCopy)
  int64_t first_stage = 0;     // a check run in two stages: the tokens of the first (run_in_stages); 0: one
  bool redrafts = false;       // its later stages drafted here (Redraft, copied with its history and stop tokens)
  Redraft redraft;
  std::vector<int64_t> history, stop_ids;
};

struct Async {
  Launched steps[kQueue];
  std::atomic<int64_t> launched{0}, completed{0};  // tickets: the n-th launch is n
  std::atomic<uint32_t> wake{0};                   // a futex word: changes at each launch and at the end
  std::atomic<int> sleeping{0};
  std::atomic<bool> stopping{false};
  int results[kResults] = {};
  std::vector<int64_t> last_argmax;  // of the step run last (the thread's own)
  pthread_t thread;
  pid_t owner = 0;
};

struct Decoder {
  int dtype;  // 0 float32, 1 bfloat16
  int64_t elem, hidden, heads, kv_heads, head_dim, intermediate, vocab, lanes, positions;
  int silu_lanes;  // the width of PyTorch's vectorised exp that SiLU reproduces: 16 (AVX-512) or 8 (AVX2)
  bool blocked;    // every weight in torch_shift's 16-feature blocks (ts_blocked_linear), else oneDNN's (the GEMV)
  int gemv_code;   // ts_packed_gemv's code for every weight's dtype and layout (4: bfloat16 packed for AMX)
  int64_t max_tokens;  // a step's tokens at most (1 to kMaxTokens): the scratch's rows
  // matmuls of more rows run oneDNN's, as the eager forward's packed linear runs them (bfloat16 packed for AMX where
  // the GEMV cannot use the tile unit)
  int64_t gemv_rows;
  int64_t lm_head_handle;
  // a rank of a tensor-parallel layout: the shared-memory communicator (cpu_ops.cpp's, -1: none) that sums the o and
  // down projections' partial outputs, as RowParallelLinear's all-reduce; and the LM head's rows on this rank: the
  // vocabulary, or its shard of it (in group-rank order), which the same communicator gathers (gathers_logits). A rank
  // of a sequence-parallel layout has no LM head here (null): its step's result is its logits rows' final hidden
  // states (after the model's last norm), which the caller gathers before the head.
  int64_t communicator;
  int64_t lm_head_rows;
  float eps;
  const void* embed;
  const void* final_norm;
  const void* lm_head;
  const float* cos_sin;
  std::vector<Layer> layers;
  // scratch for max_tokens tokens
  std::vector<char> x, h, qkv, q, k, attn, gate_up, act, shard;  // shard: the LM head's rows, before their gather
  Async* async = nullptr;  // the launched steps' thread, started at the first launch
  void* stage_copy = nullptr;  // the installed paged step, copied for a synchronous check in two stages

  int64_t qkv_rows() const { return (heads + 2 * kv_heads) * head_dim; }
  bool gathers_logits() const { return communicator >= 0 && lm_head != nullptr && lm_head_rows != vocab; }
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
// x / (1 + exp(-x)) on 8 floats as PyTorch's vectorised silu computes them with AVX2 (Vectorized<float>: neg, exp,
// add, div)
__attribute__((target("avx2,fma"))) inline __m256 silu8(__m256 v) {
  const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(v, _mm256_set1_ps(-0.0f)));
  return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// 16 floats of gate or up, float32 or bfloat16
template <typename T>
__attribute__((target("avx512f"))) inline __m512 load_f32x16(const T* p) {
  if constexpr (std::is_same<T, float>::value)
    return _mm512_loadu_ps(p);
  else
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// silu(x) rounded to bfloat16, as silu_mul16 below computes it, for x in 16 bfloat16 words (as 32-bit lanes)
__attribute__((target("avx512f"))) inline __m512 silu_bf16x16(__m512i words) {
  const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  const __m512 e = Sleef_expf16_u10(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x),
                                                                         _mm512_set1_epi32(INT32_MIN))));
  return round_bf16x16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

// That silu for every bfloat16 word, computed once: a bfloat16 silu(gate) * up looks its silu(gate) up. (A lane's
// result depends only on that lane: the same bits. With the exp and division an element cost 2.3-2.6 cycles on an AMX
// Xeon, compute-bound at any size; with the lookup 1.2-1.4: docs/performance.md.) Two words more for a gather of
// 32-bit lanes at the last one.
struct SiluBf16Table {
  alignas(64) uint16_t silu[65536 + 2];
};

// (no lambdas: GCC compiles one without its function's target)
__attribute__((target("avx512f"))) const SiluBf16Table* new_silu_bf16_table16() {
  auto* t = new SiluBf16Table();
  for (int32_t i = 0; i < 65536; i += 16) {
    const __m512i words = _mm512_add_epi32(_mm512_set1_epi32(i),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(silu_bf16x16(words)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t->silu + i), _mm512_cvtepi32_epi16(bits));
  }
  return t;
}

// the same with PyTorch's AVX2 arithmetic, as silu_mul8 computes it
__attribute__((target("avx2,fma"))) const SiluBf16Table* new_silu_bf16_table8() {
  auto* t = new SiluBf16Table();
  alignas(32) uint32_t results[8];
  for (int32_t i = 0; i < 65536; i += 8) {
    const __m256i words = _mm256_add_epi32(_mm256_set1_epi32(i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    _mm256_store_si256(reinterpret_cast<__m256i*>(results), bf16_words8(silu8(x)));
    for (int l = 0; l < 8; ++l) t->silu[i + l] = static_cast<uint16_t>(results[l]);
  }
  return t;
}

// lanes: the width of PyTorch's vectorised exp that the kernel reproduces (16 or 8); built once (thread-safe), kept
// for the process
const uint16_t* silu_bf16_table(int lanes) {
  if (lanes == 16) {
    static const SiluBf16Table* table = new_silu_bf16_table16();
    return table->silu;
  }
  static const SiluBf16Table* table = new_silu_bf16_table8();
  return table->silu;
}

// out[0, 16 N) = silu(gate) * up, each operator's result rounded to the dtype (T: float or bf16_t). float32: the N exps
// (calls) first, then the rest of each vector; bfloat16 looks silu(gate) up in `silu` (silu_bf16_table's).
template <int N, typename T>
__attribute__((target("avx512f"))) inline void silu_mul16(const T* gate, const T* up, T* out, const uint16_t* silu) {
  if constexpr (std::is_same<T, float>::value) {
    __m512 e[N];
    for (int v = 0; v < N; ++v)
      e[v] = Sleef_expf16_u10(_mm512_castsi512_ps(
          _mm512_xor_si512(_mm512_castps_si512(load_f32x16(gate + 16 * v)), _mm512_set1_epi32(INT32_MIN))));
    for (int v = 0; v < N; ++v) {
      const __m512 s = _mm512_div_ps(load_f32x16(gate + 16 * v), _mm512_add_ps(_mm512_set1_ps(1.0f), e[v]));
      _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(s, load_f32x16(up + 16 * v)));
    }
  } else {
    for (int v = 0; v < N; ++v) {
      const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + 16 * v)));
      const __m512i looked_up = _mm512_i32gather_epi32(words, silu, 2);  // each index's word, and the next one's
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(looked_up, 16));
      store_bf16x16(_mm512_mul_ps(s, load_f32x16(up + 16 * v)), out + 16 * v);
    }
  }
}

// out[0, 8) = silu(gate) * up (AVX2); bfloat16 looks silu(gate) up in `silu` (silu_bf16_table(8)'s)
template <typename T>
__attribute__((target("avx2,fma"))) inline void silu_mul8(const T* gate, const T* up, T* out, const uint16_t* silu) {
  if constexpr (std::is_same<T, float>::value) {
    _mm256_storeu_ps(out, _mm256_mul_ps(silu8(load8(gate)), load8(up)));
  } else {
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gate)));
    const __m256i looked_up = _mm256_i32gather_epi32(reinterpret_cast<const int*>(silu), words, 2);
    store_bf16x8(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(looked_up, 16)), load8(up)), out);
  }
}
#endif

// out[i] = silu(gate[i]) * up[i] for i < n, silu as PyTorch's vectorised loop computes it in its runs (two of its
// vectors of the dtype: 2 x `lanes` floats, or 4 x `lanes` bfloat16, a bfloat16 vector being twice as many elements
// converted as two float vectors) and its scalar remainder (std::exp); `lanes` at a time in vectors here
template <typename T>
void silu_mul_segment(const T* gate, const T* up, T* out, int64_t n, int lanes) {
  int64_t i = 0;
#if defined(__x86_64__)
  const int64_t run = (std::is_same<T, float>::value ? 2 : 4) * lanes;
  const uint16_t* silu = !std::is_same<T, float>::value && n >= run ? silu_bf16_table(lanes) : nullptr;
  for (; i + run <= n; i += run) {
    if (lanes == 16) {
      silu_mul16<std::is_same<T, float>::value ? 2 : 4>(gate + i, up + i, out + i, silu);
      continue;
    }
    for (int64_t j = 0; j < run; j += lanes) silu_mul8(gate + i + j, up + i + j, out + i + j, silu);
  }
#else
  (void)lanes;
#endif
  for (; i < n; ++i) {
    const float v = to_float(gate[i]);
    const float silu = v / (1.0f + std::exp(-v));
    if constexpr (std::is_same<T, float>::value)
      out[i] = silu * up[i];
    else
      out[i] = to_bf16(to_float(to_bf16(silu)) * to_float(up[i]));
  }
}

// out[t, col, col + n) of silu_mul below, in its dtype (0 float32, else bfloat16), its runs starting at col
void silu_mul_span(const void* gate_up, void* out, int64_t I, int64_t t, int64_t col, int64_t n, int dtype,
                   int lanes) {
  if (dtype == 0) {
    const float* row = static_cast<const float*>(gate_up) + t * 2 * I;
    silu_mul_segment(row + col, row + I + col, static_cast<float*>(out) + t * I + col, n, lanes);
  } else {
    const bf16_t* row = static_cast<const bf16_t*>(gate_up) + t * 2 * I;
    silu_mul_segment(row + col, row + I + col, static_cast<bf16_t*>(out) + t * I + col, n, lanes);
  }
}

// A row of silu_mul in pieces of kSiluPiece elements, on the decode pool's threads (a pooled step's one part)
constexpr int64_t kSiluPiece = 4096;  // a multiple of every run's elements (32 floats, 64 bfloat16)
constexpr int64_t kSiluPoolMin = 16384;  // elements below which one thread does it (a job costs a few us)
struct SiluRows {
  const void* gate_up;
  void* out;
  int64_t I, pieces_per_row;
  int dtype, lanes;
};

void silu_piece(const void* ctx, int64_t b) {
  const SiluRows& s = *static_cast<const SiluRows*>(ctx);
  const int64_t t = b / s.pieces_per_row, col = b % s.pieces_per_row * kSiluPiece;
  silu_mul_span(s.gate_up, s.out, s.I, t, col, std::min(kSiluPiece, s.I - col), s.dtype, s.lanes);
}

// out[t, :I] = silu(gate_up[t, :I]) * gate_up[t, I:], each operator's result rounded to the dtype, as
// `F.silu(gate) * up` computes it on a thread running `threads` OpenMP threads. PyTorch's silu takes a row's elements
// in runs of two vectors (with AVX-512: 32 floats, or 64 bfloat16 as two float halves; half that with AVX2) with its
// vectorised exp of `lanes` floats, and the rest one at a time with std::exp, which rounds some values differently;
// and above 32768 elements TensorIterator splits the elements into one equal part per thread (at::parallel_for), a
// part may start inside a row, and each piece of a row starts its runs where it starts.
void silu_mul(const void* gate_up, void* out, int64_t tokens, int64_t I, int dtype, int lanes, int threads) {
  constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE
  const int64_t numel = tokens * I;
  if (numel == 0) return;  // a rank's forward of no rows (Ulysses with fewer tokens than ranks)
  // On one thread (a pooled step's) the one part's rows, whole: on the decode pool's threads where the caller runs
  // its GEMVs there, each row in pieces that start at multiples of the runs from the row's start, so that every
  // element is computed as in the row (a 64-row step of the widened model: 3.8 ms on one thread)
  if (threads <= 1 && numel >= kSiluPoolMin) {
    const SiluRows rows{gate_up, out, I, (I + kSiluPiece - 1) / kSiluPiece, dtype, lanes};
    if (ts_pool_run_pieces(tokens * rows.pieces_per_row, silu_piece, &rows) == 0) return;
  }
  int64_t part = numel;
  if (numel > kGrain && threads > 1) {
    const int64_t parts = std::min<int64_t>(threads, (numel + kGrain - 1) / kGrain);
    part = (numel + parts - 1) / parts;
  }
  // the parts on torch's threads as they come (each part's results depend only on where it starts and ends)
  at::parallel_for(0, (numel + part - 1) / part, 1, [&](int64_t first, int64_t last) {
    for (int64_t start = first * part; start < std::min(numel, last * part); start += part) {
      const int64_t end = std::min(numel, start + part);
      for (int64_t e = start; e < end;) {
        const int64_t t = e / I, col = e % I, n = std::min(end - e, I - col);
        silu_mul_span(gate_up, out, I, t, col, n, dtype, lanes);
        e += n;
      }
    }
  });
}

int norm(const Decoder& d, const void* x, int64_t rows, const void* weight, void* out) {
  return ts_rms_norm(d.dtype, x, rows, 1, d.hidden, 0, d.hidden, weight, d.eps, d.lanes, out);
}

// out[rows, N] = x[rows, K] @ W.T (+ bias) as the eager forward's packed linear runs it: the GEMV on oneDNN's
// layout (max_tokens is at most the rows it takes there), or the 16-feature blocks' kernel with its GEMV for up to
// ts_blocked_gemv_rows() rows and its matmul for more (models/linear.py's PackedWeight)
int linear(const Decoder& d, const void* x, int64_t x_stride, int64_t rows, const void* w, int64_t handle, int64_t N,
           int64_t K, const void* bias, void* out, int64_t out_stride) {
  if (d.blocked)
    return ts_blocked_linear(d.dtype, x, x_stride, rows, w, N, K, bias, out, out_stride,
                             ts_blocked_gemv_rows());
  // oneDNN's matmul (cpu_ops.cpp's packed_linear): above GEMV_MAX_ROWS, or AMX_DOT_GEMV_MAX_ROWS (bf16 on AMX without
  // the tile unit's GEMV)
  if (rows > d.gemv_rows)
    return ts_packed_linear_rows(handle, d.dtype, x, x_stride, rows, K, N, bias, out, out_stride) == 0 ? 0 : -210;
  return ts_packed_gemv(d.gemv_code, x, x_stride, rows, w, N, K, bias, out, out_stride);
}

// `keep` (the last layer; null on the others): only these rows go on after the attention, which reads every token's
// keys and values: the LM head's rows, as DecoderLM.forward's logits_indices
int layer_step(Decoder& d, const Layer& L, const int64_t* positions, int64_t T, const void* attention,
               const int64_t* keep = nullptr, int64_t num_keep = 0) {
  const int dt = d.dtype;
  const int64_t H = d.hidden, I = d.intermediate, hd = d.head_dim, rows = d.qkv_rows();
  const int64_t q_size = d.heads * hd, kv_size = d.kv_heads * hd;
  int rc;
  if ((rc = norm(d, d.x.data(), T, L.input_norm, d.h.data())) != 0) return rc;
  rc = linear(d, d.h.data(), H, T, L.qkv, L.qkv_handle, rows, H, L.qkv_bias, d.qkv.data(), rows);
  if (rc != 0) return rc;
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
  if ((rc = ts_step_attention(attention, L.kv_layer, d.q.data(), q_size, hd, d.k.data(), kv_size, hd, v, rows, hd,
                              T, d.heads, d.kv_heads, hd, L.window, d.attn.data())) != 0)
    return rc;
  const char* attended = d.attn.data();
  if (keep != nullptr) {  // the kept rows of the attention into q's room, of the residual stream through h's
    for (int64_t r = 0; r < num_keep; ++r) {
      std::memcpy(d.row(d.q, r, q_size), d.row(d.attn, keep[r], q_size), q_size * d.elem);
      std::memcpy(d.row(d.h, r, H), d.row(d.x, keep[r], H), H * d.elem);
    }
    std::memcpy(d.x.data(), d.h.data(), num_keep * H * d.elem);
    attended = d.q.data();
    T = num_keep;
    if (T == 0) {  // no logits rows (prompt chunks only): the layer's two all-reduces of no rows, as a peer's forward
      for (int i = 0; i < 2 && d.communicator >= 0; ++i)
        if ((rc = ts_decoder_all_reduce(d.communicator, dt, d.h.data(), 0, H)) != 0) return rc;
      return 0;
    }
  }
  rc = linear(d, attended, q_size, T, L.o, L.o_handle, H, q_size, L.o_bias, d.h.data(), H);
  if (rc != 0) return rc;
  if (d.communicator >= 0 && (rc = ts_decoder_all_reduce(d.communicator, dt, d.h.data(), T, H)) != 0) return rc;
  // the residual add and the norm after it, as the eager forward's RMSNorm(x, residual): x += h, h = norm(x)
  rc = ts_add_rms_norm(dt, d.x.data(), d.h.data(), T, H, L.post_norm, d.eps, d.lanes, d.x.data(), d.h.data());
  if (rc != 0) return rc;
  rc = linear(d, d.h.data(), H, T, L.gate_up, L.gate_up_handle, 2 * I, H, nullptr, d.gate_up.data(), 2 * I);
  if (rc != 0) return rc;
  silu_mul(d.gate_up.data(), d.act.data(), T, I, dt, d.silu_lanes, at::get_num_threads());
  if ((rc = linear(d, d.act.data(), I, T, L.down, L.down_handle, H, I, nullptr, d.h.data(), H)) != 0) return rc;
  if (d.communicator >= 0 && (rc = ts_decoder_all_reduce(d.communicator, dt, d.h.data(), T, H)) != 0) return rc;
  add(d.x.data(), d.h.data(), d.x.data(), T * H, dt);
  return 0;
}

// The step of ts_decoder_step, attending through `attention` (a PagedStepCopy; null: the installed step)
int run_step(Decoder& d, const int64_t* input_ids, const int64_t* positions, int64_t num_tokens,
             const int64_t* logits_rows, int64_t num_logits, void* logits, int64_t* argmax, const void* attention,
             const float* draws = nullptr) {
  if (num_tokens < 1 || num_tokens > d.max_tokens || num_logits < 0 || num_logits > num_tokens) return -200;
  const int64_t H = d.hidden, row_bytes = H * d.elem;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (input_ids[t] < 0 || input_ids[t] >= d.vocab) return -201;
    std::memcpy(d.row(d.x, t, H), static_cast<const char*>(d.embed) + input_ids[t] * row_bytes, row_bytes);
  }
  for (int64_t r = 0; r < num_logits; ++r)
    if (logits_rows[r] < 0 || logits_rows[r] >= num_tokens) return -201;
  for (size_t i = 0; i < d.layers.size(); ++i) {  // the last layer's projections and MLP on the logits rows alone
    const bool last = i + 1 == d.layers.size();
    const int rc = layer_step(d, d.layers[i], positions, num_tokens, attention, last ? logits_rows : nullptr,
                              num_logits);
    if (rc != 0) return rc;
  }
  if (num_logits == 0)  // a shard's peers gather their empty rows all the same (in Python, a rank without the decoder)
    return d.gathers_logits()
               ? ts_decoder_all_gather(d.communicator, d.dtype, d.shard.data(), 0, d.lm_head_rows, logits, d.vocab)
               : 0;
  if (d.lm_head == nullptr && argmax != nullptr) return -200;
  // the logits rows are the first of x; without an LM head their final hidden states are the step's result
  int rc = norm(d, d.x.data(), num_logits, d.final_norm, d.lm_head == nullptr ? logits : d.h.data());
  if (rc != 0 || d.lm_head == nullptr) return rc;
  const bool gathered = d.gathers_logits();
  rc = linear(d, d.h.data(), H, num_logits, d.lm_head, d.lm_head_handle, d.lm_head_rows, H, nullptr,
              gathered ? d.shard.data() : logits, d.lm_head_rows);
  if (rc == 0 && gathered)
    rc = ts_decoder_all_gather(d.communicator, d.dtype, d.shard.data(), num_logits, d.lm_head_rows, logits, d.vocab);
  if (rc != 0 || argmax == nullptr) return rc;
  if (!gathered && d.lm_head_rows != d.vocab) return -200;  // a shard of the vocabulary has no argmax of it
  if (draws != nullptr) return ts_sample_rows(d.dtype, logits, num_logits, d.vocab, d.vocab, draws, argmax);
  return ts_argmax(d.dtype, logits, num_logits, d.vocab, d.vocab, argmax);
}

#if defined(__linux__)
// A batch-1 check of proposed tokens (a launched step of one run, every token a logits row, argmax drawn) in two
// stages: its first `s.first_stage` tokens, then the others only where every row of the first drew the next token
// (the proposals they check all accepted). The second stage attends to the first's cached keys and values, as a
// prompt's later chunk does. Where the first stage rejects a proposal, the rows after it are left unwritten, their
// argmax -1: the sampler reads no row past the first rejected proposal. So a check that stops early computes no row
// past its first stage, and one that goes on pays no return to the host between the stages (the host's work between
// two checks: 0.6-0.9 ms on the edit work, docs/performance.md).
// `rows`: 0 .. n - 1 (a stage's own rows are their first ones); `copy`: the step's PagedStepCopy, narrowed to each
// stage in turn. The ranks of a tensor-parallel shard run the same stages: each finds the same argmax of the logits
// gathered whole.
// One stage of a staged check: its `length` tokens from the step's `begin`-th, their rows' logits and argmax at the
// same rows of the step's (`rows`: 0 .. length - 1), the paged step `copy` narrowed to them.
int run_stage(Decoder& d, const int64_t* ids, const int64_t* pos, int64_t begin, int64_t length, const int64_t* rows,
              void* logits, int64_t* argmax, void* copy) {
  const int rc = ts_paged_step_copy_narrow(copy, begin, length);
  return rc != 0 ? rc
                 : run_step(d, ids + begin, pos + begin, length, rows, length,
                            static_cast<char*>(logits) + begin * d.vocab * d.elem, argmax + begin, copy);
}

int run_in_stages(Decoder& d, const int64_t* ids, const int64_t* pos, int64_t n, int64_t first, const int64_t* rows,
                  void* logits, int64_t* argmax, void* copy) {
  const int rc = run_stage(d, ids, pos, 0, first, rows, logits, argmax, copy);
  if (rc != 0) return rc;
  bool accepted = true;
  for (int64_t i = 0; i < first && accepted; ++i) accepted = argmax[i] == ids[i + 1];
  if (!accepted) {
    std::fill(argmax + first, argmax + n, int64_t{-1});
    return 0;
  }
  return run_stage(d, ids, pos, first, n - first, rows, logits, argmax, copy);
}

// The draft of at most `cap` tokens after `history` (suffix.py's SuffixProposer.speculate): the request's own tree's
// (matches from one token, found twice or more), or where r.global_tree asks and it scores more, the global tree's
// (matches from two tokens), which is searched only where a path there could score more (its ceiling). Writes
// draft[0, num) and returns num.
int64_t draft_after(const Redraft& r, const std::vector<int64_t>& history, int64_t cap, int64_t* draft,
                    std::vector<int64_t>& remote, std::vector<double>& scores) {
  const int64_t context_len = std::min<int64_t>(r.max_depth, static_cast<int64_t>(history.size()));
  if (cap < 1 || context_len < 2) return 0;
  const int64_t num_tokens = static_cast<int64_t>(history.size());
  const int64_t* context = history.data() + num_tokens - context_len;
  int64_t match_len = 0;
  const int64_t num = std::max<int64_t>(
      ts_suffix_draft(history.data(), num_tokens, nullptr, 0, num_tokens, context, context_len, 1, 2, r.max_depth,
                      cap, r.max_spec_factor, r.min_token_prob, 0.0, draft, scores.data(), &match_len),
      0);
  if (r.global_index == nullptr) return num;
  const double score = num > 0 ? scores[num - 1] : 0.0;
  int64_t ceiling = 0;  // suffix.py's path_limit over the match lengths the global tree allows
  for (int64_t length = 2; length < context_len; ++length)
    ceiling = std::max({ceiling, std::min({cap, static_cast<int64_t>(std::min(length * r.max_spec_factor,
                                                                              static_cast<double>(r.max_depth)) +
                                                                     1e-6),
                                           r.max_depth - length})});
  if (score >= static_cast<double>(ceiling)) return num;
  const int64_t found = ts_suffix_draft_global(r.global_index, r.global_tokens, r.global_size, context, context_len,
                                               r.max_depth, cap, r.max_spec_factor, r.min_token_prob, score,
                                               remote.data(), scores.data(), &match_len);
  if (found <= 0 || scores[found - 1] <= score) return num;
  std::copy(remote.begin(), remote.begin() + found, draft);
  return found;
}

// The draft of the rank that holds the global tree, on every rank of the layout: summed in float32 over the
// communicator with zeros from the others (token ids below 2^24 are exact there). Returns its token count, or -300
// where the all-reduce failed.
int64_t share_draft(const Decoder& d, int64_t cap, int64_t num, int64_t* draft, bool holder,
                    std::vector<float>& words) {
  words.assign(static_cast<size_t>(1 + cap), 0.0f);
  if (holder) {
    words[0] = static_cast<float>(num);
    for (int64_t i = 0; i < num; ++i) words[1 + i] = static_cast<float>(draft[i]);
  }
  const int rc = ts_decoder_all_reduce(d.communicator, 0, words.data(), 1, 1 + cap);
  if (rc != 0) return rc;
  num = static_cast<int64_t>(words[0]);
  for (int64_t i = 0; i < num; ++i) draft[i] = static_cast<int64_t>(words[1 + i]);
  return num;
}

// A batch-1 check of `n` tokens (the step's scheduled slots) whose first stage checks `first` - 1 proposals, as
// run_in_stages' does, and whose later stages are drafted here from the request's tokens and those drawn so far (and
// with r.global_tree the earlier outputs: draft_after, share_draft): a stage's next input is the token its rows drew
// after the proposals they accepted, followed by a fresh draft of at most `r.fresh_tokens` (after a rejection) or
// `r.more_tokens` (after a stage that accepted all) tokens, at the position after the last accepted one (its KV written
// over a rejected proposal's), or where no draft is found, the token alone. The check ends at a stage that draws a
// stop token, leaves no slot for another, or is the
// `r.max_stages`-th; the host's work and the step plan between checks (about 1.4 ms of a TP-2 rank's 5-6 ms check on
// the edit work, docs/performance.md) are paid once. With r.limit, rank 0's interrupt (a request arrived) ends it after
// the stage running then, as a multi-step run's (lead_run_step, run_ends_after). On return argmax[j] is the token drawn
// at the step's position j for j below the tokens drawn (each a proposal accepted there, the last one not) and -1 after
// them: the rows of a one-stage check whose proposals were those tokens. `ids` is the step's input ids and `history`
// the request's tokens, r.history's (scratch: both written over).
int run_redrafting(Decoder& d, int64_t* ids, const int64_t* pos, int64_t n, int64_t first, const int64_t* rows,
                   void* logits, int64_t* argmax, void* copy, Redraft& r, std::vector<int64_t>& history) {
  history.reserve(r.history_len + n);
  std::vector<int64_t> draft(static_cast<size_t>(n)), remote(static_cast<size_t>(n));
  std::vector<double> scores(static_cast<size_t>(n));
  std::vector<float> words;
  // over several ranks with the global tree, one rank drafts and tells the others
  const bool shared = r.global_tree != 0 && d.communicator >= 0;
  const bool drafts = !shared || r.global_index != nullptr;
  int64_t& num_stages = r.stages[0];
  num_stages = 0;
  int64_t begin = 0, length = first;
  auto stage_start = std::chrono::steady_clock::now();
  for (;;) {
    if (r.limit != nullptr && r.leader) lead_run_step(r.limit, r.interrupt, r.run, r.max_stages, num_stages);
    const int rc = run_stage(d, ids, pos, begin, length, rows, logits, argmax, copy);
    if (rc != 0) return rc;
    int64_t accepted = 0;
    while (accepted < length - 1 && argmax[begin + accepted] == ids[begin + accepted + 1]) ++accepted;
    const auto stage_end = std::chrono::steady_clock::now();
    r.stages[1 + 3 * num_stages] = length - 1;
    r.stages[2 + 3 * num_stages] = accepted;
    r.stages[3 + 3 * num_stages] =
        std::chrono::duration_cast<std::chrono::nanoseconds>(stage_end - stage_start).count();
    stage_start = stage_end;
    ++num_stages;
    bool stop = false;
    for (int64_t i = begin; i <= begin + accepted; ++i) {
      history.push_back(argmax[i]);
      stop = stop || std::binary_search(r.stop_ids, r.stop_ids + r.num_stops, argmax[i]);
    }
    const int64_t next = begin + accepted + 1;  // the drawn token's position: the next stage's first
    std::fill(argmax + next, argmax + n, int64_t{-1});
    if (stop || next >= n || num_stages >= r.max_stages) return 0;
    if (r.limit != nullptr && run_ends_after(r.limit, r.run, num_stages)) return 0;
    const int64_t cap = std::min(accepted == length - 1 ? r.more_tokens : r.fresh_tokens, n - next - 1);
    // none: the next stage decodes the drawn token alone and the one after it drafts again
    int64_t num = drafts ? draft_after(r, history, cap, draft.data(), remote, scores) : 0;
    if (shared && cap >= 1 && (num = share_draft(d, cap, num, draft.data(), drafts, words)) < 0)
      return static_cast<int>(num);
    ids[next] = argmax[next - 1];
    std::copy(draft.begin(), draft.begin() + num, ids + next + 1);
    begin = next;
    length = 1 + num;
  }
}

bool redraft_ok(const Decoder& d, const Redraft& r) {
  return r.history != nullptr && r.history_len >= 1 && (r.stop_ids != nullptr || r.num_stops == 0) &&
         r.num_stops >= 0 && r.fresh_tokens >= 1 && r.more_tokens >= 1 && r.max_stages >= 1 && r.max_depth >= 1 &&
         r.stages != nullptr && (r.limit == nullptr || (r.interrupt != nullptr && r.max_stages <= kRunSteps)) &&
         (r.global_index == nullptr || (r.global_tree != 0 && r.global_tokens != nullptr && r.global_size >= 0)) &&
         (r.global_tree == 0 || d.vocab <= (int64_t{1} << 24));  // share_draft's float32 words
}

// Whether a step may run in two stages of `first_stage` tokens and the rest: a batch-1 check whose every token is a
// logits row in order, with argmax and no draws (run_step refuses an argmax where the rank lacks the vocabulary's
// logits)
bool stages_ok(int64_t num_tokens, const int64_t* logits_rows, int64_t num_logits, const int64_t* argmax,
               const float* draws, int64_t first_stage) {
  if (first_stage < 1 || first_stage >= num_tokens || num_logits != num_tokens || argmax == nullptr ||
      draws != nullptr)
    return false;
  for (int64_t r = 0; r < num_logits; ++r)
    if (logits_rows[r] != r) return false;
  return true;
}

// The launched steps' thread: runs them in order. Its OpenMP regions run on one thread, as a pooled step's caller's
// (torch_shift/engine/decode_pool.py), so that its results are those of a step run by the engine's thread; its GEMVs
// go through the pool as its caller, where the engine's thread helps.
void* async_main(void* arg) {
  Decoder& d = *static_cast<Decoder*>(arg);
  Async& a = *d.async;
  // torch sets a thread's OpenMP threads to its process-wide count at the first look, once in libtorch and once more
  // in this library's copy of at::parallel_for (its own thread-local flag): both before they are set to one, or this
  // thread's first parallel_for ran a team of two beside the engine's thread (a step took 3x as long)
  at::internal::lazy_init_num_threads();
  at::get_num_threads();
  omp_set_num_threads(1);
  ts_gemv_pool_always_caller();
  int64_t next = 1;
  IdleSpin idle(kSpinBeforeSleepNs);
  for (;;) {
    if (a.launched.load(std::memory_order_acquire) >= next) {
      Launched& s = a.steps[(next - 1) % kQueue];
      int rc = 0;
      for (size_t i = 0; i < s.placeholders.size() && rc == 0; ++i) {
        const int64_t source = s.sources[i];
        if (source < 0 || source >= static_cast<int64_t>(a.last_argmax.size()))
          rc = -201;
        else
          s.input_ids[s.placeholders[i]] = a.last_argmax[source];
      }
      const int64_t num_logits = static_cast<int64_t>(s.logits_rows.size());
      if (rc == 0 && s.redrafts)
        rc = run_redrafting(d, s.input_ids.data(), s.positions.data(), static_cast<int64_t>(s.input_ids.size()),
                            s.first_stage, s.logits_rows.data(), s.logits, s.argmax, s.attention, s.redraft,
                            s.history);
      else if (rc == 0 && s.first_stage > 0)
        rc = run_in_stages(d, s.input_ids.data(), s.positions.data(), static_cast<int64_t>(s.input_ids.size()),
                           s.first_stage, s.logits_rows.data(), s.logits, s.argmax, s.attention);
      else if (rc == 0)
        rc = run_step(d, s.input_ids.data(), s.positions.data(), static_cast<int64_t>(s.input_ids.size()),
                      s.logits_rows.data(), num_logits, s.logits, s.argmax, s.attention,
                      s.draws.empty() ? nullptr : s.draws.data());
      if (rc == 0)
        a.last_argmax.assign(s.argmax, s.argmax + num_logits);
      else
        a.last_argmax.clear();
      a.results[next % kResults] = rc;
      a.completed.store(next, std::memory_order_release);
      ++next;
      idle.busy();
      continue;
    }
    if (a.stopping.load(std::memory_order_acquire)) return nullptr;
#if defined(__x86_64__)
    _mm_pause();
#endif
    if (!idle.spun()) continue;
    a.sleeping.store(1, std::memory_order_seq_cst);
    const uint32_t word = a.wake.load(std::memory_order_seq_cst);
    if (a.launched.load(std::memory_order_seq_cst) < next && !a.stopping.load(std::memory_order_seq_cst))
      futex_wait(&a.wake, word);
    a.sleeping.store(0, std::memory_order_seq_cst);
    idle.busy();
  }
}

void wake(Async& a) {
  a.wake.fetch_add(1, std::memory_order_seq_cst);
  if (a.sleeping.load(std::memory_order_seq_cst)) futex_wake(&a.wake);
}

// The thread of this process (a child forked from a process that had one starts its own); false where the system
// refused it
bool start_async(Decoder& d) {
  if (d.async != nullptr && d.async->owner == getpid()) return true;
  d.async = new Async;  // a forked child's copy of its parent's is left: its thread is not in this process
  d.async->owner = getpid();
  for (Launched& s : d.async->steps) s.attention = ts_paged_step_copy_new();
  if (pthread_create(&d.async->thread, nullptr, async_main, &d) != 0) {
    for (Launched& s : d.async->steps) ts_paged_step_copy_delete(s.attention);
    delete d.async;
    d.async = nullptr;
    return false;
  }
  return true;
}

void stop_async(Decoder& d) {
  if (d.async == nullptr || d.async->owner != getpid()) return;
  Async& a = *d.async;
  a.stopping.store(true, std::memory_order_seq_cst);
  wake(a);
  pthread_join(a.thread, nullptr);  // it runs the steps launched before it ends
  for (Launched& s : a.steps) ts_paged_step_copy_delete(s.attention);
  delete d.async;
  d.async = nullptr;
}
#endif

}  // namespace

extern "C" {

// The widths of PyTorch's vectorised exp whose SiLU the decoder can reproduce on this build and CPU: 16 (AVX-512)
// and 8 (AVX2 and FMA) as bits; 0 where it does not run (no AVX2, or no PyTorch exp to match).
int ts_decoder_available() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  int lanes = 0;
  if (__builtin_cpu_supports("avx512f") && Sleef_expf16_u10 != nullptr) lanes |= 16;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && Sleef_expf8_u10 != nullptr) lanes |= 8;
  return lanes;
#else
  return 0;
#endif
}

// model: kModelFields int64 (ModelField; addresses as integers); layers: num_layers x kLayerFields. Returns the
// decoder, or null for a field out of range.
void* ts_decoder_create(const int64_t* model, const int64_t* layers, int64_t num_layers, float eps) {
  if ((model[kSiluLanes] != 8 && model[kSiluLanes] != 16) || !(ts_decoder_available() & model[kSiluLanes]) ||
      (model[kDtype] != 0 && model[kDtype] != 1) || num_layers < 1 || model[kMaxStepTokens] < 1 ||
      model[kMaxStepTokens] > kMaxTokens || model[kLmHeadRows] < 1 || model[kGemvRows] < 1)
    return nullptr;
  auto* d = new Decoder;
  auto ptr = [](int64_t address) { return reinterpret_cast<const void*>(address); };
  d->dtype = static_cast<int>(model[kDtype]);
  d->elem = d->dtype == 0 ? 4 : 2;
  d->hidden = model[kHidden], d->heads = model[kHeads], d->kv_heads = model[kKvHeads], d->head_dim = model[kHeadDim];
  d->intermediate = model[kIntermediate], d->vocab = model[kVocab], d->lanes = model[kLanes];
  d->positions = model[kPositions];
  d->silu_lanes = static_cast<int>(model[kSiluLanes]);
  d->blocked = model[kBlocked] != 0;
  d->gemv_code = static_cast<int>(model[kGemvCode]);
  d->max_tokens = model[kMaxStepTokens];
  d->gemv_rows = model[kGemvRows], d->lm_head_handle = model[kLmHeadHandle];
  d->communicator = model[kCommunicator], d->lm_head_rows = model[kLmHeadRows];
  d->eps = eps;
  d->embed = ptr(model[kEmbed]), d->final_norm = ptr(model[kFinalNorm]), d->lm_head = ptr(model[kLmHead]);
  d->cos_sin = static_cast<const float*>(ptr(model[kCosSin]));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* f = layers + l * kLayerFields;
    d->layers.push_back({ptr(f[kInputNorm]), ptr(f[kQkv]), ptr(f[kQkvBias]), ptr(f[kQNorm]), ptr(f[kKNorm]),
                         f[kKvLayer], f[kWindow], ptr(f[kO]), ptr(f[kOBias]), ptr(f[kPostNorm]), ptr(f[kGateUp]),
                         ptr(f[kDown]), f[kQkvHandle], f[kOHandle], f[kGateUpHandle], f[kDownHandle]});
  }
  const int64_t widest = std::max({d->hidden, d->qkv_rows(), d->heads * d->head_dim});
  for (auto* buffer : {&d->x, &d->h, &d->qkv, &d->q, &d->k, &d->attn})
    buffer->resize(d->max_tokens * widest * d->elem);
  d->gate_up.resize(d->max_tokens * 2 * d->intermediate * d->elem);
  d->act.resize(d->max_tokens * d->intermediate * d->elem);
  if (d->gathers_logits()) d->shard.resize(d->max_tokens * d->lm_head_rows * d->elem);
  return d;
}

void ts_decoder_destroy(void* decoder) {
#if defined(__linux__)
  stop_async(*static_cast<Decoder*>(decoder));
#endif
  if (static_cast<Decoder*>(decoder)->stage_copy != nullptr)
    ts_paged_step_copy_delete(static_cast<Decoder*>(decoder)->stage_copy);
  delete static_cast<Decoder*>(decoder);
}

// Whether a step launched by this process (ts_decoder_launch) has not completed: no other step may run meanwhile.
static bool launched_step_runs(const Decoder& d) {
  return d.async != nullptr && d.async->owner == getpid() &&
         d.async->completed.load(std::memory_order_acquire) != d.async->launched.load(std::memory_order_relaxed);
}

// One step: input_ids and positions [num_tokens] (int64), logits [num_logits, vocab] of the rows logits_rows
// (int64) in the model's dtype, and where argmax is not null each logits row's argmax (int64, as ts_argmax), found
// while the logits are in cache: called from Python after the step, the argmax took 100-120 us against 9-12 us
// for a second call (a bf16 batch-1 step of the 106M model, whose weights had gone through the caches;
// docs/performance.md). The step's paged attention must be installed (ts_install_paged_step). Returns 0; -200 for
// a token count out of range, -201 for a token id or row outside the vocabulary or the step, -202 while a launched
// step (below) runs, -300 where a tensor-parallel rank's all-reduce or all-gather or a sequence-parallel rank's
// all-to-all failed (ts_collective_error); else the failing kernel's code. A rank's shard of the vocabulary gathers
// every rank's rows of the logits [num_logits, vocab] through its communicator; a decoder without an LM head writes
// the rows' final hidden states, after the model's last norm (logits [num_logits, hidden]), and no argmax.
// `first_stage` (> 0): a batch-1 check in two stages, as a launched one's (run_in_stages; -200 where it cannot), or
// with `redraft` (non-null) in stages drafted here after the first (run_redrafting).
int ts_decoder_step(void* decoder, const int64_t* input_ids, const int64_t* positions, int64_t num_tokens,
                    const int64_t* logits_rows, int64_t num_logits, void* logits, int64_t* argmax,
                    int64_t first_stage, Redraft* redraft) {
  Decoder& d = *static_cast<Decoder*>(decoder);
  if (launched_step_runs(d)) return -202;
  if (first_stage == 0)
    return run_step(d, input_ids, positions, num_tokens, logits_rows, num_logits, logits, argmax, nullptr);
  // the installed step copied, to narrow it to each stage (not with Ulysses' all-to-alls around the paged step)
  if (num_tokens > d.max_tokens || ts_ulysses_installed() ||
      !stages_ok(num_tokens, logits_rows, num_logits, argmax, nullptr, first_stage))
    return -200;
  if (d.stage_copy == nullptr) d.stage_copy = ts_paged_step_copy_new();
  if (redraft != nullptr && !redraft_ok(d, *redraft)) return -200;
  if (ts_paged_step_copy_fill(d.stage_copy) != 0) return -100;
  if (redraft != nullptr) {
    std::vector<int64_t> ids(input_ids, input_ids + num_tokens);
    std::vector<int64_t> history(redraft->history, redraft->history + redraft->history_len);
    return run_redrafting(d, ids.data(), positions, num_tokens, first_stage, logits_rows, logits, argmax,
                          d.stage_copy, *redraft, history);
  }
  return run_in_stages(d, input_ids, positions, num_tokens, first_stage, logits_rows, logits, argmax, d.stage_copy);
}

// Up to `num_steps` decode steps of a multi-step run (ModelRunner._run_steps), as that many ts_decoder_step calls
// with argmax (required) without returning to Python between them: token i is run i and logits row i (decodes only);
// after each step but the last, each token's input id becomes its row's argmax and its position, its run's cached
// tokens (`num_computed`, int32, which the installed step reads in place) and its KV slot (`slot_mapping`, read so
// too: block_table[table_rows[i]][position / tokens_per_block] * tokens_per_block + position % tokens_per_block)
// move one further. The run ends after the first step in which some row draws one of `stop_ids` (num_stop_ids of
// them, sorted: the run's requests' end and stop tokens, torch_shift.engine.step_plan's; every rank of a layout draws
// the same rows, so ends alike), or, where
// `limit` is not null, as torch_shift.parallel.runs describes: the words every rank shares, `limit` the run's
// ((run << 16) | steps), which the `leader` writes at the start of each step (its steps, then the step's number + 1
// once `interrupt` is set) and every rank reads after it. Each row's token is its argmax, or where `draws` is not null
// (float32 [num_steps, 5, num_tokens]: each step's ts_sample_rows draws) the one drawn with them. drawn [num_steps,
// num_tokens] gets each step's tokens; logits hold the last step's. Returns the steps run (>= 1), or the codes of
// ts_decoder_step; -200 also for num_steps out of 1-65535.
int ts_decoder_steps(void* decoder, int64_t* input_ids, int64_t* positions, int64_t num_tokens,
                     const int64_t* logits_rows, void* logits, int64_t* argmax, int64_t num_steps, int64_t* drawn,
                     int32_t* num_computed, int64_t* slot_mapping, const int32_t* block_table, int64_t table_stride,
                     const int32_t* table_rows, int64_t tokens_per_block, const int64_t* stop_ids,
                     int64_t num_stop_ids, int64_t* limit, const int64_t* interrupt, int64_t run, int leader,
                     const float* draws) {
  if (num_steps < 1 || num_steps > kRunSteps || argmax == nullptr || tokens_per_block < 1 || num_stop_ids < 0 ||
      (limit != nullptr && interrupt == nullptr))
    return -200;
  Decoder& d = *static_cast<Decoder*>(decoder);
  if (launched_step_runs(d)) return -202;
  for (int64_t s = 0; s < num_steps; ++s) {
    if (limit != nullptr && leader) lead_run_step(limit, interrupt, run, num_steps, s);
    const int rc = run_step(d, input_ids, positions, num_tokens, logits_rows, num_tokens, logits, argmax, nullptr,
                            draws == nullptr ? nullptr : draws + s * 5 * num_tokens);
    if (rc != 0) return rc;
    std::memcpy(drawn + s * num_tokens, argmax, num_tokens * sizeof(int64_t));
    if (s + 1 == num_steps) break;
    for (int64_t i = 0; i < num_tokens; ++i)
      if (std::binary_search(stop_ids, stop_ids + num_stop_ids, argmax[i])) return static_cast<int>(s + 1);
    if (limit != nullptr && run_ends_after(limit, run, s + 1)) return static_cast<int>(s + 1);
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t position = ++positions[i];
      input_ids[i] = argmax[i];
      ++num_computed[i];
      slot_mapping[i] = int64_t(block_table[table_rows[i] * table_stride + position / tokens_per_block]) *
                            tokens_per_block + position % tokens_per_block;
    }
  }
  return static_cast<int>(num_steps);
}

// A sequence-parallel rank's part in a step that gives it no tokens (fewer than SP ranks): each layer's Ulysses
// attention with no rows of its own, which brings the other ranks' q/k/v of its head chunk, attends them and sends the
// outputs back (ts_step_attention), the layers one after another without returning to Python between them. Its waits
// for the others' layers are asleep (cpu_ops.cpp's idle wait), their linears on its core. 0; -100 where no Ulysses
// step is installed; -202 while a launched step runs; -300 where an all-to-all failed (ts_collective_error).
int ts_decoder_attend(void* decoder) {
  Decoder& d = *static_cast<Decoder*>(decoder);
  if (launched_step_runs(d)) return -202;
  if (!ts_ulysses_installed()) return -100;
  const int64_t hd = d.head_dim, q_size = d.heads * hd, kv_size = d.kv_heads * hd;
  for (const Layer& L : d.layers) {
    const int rc = ts_step_attention(nullptr, L.kv_layer, d.q.data(), q_size, hd, d.k.data(), kv_size, hd, d.k.data(),
                                     kv_size, hd, 0, d.heads, d.kv_heads, hd, L.window, d.attn.data());
    if (rc != 0) return rc;
  }
  return 0;
}

// Launch a step (as ts_decoder_step's, argmax required) to run on the decoder's own thread, after those launched
// before it, with the paged step installed now (copied): returns its ticket (> 0) at once, or -200 for a count out
// of range, -100 where no step is installed, -203 where the system refused the thread. The caller keeps logits and
// argmax alive until it waited for the ticket. `placeholders` (num_placeholders of them, or null): indices of input
// ids that the step launched just before this one sampled, taken from its argmax rows `sources` when this one starts.
// `draws` (or null): ts_sample_rows' float32 [5, num_logits], copied: each row's token is drawn by them into argmax
// (and read so by the next step's placeholders) instead of its argmax. `first_stage` (> 0, below num_tokens): a
// batch-1 check whose every token is a logits row, with argmax and no draws or placeholders, run in two stages of
// that many tokens and the rest (run_in_stages); 0: one stage. `redraft` (or null; with first_stage): the stages
// after the first drafted here (run_redrafting), its history and stop tokens copied, its stage counts written.
int64_t ts_decoder_launch(void* decoder, const int64_t* input_ids, const int64_t* positions, int64_t num_tokens,
                          const int64_t* logits_rows, int64_t num_logits, void* logits, int64_t* argmax,
                          const int64_t* placeholders, const int64_t* sources, int64_t num_placeholders,
                          const float* draws, int64_t first_stage, const Redraft* redraft) {
#if defined(__linux__)
  Decoder& d = *static_cast<Decoder*>(decoder);
  if (num_tokens < 1 || num_tokens > d.max_tokens || num_logits < 0 || num_logits > num_tokens || argmax == nullptr ||
      num_placeholders < 0 || num_placeholders > num_tokens || first_stage < 0 || first_stage >= num_tokens)
    return -200;
  if (first_stage > 0 && (num_placeholders != 0 ||
                          !stages_ok(num_tokens, logits_rows, num_logits, argmax, draws, first_stage)))
    return -200;
  if (redraft != nullptr && !redraft_ok(d, *redraft)) return -200;
  for (int64_t i = 0; i < num_placeholders; ++i)
    if (placeholders[i] < 0 || placeholders[i] >= num_tokens) return -200;
  if (!start_async(d)) return -203;
  Async& a = *d.async;
  const int64_t ticket = a.launched.load(std::memory_order_relaxed) + 1;
  if (a.completed.load(std::memory_order_acquire) < ticket - kQueue) ts_gemv_pool_help(&a.completed, ticket - kQueue);
  Launched& s = a.steps[(ticket - 1) % kQueue];
  if (ts_paged_step_copy_fill(s.attention) != 0) return -100;
  s.input_ids.assign(input_ids, input_ids + num_tokens);
  s.positions.assign(positions, positions + num_tokens);
  s.logits_rows.assign(logits_rows, logits_rows + num_logits);
  s.placeholders.assign(placeholders, placeholders + num_placeholders);
  s.sources.assign(sources, sources + num_placeholders);
  if (draws != nullptr)
    s.draws.assign(draws, draws + 5 * num_logits);
  else
    s.draws.clear();
  s.logits = logits;
  s.argmax = argmax;
  s.first_stage = first_stage;
  s.redrafts = redraft != nullptr && first_stage > 0;
  if (s.redrafts) {  // the caller's stage counts stay its own (alive until it waited for the ticket)
    s.history.assign(redraft->history, redraft->history + redraft->history_len);
    s.stop_ids.assign(redraft->stop_ids, redraft->stop_ids + redraft->num_stops);
    s.redraft = *redraft;
    s.redraft.history = s.history.data();
    s.redraft.stop_ids = s.stop_ids.data();
  }
  a.launched.store(ticket, std::memory_order_seq_cst);
  wake(a);
  return ticket;
#else
  return -203;
#endif
}

// Wait for the launched step `ticket`, helping with its GEMVs meanwhile: its ts_decoder_step code (-201 also for a
// placeholder's source outside the argmax rows of the step before), or -204 for a ticket not launched or too old.
int ts_decoder_wait(void* decoder, int64_t ticket) {
#if defined(__linux__)
  Decoder& d = *static_cast<Decoder*>(decoder);
  if (d.async == nullptr || d.async->owner != getpid()) return -204;
  Async& a = *d.async;
  const int64_t launched = a.launched.load(std::memory_order_relaxed);
  if (ticket < 1 || ticket > launched || ticket <= launched - kResults) return -204;
  if (a.completed.load(std::memory_order_acquire) < ticket) ts_gemv_pool_help(&a.completed, ticket);
  return a.results[ticket % kResults];
#else
  return -204;
#endif
}

// silu_mul alone with PyTorch's exp of `lanes` floats, for the check that it reproduces PyTorch's
// `F.silu(gate) * up` on this machine (native_decoder.py): gate_up [tokens, 2 * intermediate] -> out
// [tokens, intermediate]
int ts_decoder_silu_mul(int dtype, int lanes, const void* gate_up, int64_t tokens, int64_t intermediate, void* out) {
  if ((lanes != 8 && lanes != 16) || !(ts_decoder_available() & lanes) || (dtype != 0 && dtype != 1)) return -1;
  silu_mul(gate_up, out, tokens, intermediate, dtype, lanes, at::get_num_threads());
  return 0;
}

}  // extern "C"
