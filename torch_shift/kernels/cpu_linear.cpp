// A matmul of a few rows against a weight in oneDNN's blocked layout: the decode step's GEMV, read at the
// rate memory streams it.
//
// oneDNN's packed inner-product weight on AVX-512 CPUs (what torch.ops.mkldnn._reorder_linear_weight gives
// for the large-batch path) keeps blocks of 64 output features, each block's rows of K contiguous:
//   float32:  element (n, k) at ((n / 64) * K + k) * 64 + n % 64
//   bfloat16: element (n, k) at (((n / 64) * (K / 2) + k / 2) * 64 + n % 64) * 2 + k % 2   (pairs of k, VNNI)
// and on CPUs with AMX (Sapphire Rapids and later), bfloat16 in blocks of 32 output features:
//   bfloat16: element (n, k) at (((n / 32) * (K / 2) + k / 2) * 32 + n % 32) * 2 + k % 2
// which is the tile unit's layout for its second operand: the kernel runs it there (amx_block), a block of 32 features
// at a time, up to 32 rows of x against each tile of the weight (where the compiler has no AMX intrinsics, K is no
// multiple of 32, Linux refuses the process the tiles' state or ts_gemv_amx turned them off, in AVX512-BF16 dot
// products, two blocks at a time: 64 features, as in the other layouts).
// Each block is one contiguous stream of 64 * K elements (32 * K on the tile unit), so a thread walking its blocks in
// order reads memory sequentially and every weight element once for all rows of x. The caller checks the layout on the
// real weight before it uses this kernel (torch_shift/models/linear.py), so a oneDNN that packs differently
// only loses the fast path.
//
// oneDNN's own one-row matmul on this layout reads about 21 GB/s on 2 cores, against 33 GB/s for a
// streaming sum (docs/performance.md, issue 20).
//
// CPUs with AVX2 but not AVX-512 get torch_shift's own layout instead (namespace avx2, ts_blocked_linear): the same
// kernel for every row count, float32 or bfloat16.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)  // AVX-512 paths, chosen at run time; elsewhere the kernel declines and oneDNN runs
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <array>
#include <mutex>
#include <new>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "cpu_threads.h"

namespace {

constexpr int64_t kBlock = 64;
constexpr int kMaxRows = 6;  // 6 x 4 accumulators, 4 weight vectors and x: 29 of the 32 AVX-512 registers
// Up to this many rows run as one group all the same: their accumulators spill a few registers to L1, which costs
// less than a second group's read of each block again (from L2, its dot products not overlapping the first group's
// stream from memory). 8 layers of the 106M model's linears on 2 Zen 4 cores, one group against groups of up to 6
// (bench/ab_cpu_linear.py --kernel packed): 7-9 rows 1.11-1.19x in bfloat16 and 1.36-1.54x in float32; 10 rows in
// one group spilled more and ran 0.78x in bfloat16, so from 10 rows on the groups are of up to kMaxRows again
// (float32's 10-14 rows, 10-17 on Intel CPUs, run in half blocks instead: F32HalfBlock; bfloat16's from 9 rows on:
// Bf16HalfBlock).
// (The AVX2 kernel's 16 registers spill too much for this: 7-9 rows in one group ran 0.62-0.71x there.)
constexpr int kMaxOneGroup = 9;

inline int64_t row_groups(int64_t rows) { return rows <= kMaxOneGroup ? 1 : (rows + kMaxRows - 1) / kMaxRows; }

__attribute__((target("avx512f"))) inline __m512 load_bias_f32(const float* bias, int64_t n) {
  return bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
}

// oneDNN's float32 matmul (brgemm, AVX-512 and AMX CPUs) sums K in runs of this many k-steps, each run a chain of
// FMAs from zero, the runs' sums added in order, then the bias (its blocking heuristic for AVX-512: 1024 k-steps
// where K > 1024, else 512; measured alike from 17 to 2,048 rows and 64 to 14,336 features). The GEMV sums so too,
// so that a row's outputs are the same bits through either: a token's logits then do not depend on its step's row
// count. Not where oneDNN splits K over threads (float32 with K of 20,000 or more and few rows and features), nor on
// another oneDNN that blocks otherwise: `PackedWeight.rounds_as_onednn` (models/linear.py) checks a weight.
inline int64_t onednn_k_run(int64_t K) { return K <= 1024 ? 512 : 1024; }

// The GEMVs' weight streams are prefetched this far ahead (float32: two of each k-step's four lines; bfloat16: a line
// of each half-block's stream a k-pair; the other line of a 128-byte pair comes with each): the weights of a decode
// step stream from memory, and the out-of-order window alone kept too few of their lines in flight, fewer the more
// rows (each row's products queue behind the loads). Eight cold weights in turn, 2 threads of an AMX Xeon, alternated
// in one process, GB/s without and with it: float32 5,632 x 1,024 at 1 / 2 / 4 / 8 rows 34 / 31 / 24 / 20 against
// 36 / 36 / 28 / 24; bfloat16 49,152 x 192 at 1 / 2 / 4 rows 33 / 26 / 22 against 34 / 31 / 29, 5,632 x 1,024 45 /
// 36 / 28 against 51 / 49 / 50. 2, 8 and 16 KiB measured too (16 KiB: the first bf16 shape's 4 rows faster, 34 GB/s,
// the second's slower, 44).
constexpr int64_t kStreamAheadBytes = 4096;
// A block run as one group of rows (up to kMaxOneGroup) also requests every line of its stream this far ahead into L2
// (prefetcht2): the stream's rate fell from 28 GB/s at one row to 19 at eight, the products' time adding
// to the reads' instead of hiding under them. bench/ab_cpu_linear.py --kernel packed (8 layers of the 106M model's
// linears, 2 threads of an AMX Xeon), float32 at 1 / 2 / 3 / 4 / 6 / 8 / 9 rows: 1.01-1.04 / 1.02-1.04 / 1.13 /
// 1.18-1.23 / 1.43 / 1.26-1.34 / 1.32x; two of the four lines, 0.97-1.00x; 32-128 KiB ahead alike; prefetchnta 0.4x.
// bfloat16's dot products (AMX off): 1.03 / 1.09 / 1.15 / 1.06x at 1 / 2 / 4 / 8 rows. Not for blocks of several
// groups, which request the next block already (16 rows with the weights in L3: 0.80x), nor on the tile unit
// (1.01-1.04x, in the spread). On a Zen 4 EPYC (family 25, model 17), the same command: float32 at 1 / 4 / 8 / 9 rows
// 1.07-1.15 / 1.17-1.22 / 1.54-1.68 / 1.93-2.08x, bfloat16 at 1 / 2 / 4 / 6 / 8 / 9 rows 1.34 / 1.22 / 1.58 / 2.04 /
// 1.98 / 1.55x (against the near requests alone).
constexpr int64_t kL2AheadBytes = 65536;
bool intel_cpu() {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
}
const bool on_intel = intel_cpu();  // what was measured there only: every group requesting the next block's lines

// Which of the two requests a block of R rows makes. On a Zen 4 EPYC one group's stream of up to 5 rows reads fastest
// with neither (a loop without requests reads the weights at the rate of a sum over them, with the near ones at 0.7
// of it); from 6 rows on it still wants the far ones. bench/ab_cpu_linear.py --kernel packed (as above) against every
// request, 2 threads: bfloat16 at 1 / 2 / 3 / 4 / 5 rows 1.11-1.15 / 1.08-1.16 / 1.06 / 1.07-1.16 / 1.09x, float32
// 1.18-1.26 / 1.08-1.10 / 1.12 / 1.08-1.15 / 1.09x, 6-9 rows 0.92-1.07x; one thread (a rank of two): bfloat16 1.11 /
// 1.32 / 1.30 / 1.39 / 1.23x, float32 1.08 / 1.18 / 1.25 / 1.15 / 1.30x, 6-9 rows 0.93-1.09x. Without the far
// requests at 6-9 rows too, against with them: float32 0.78-0.88x, bfloat16 0.79-1.16x (one thread at 8 rows 0.79x).
// Several groups' blocks (float32 from 15 rows) and half blocks keep every request (without the near ones:
// 0.92-1.10x, 0.94-1.04x; bfloat16's half blocks with no requests at all 0.65-0.78x). Measured on Zen 4 only; other
// AMD CPUs with these kernels (Zen 5) follow it unmeasured.
inline bool near_requests(bool one_group) { return on_intel || !one_group; }
inline bool far_requests(bool one_group, int rows) { return one_group && (on_intel || rows >= 6); }

// A run of k-steps' sums (R rows of V vectors, features f0 on) into `out`: the first run's stored, a later one's added
// to what the runs before it left (exact), the bias after the last; oneDNN's order (onednn_k_run)
template <int R, int V>
__attribute__((target("avx512f"))) inline void store_run(const __m512 (&acc)[R][V], float* out, int64_t out_stride,
                                                          int64_t f0, const float* bias, bool first, bool last) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) {
      float* o = out + r * out_stride + f0 + 16 * j;
      __m512 y = first ? acc[r][j] : _mm512_add_ps(_mm512_loadu_ps(o), acc[r][j]);
      if (last) y = _mm512_add_ps(y, load_bias_f32(bias, f0 + 16 * j));
      _mm512_storeu_ps(o, y);
    }
}

// R rows of x against the weight's blocks [begin, end); one struct per dtype, so that run_rows picks R.
template <int R>
struct F32Rows {
  __attribute__((target("avx512f"))) static void run(const float* x, int64_t x_stride, const float* w, int64_t K,
                                                     const float* bias, float* out, int64_t out_stride,
                                                     int64_t begin, int64_t end, const char* prefetch = nullptr,
                                                     int64_t prefetch_lines = 0, bool one_group = false) {
    const int64_t run_length = onednn_k_run(K);
    int64_t credit = 0;  // prefetch: k-steps' shares of lines not yet requested, in units of 1 / K line
    const bool near = near_requests(one_group), far = far_requests(one_group, R);
    for (int64_t b = begin; b < end; ++b) {
      const float* wb = w + b * kBlock * K;
      const int64_t n = b * kBlock;
      __m512 acc[R][4];
      for (int64_t k0 = 0; k0 < K; k0 += run_length) {
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
        const int64_t k1 = std::min(K, k0 + run_length);
        for (int64_t k = k0; k < k1; ++k) {
          if (prefetch) {  // the range's lines spread evenly over the K k-steps (no division in the loop)
            for (credit += prefetch_lines; credit >= K; credit -= K, prefetch += 64) __builtin_prefetch(prefetch, 0, 1);
          }
          const float* wk = wb + k * kBlock;
          if (near) {
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kStreamAheadBytes, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wk) + kStreamAheadBytes + 128, _MM_HINT_T0);
          }
          if (far) {
            const char* lines = reinterpret_cast<const char*>(wk) + kL2AheadBytes;
            _mm_prefetch(lines, _MM_HINT_T2);
            _mm_prefetch(lines + 64, _MM_HINT_T2);
            _mm_prefetch(lines + 128, _MM_HINT_T2);
            _mm_prefetch(lines + 192, _MM_HINT_T2);
          }
          const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
          const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
          for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
            acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(w2, xv, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(w3, xv, acc[r][3]);
          }
        }
        store_run(acc, out, out_stride, n, bias, k0 == 0, k1 == K);
      }
    }
  }
};

// R rows of x against half a block (its vectors v0 and v0 + 1 of 16 features: 128 bytes of each k-step's 256) in one
// pass; f32_block_in_halves runs 10-17 rows so, the block in two halves. With two accumulators a row the rows stay in
// registers (a few spill from 15 on), and each half's lines stream from memory once, requested ahead as one group's
// are, where groups of up to 6 rows read the block again from L2 while memory waits. bench/ab_cpu_linear.py --kernel
// packed (as above) at 10 / 12 / 14 / 15 / 16 / 17 rows: 1.13 / 1.10-1.13 / 1.15-1.17 / 1.10 / 1.08 / 1.07x; with the
// weights in L3 1.05 / 1.05 / 0.91 at 10 / 12 / 14 and 0.82-0.83 at 16-17 (a group's broadcast of x feeds four
// products, a half's two). 18 rows 0.71x (spills); a quarter block of one vector at 15-28 rows 0.44-0.84x (one product
// a broadcast). On a Zen 4 EPYC, against one group's rows requested ahead: 10 / 11 / 12 / 13 / 14 rows 1.45-1.47 /
// 1.17-1.18 / 1.16-1.17 / 1.08-1.17 / 1.06-1.07x, 15 / 16 / 17 rows 0.90-0.92 / 0.79 / 0.70x (half_block_max_rows).
// Each output the same chain of FMAs as F32Rows', stored as theirs (store_run).
template <int R>
struct F32HalfBlock {
  __attribute__((target("avx512f"))) static void run(const float* x, int64_t x_stride, const float* wb, int64_t K,
                                                     const float* bias, float* out, int64_t out_stride, int64_t n,
                                                     int v0) {
    const int64_t run_length = onednn_k_run(K);
    __m512 acc[R][2];
    for (int64_t k0 = 0; k0 < K; k0 += run_length) {
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      const int64_t k1 = std::min(K, k0 + run_length);
      for (int64_t k = k0; k < k1; ++k) {
        const float* wk = wb + k * kBlock + 16 * v0;
        const char* lines = reinterpret_cast<const char*>(wk);
        _mm_prefetch(lines + kStreamAheadBytes, _MM_HINT_T0);
        _mm_prefetch(lines + kStreamAheadBytes + 64, _MM_HINT_T0);
        _mm_prefetch(lines + kL2AheadBytes, _MM_HINT_T2);
        _mm_prefetch(lines + kL2AheadBytes + 64, _MM_HINT_T2);
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
          acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
        }
      }
      store_run(acc, out, out_stride, n + 16 * v0, bias, k0 == 0, k1 == K);
    }
  }
};

constexpr int kMaxHalfBlockRows = 17;
const int64_t half_block_max_rows = on_intel ? kMaxHalfBlockRows : 14;
using HalfBlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                             int);

template <int... I>  // rows kMaxOneGroup + 1 + I
constexpr std::array<HalfBlockFn, sizeof...(I)> half_block_fns(std::integer_sequence<int, I...>) {
  return {&F32HalfBlock<kMaxOneGroup + 1 + I>::run...};
}
constexpr auto kHalfBlockFns = half_block_fns(std::make_integer_sequence<int, kMaxHalfBlockRows - kMaxOneGroup>());

// rows (kMaxOneGroup, kMaxHalfBlockRows] of x against block b of a float32 weight, half by half
void f32_block_in_halves(const float* x, int64_t x_stride, int64_t rows, const float* w, int64_t K, const float* bias,
                         float* out, int64_t out_stride, int64_t b) {
  const HalfBlockFn run = kHalfBlockFns[rows - kMaxOneGroup - 1];
  for (int v0 = 0; v0 < 4; v0 += 2) run(x, x_stride, w + b * kBlock * K, K, bias, out, out_stride, b * kBlock, v0);
}

__attribute__((target("avx512f"))) inline __m512 bf16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// x's pair of bfloat16 at p (two consecutive k) in every lane pair: a row's operand of _mm512_dpbf16_ps
__attribute__((target("avx512f,avx512bf16"))) inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// 16 float32 sums, plus the bias's features f to f + 15 where there is one, rounded to bfloat16 at out[f]
__attribute__((target("avx512f,avx512bf16,avx512bw"))) inline void store_bf16_sums(__m512 sums, const uint16_t* bias,
                                                                                   uint16_t* out, int64_t f) {
  if (bias) sums = _mm512_add_ps(sums, bf16_to_f32(bias + f));
  _mm256_storeu_si256((__m256i*)(out + f), (__m256i)_mm512_cvtneps_pbh(sums));
}

// kHalves: the weight in oneDNN's AMX layout, a block of 64 features as two blocks of 32 (the header's formulas)
template <int R, bool kHalves>
struct Bf16Rows {
  static constexpr bool halves = kHalves;
  __attribute__((target("avx512f,avx512bf16,avx512bw"))) static void run(
      const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, const uint16_t* bias, uint16_t* out,
      int64_t out_stride, int64_t begin, int64_t end, const char* = nullptr, int64_t = 0, bool one_group = false) {
    constexpr int64_t kWidth = kHalves ? kBlock / 2 : kBlock;  // features a k-pair row of the stream holds
    const bool near = near_requests(one_group), far = far_requests(one_group, R);
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* wb = w + b * kBlock * K;
      const uint16_t* wb_high = kHalves ? wb + kWidth * K : wb + 64;  // features 32-63
      __m512 acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* wk = wb + k * kWidth;  // features 0-31 x 2 consecutive k
        const uint16_t* wk_high = wb_high + k * kWidth;
        if (near) {
          _mm_prefetch(reinterpret_cast<const char*>(wk) + kStreamAheadBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(wk_high) + kStreamAheadBytes, _MM_HINT_T0);
        }
        if (far) {
          const char* lines = reinterpret_cast<const char*>(wk) + kL2AheadBytes;
          const char* lines_high = reinterpret_cast<const char*>(wk_high) + kL2AheadBytes;
          _mm_prefetch(lines, _MM_HINT_T2);
          _mm_prefetch(lines + 64, _MM_HINT_T2);
          _mm_prefetch(lines_high, _MM_HINT_T2);
          _mm_prefetch(lines_high + 64, _MM_HINT_T2);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk_high), w3 = (__m512bh)_mm512_loadu_si512(wk_high + 32);
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = broadcast_pair(x + r * x_stride + k);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
          acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xv);
          acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xv);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) store_bf16_sums(acc[r][j], bias, out + r * out_stride, b * kBlock + 16 * j);
    }
  }
};

// R rows of bfloat16 x against half a block (features 32 h to 32 h + 31, two of Bf16Rows' four vectors) in one pass;
// bf16_block_in_halves runs 9-17 rows so, the block in two halves, and more rows in sets of up to 17, each set's halves
// in turn: as F32HalfBlock, two accumulators a row keep the rows in registers where four spilled (9 rows: 36 of the
// 32), and each half's lines stream from memory once where groups of up to 6 read the block from L2 again.
// bench/ab_cpu_linear.py --kernel packed (8 layers of the 106M model's linears, 2 threads of a Zen 4 EPYC), against
// one group of 9 rows and groups of up to 6 beyond: 9 / 10 / 11 / 12 / 13 / 14 / 15 / 16 / 17 rows 1.01-1.04 / 1.48 /
// 1.47 / 1.39-1.40 / 1.53 / 1.43-1.70 / 1.58-1.79 / 1.50-1.54 / 1.42-1.48x, 18 / 20 / 24 / 32 / 40 / 48 / 64 rows (in
// sets) 1.48 / 1.40 / 1.45 / 1.19 / 1.19 / 1.14 / 1.11x; 18 and 20 rows in one set spill, 0.53-0.58x; 5-8 rows in
// halves 0.93-1.03x. (float32 in sets of up to 14 at 20-64 rows: 0.86-1.01x, its products bound there.) Each output
// the same chain of dot products as Bf16Rows', stored as theirs.
template <int R, bool kHalves>
struct Bf16HalfBlock {
  __attribute__((target("avx512f,avx512bf16,avx512bw"))) static void run(
      const uint16_t* x, int64_t x_stride, const uint16_t* wb, int64_t K, const uint16_t* bias, uint16_t* out,
      int64_t out_stride, int64_t n, int half) {
    constexpr int64_t kWidth = kHalves ? kBlock / 2 : kBlock;
    const uint16_t* ws = half == 0 ? wb : kHalves ? wb + kWidth * K : wb + 64;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
      const uint16_t* wk = ws + k * kWidth;
      const char* lines = reinterpret_cast<const char*>(wk);
      _mm_prefetch(lines + kStreamAheadBytes, _MM_HINT_T0);
      _mm_prefetch(lines + kL2AheadBytes, _MM_HINT_T2);
      _mm_prefetch(lines + kL2AheadBytes + 64, _MM_HINT_T2);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = broadcast_pair(x + r * x_stride + k);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) store_bf16_sums(acc[r][j], bias, out + r * out_stride, n + 32 * half + 16 * j);
  }
};

constexpr int kBf16HalfFirstRows = 9, kBf16HalfLastRows = 17;
using Bf16HalfBlockFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*,
                                 int64_t, int64_t, int);

template <bool kHalves, int... I>  // rows kBf16HalfFirstRows + I
constexpr std::array<Bf16HalfBlockFn, sizeof...(I)> bf16_half_block_fns(std::integer_sequence<int, I...>) {
  return {&Bf16HalfBlock<kBf16HalfFirstRows + I, kHalves>::run...};
}
template <bool kHalves>
constexpr auto kBf16HalfBlockFns =
    bf16_half_block_fns<kHalves>(std::make_integer_sequence<int, kBf16HalfLastRows - kBf16HalfFirstRows + 1>());

// rows [kBf16HalfFirstRows, kBf16HalfLastRows] of x against block b of a bfloat16 weight, half by half
template <bool kHalves>
void bf16_block_in_halves(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* w, int64_t K,
                          const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t b) {
  const Bf16HalfBlockFn run = kBf16HalfBlockFns<kHalves>[rows - kBf16HalfFirstRows];
  for (int half = 0; half < 2; ++half) run(x, x_stride, w + b * kBlock * K, K, bias, out, out_stride, b * kBlock, half);
}

template <int R>
using Bf16Rows64 = Bf16Rows<R, false>;
template <int R>
using Bf16Rows32 = Bf16Rows<R, true>;

#ifdef TS_AMX_INTRINSICS

std::atomic<bool> amx_gemv_enabled{true};  // ts_gemv_amx: off to compare with the dot products

// The tiles this thread has configured for amx_pass (0: none; else 32 m0 + m1: its passes' two groups of rows): a
// thread releases them after its blocks of a matmul (amx_release)
thread_local int amx_configured = 0;
constexpr int64_t kAmxBlock = 32;  // features a block of the AMX layout holds

// tmm0-1: m0 rows of 16 float32 sums (features 0-15 and 16-31 of a block of 32), tmm2-3 the same for the next m1 rows;
// tmm4: m0 rows of x, 16 pairs of k, tmm5 the next m1; tmm6-7: 16 pairs of k of 16 features
TS_AMX_TARGET void amx_configure(int m0, int m1) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t >= 6 ? 16 : (t < 2 || t == 4) ? m0 : m1;
    if (config.rows[t] == 0) config.colsb[t] = 0;  // a tile not used
  }
  load_tile_config(config);
  amx_configured = 32 * m0 + m1;
}

TS_AMX_TARGET void amx_release() {
  if (amx_configured) {
    _tile_release();
    amx_configured = 0;
  }
}

// Rows [0, m0 + m1) of x, m0 <= 16 and m1 <= 16, against block b of 32 features of a weight in oneDNN's AMX layout (a
// stream of K / 2 rows of 32 features x 2 k: the tile unit's own layout for B, 16 features a tile), each weight tile
// loaded once for both groups of rows: each sum in k order, pairs of products added as the unit adds them.
template <bool kTwoGroups>
TS_AMX_TARGET void amx_pass(const uint16_t* x, int64_t x_stride, int m0, int m1, const uint16_t* wb, int64_t K,
                            const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t n) {
  if (amx_configured != 32 * m0 + m1) amx_configure(m0, m1);
  const uint16_t* x1 = x + m0 * x_stride;
  _tile_zero(0);
  _tile_zero(1);
  if (kTwoGroups) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    const uint16_t* wk = wb + k * kAmxBlock;  // k-pair k / 2: 64 values, 128 bytes
    const char* ahead = reinterpret_cast<const char*>(wk) + kStreamAheadBytes;
    for (int i = 0; i < 2048; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);  // the k-step's 16 pairs
    _tile_loadd(6, wk, 128);
    _tile_loadd(7, wk + 32, 128);
    _tile_loadd(4, x + k, x_stride * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwoGroups) {
      _tile_loadd(5, x1 + k, x_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[32 * kAmxBlock];
  _tile_stored(0, sums, kAmxBlock * 4);
  _tile_stored(1, sums + 16, kAmxBlock * 4);
  if (kTwoGroups) {
    _tile_stored(2, sums + 16 * kAmxBlock, kAmxBlock * 4);
    _tile_stored(3, sums + 16 * kAmxBlock + 16, kAmxBlock * 4);
  }
  for (int r = 0; r < m0 + m1; ++r) {
    const float* row = sums + (r < m0 ? r : 16 + r - m0) * kAmxBlock;
    for (int j = 0; j < 2; ++j) {
      __m512 y = _mm512_load_ps(row + 16 * j);
      if (bias) y = _mm512_add_ps(y, bf16_to_f32(bias + n + 16 * j));
      _mm256_storeu_si256((__m256i*)(out + r * out_stride + n + 16 * j), (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

// All rows of x against block b of 32 features: passes of up to 32 rows (as equal as they can be), the block read from
// memory for the first and from L2 for the others. A row's bits do not depend on its pass or group.
TS_AMX_TARGET void amx_block(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* w, int64_t K,
                             const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t b) {
  const uint16_t* wb = w + b * kAmxBlock * K;
  const int64_t passes = (rows + 31) / 32;
  for (int64_t p = 0, r0 = 0; p < passes; ++p) {
    const int n = static_cast<int>((rows - r0) / (passes - p));
    const int m0 = std::min(n, 16);
    if (n > 16)
      amx_pass<true>(x + r0 * x_stride, x_stride, m0, n - m0, wb, K, bias, out + r0 * out_stride, out_stride,
                     b * kAmxBlock);
    else
      amx_pass<false>(x + r0 * x_stride, x_stride, m0, 0, wb, K, bias, out + r0 * out_stride, out_stride,
                      b * kAmxBlock);
    r0 += n;
  }
}

#endif

// Rows of x in groups (row_groups), as equal as they can be, against one block of the weight. The block (64 x K
// weights, at most a few hundred KiB) is read from memory for its first group and from L2 for the others, unless the
// block before it requested it (`next_block`: its groups each request a share of the next block's lines into L2).
// Which groups request: on Intel CPUs all of them, elsewhere the groups after the first. float32 at 18 / 20 / 24 / 32
// / 40 / 48 / 64 rows on an AMX Xeon, all against the groups after the first (bench/ab_cpu_linear.py --kernel packed,
// 8 layers of the 106M model's linears, 2 threads): 1.06-1.08 / 1.04 / 1.06 / 1.04 / 1.02 / 1.03 / 0.96-1.00x; every
// line requested in the first two groups 0.84-1.01x; every second, fourth or sixteenth line (for the L2's streamer to
// fill in) 0.78-0.90x; none 0.79-0.86x. On a Zen 4 EPYC all of them against the groups after the first: 0.98-1.05x at
// 15-64 rows, so there the groups after the first.
template <template <int> class Rows, typename T>
void rows_of_block(const T* x, int64_t x_stride, int64_t rows, const T* w, int64_t K, const T* bias, T* out,
                   int64_t out_stride, int64_t b, const T* next_block = nullptr) {
  if constexpr (std::is_same_v<T, float>) {
    if (rows > kMaxOneGroup && rows <= half_block_max_rows) {
      f32_block_in_halves(x, x_stride, rows, w, K, bias, out, out_stride, b);
      return;
    }
  } else if (rows >= kBf16HalfFirstRows) {
    const int64_t sets = (rows + kBf16HalfLastRows - 1) / kBf16HalfLastRows;
    for (int64_t g = 0, r0 = 0; g < sets; ++g) {
      const int64_t n = (rows - r0) / (sets - g);  // 9 or more, as rows > 17 (sets - 1)
      bf16_block_in_halves<Rows<1>::halves>(x + r0 * x_stride, x_stride, n, w, K, bias, out + r0 * out_stride,
                                            out_stride, b);
      r0 += n;
    }
    return;
  }
  const int64_t groups = row_groups(rows);
  const int64_t next_lines = next_block ? kBlock * K * int64_t(sizeof(T)) / 64 : 0;
  const bool one_group = groups == 1;  // near_requests, far_requests (several groups request the next block)
  const int64_t requesting = on_intel ? groups : groups - 1;  // the groups that request a share of the next block
  for (int64_t g = 0, r0 = 0; g < groups; ++g) {
    const int64_t n = (rows - r0) / (groups - g);
    const T* xr = x + r0 * x_stride;
    T* outr = out + r0 * out_stride;
    const char* pf = nullptr;
    int64_t pf_lines = 0;
    const int64_t share = on_intel ? g : g - 1;
    if (next_block && groups > 1 && share >= 0) {
      const int64_t first = share * next_lines / requesting, last = (share + 1) * next_lines / requesting;
      pf = reinterpret_cast<const char*>(next_block) + first * 64;
      pf_lines = last - first;
    }
    switch (n) {
      case 1: Rows<1>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 2: Rows<2>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 3: Rows<3>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 4: Rows<4>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 5: Rows<5>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 6: Rows<6>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 7: Rows<7>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      case 8: Rows<8>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
      default: Rows<9>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1, pf, pf_lines, one_group); break;
    }
    r0 += n;
  }
}

// Weights on CPUs with AVX2 and FMA but without the AVX-512 kernels above (Zen 3, many cloud VMs): torch_shift's own
// blocked layout, 16 output features a block, each block's rows of K contiguous:
//   element (n, k) at ((n / 16) * K + k) * 16 + n % 16
// float32, or bfloat16 where oneDNN would emulate bf16 at a sixth of its float32 rate (docs/performance.md, issue 20).
// A bfloat16 x is converted to float32 once a call, weights as they are read (the GEMV) or once a run of k-steps (the
// matmul); products of bf16 values are exact in float32 and the sums run in float32, the result rounded to bf16 once
// (as the bf16 dot-product instructions do). On 2 Zen 3 cores: 113-183 GFLOP/s at 512 rows, run to run (oneDNN's
// float32: 120-150), 1.2-1.8x oneDNN's rate at 4-16 rows (bench/bench_linear.py). Where the CPU has AVX-512 (its
// bfloat16 in these blocks for want of AVX512-BF16), the same loops run in 512-bit registers (tiles_on_avx512).
namespace avx2 {

#define TS_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t kBlock16 = 16;
constexpr int kRows16 = 6;  // 6 x 2 accumulators, 2 weight vectors and x: 15 of the 16 AVX2 registers

// R rows of x (float32) against B consecutive blocks of 16 features, their K rows bf16 (`W` uint16_t) or float32;
// y: R rows of B x 16 float32 sums, kPair apart. Each sum is one chain of FMAs in k order whatever R and B: two blocks
// at a time give one to three rows twice the chains to interleave, whose FMA latency (4 cycles on Zen 3) held the
// GEMV below the rate memory streams: 8 layers of the 106M model, 2 threads, 1.10-1.18x at one and two rows,
// 0.94-1.13x at three (bench/ab_cpu_linear.py; docs/performance.md, issue 20).
constexpr int64_t kPair = 2 * kBlock16;
// bfloat16 weights are prefetched this far ahead of each block's stream, a line every other k-step: 1-2 rows 1.05-1.17x
// on one thread and 1.02-1.13x on two (bench/ab_cpu_linear.py); float32's streams ran 0.85x with it
constexpr int64_t kBf16AheadBytes = 1024;
// and this far for groups of 3-6 rows taken a block at a time, whose k-steps take longer (their FMAs) while memory's
// latency stays: 8 layers of a TP-2 rank's MLP of the widened default model and of the 106M model's linears
// (bench/ab_cpu_linear.py, a Zen 3, same bits), on one thread and on two: 1.06-1.10x at 4 rows, 1.01-1.13x at 5-16
// (groups of them); 1-3 rows two blocks at a time kept 1 KiB (0.91-0.96x at 4 KiB)
constexpr int64_t kBf16ManyRowsAheadBytes = 4096;
// Weight vector v (8 features: block v / 2, half v % 2) of k-step k, as float32; bfloat16 streams prefetched ahead
template <typename W, int64_t kAheadBytes>
TS_AVX2 inline __m256 weight_vector(const W* w, int64_t K, int64_t k, int v) {
  const W* at = w + (v / 2) * kBlock16 * K + k * kBlock16 + (v % 2) * 8;
  if constexpr (sizeof(W) == 2)
    if (v % 2 == 0 && k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(at) + kAheadBytes, _MM_HINT_T0);
  return load8(at);
}

template <int R, int B, typename W, bool kAhead = false>
TS_AVX2 void rows_of_blocks(const float* x, int64_t x_stride, const W* w, int64_t K, float* y,
                            const W* ahead = nullptr) {
  // every weight vector of a k-step held while each row's x is broadcast once: that must fit the 16 registers, or
  // the weights be float32, read by the FMAs from memory (bfloat16 vectors taken in turn instead, every row's x
  // broadcast again for each, ran three rows of two blocks slower than four rows of one: rows_of_pair)
  static_assert(sizeof(W) == 4 || 2 * R * B + 2 * B + 1 <= 16, "more weight vectors and sums than AVX2's registers");
  constexpr int64_t kAheadBytes = R >= 3 ? kBf16ManyRowsAheadBytes : kBf16AheadBytes;
  __m256 acc[R][2 * B];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * B; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kBlock16), _MM_HINT_T1);
    __m256 wv[2 * B];
#pragma GCC unroll 4
    for (int v = 0; v < 2 * B; ++v) wv[v] = weight_vector<W, kAheadBytes>(w, K, k, v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
#pragma GCC unroll 4
      for (int v = 0; v < 2 * B; ++v) acc[r][v] = _mm256_fmadd_ps(wv[v], xv, acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 2 * B; ++v) _mm256_storeu_ps(y + r * kPair + v * 8, acc[r][v]);
}

// rows_of_blocks in 512-bit registers, a block of 16 features a register, on CPUs with AVX-512 (tiles_on_avx512): up to
// kRows512 rows against two blocks at a time (24 accumulators, where AVX2's 16 registers took two blocks up to 3 rows
// only, and groups of up to 6 rows that each read and converted the weights again), each sum the same chain of FMAs as
// rows_of_blocks'. Against the AVX2 loops on 2 cores of a Xeon without AVX512-BF16
// (bench/ab_cpu_linear.py, 16 layers of the 106M model's linears: from memory; same bits): bfloat16 1.01 / 1.03 / 1.33
// / 1.40 / 1.41x at 1 / 2 / 4 / 8 / 16 rows (176 GFLOP/s at 16), float32 1.06 / 1.04 / 1.38 / 1.47 / 1.50x, in groups of
// up to 6 rows; groups of up to 12 against those: bfloat16 1.25 / 1.29 / 1.11 / 1.03x at 8 / 12 / 16 / 24 rows (214
// GFLOP/s at 12), level at 1-6.
#define TS_AVX512_TILES __attribute__((target("avx512f,avx2,fma")))
bool avx512_cpu() {
  __builtin_cpu_init();  // (a static initializer may run before libgcc's own)
  return __builtin_cpu_supports("avx512f");
}
const bool tiles_on_avx512 = avx512_cpu();
constexpr int kRows512 = 12;  // a GEMV's group of rows in 512-bit registers

TS_AVX512_TILES inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TS_AVX512_TILES inline __m512 load16(const uint16_t* p) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

template <int R, int B, typename W>
TS_AVX512_TILES void rows_of_blocks512(const float* x, int64_t x_stride, const W* w, int64_t K, float* y) {
  __m512 acc[R][B];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[B];
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) {
      const W* at = w + b * kBlock16 * K + k * kBlock16;
      if constexpr (sizeof(W) == 2)
        if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(at) + kBf16AheadBytes, _MM_HINT_T0);
      wv[b] = load16(at);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(wv[b], xv, acc[r][b]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(y + r * kPair + b * kBlock16, acc[r][b]);
}

// The outputs of a row, bias added: float32 stored, bfloat16 rounded (load8: cpu_common.h)
TS_AVX2 inline void store8(__m256 v, float* out) { _mm256_storeu_ps(out, v); }
TS_AVX2 inline void store8(__m256 v, uint16_t* out) { store_bf16x8(v, out); }

// R rows of x against the one or two blocks of 16 features that start at `w`: one and two rows (three in float32) take
// both blocks at once; three bfloat16 rows one block at a time, whose weight vectors stay held (two blocks at once
// spilled them: 8 layers of a TP-2 rank's MLP of the widened default model, 1.29x on one Zen 3 core, and the
// one-process shapes 1.18x on two; the 106M model's linears 0.97-0.99x, same bits)
template <int R, typename W>
TS_AVX2 void rows_of_pair(const float* x, int64_t x_stride, const W* w, int64_t K, int64_t blocks, float* y,
                          int64_t blocks_after = 0) {
  if constexpr (R <= 2 || (R == 3 && sizeof(W) == 4)) {
    if (blocks == 2) {
      rows_of_blocks<R, 2>(x, x_stride, w, K, y);
      return;
    }
  }
  for (int64_t s = 0; s < blocks; ++s) {
    if constexpr (sizeof(W) == 4) {
      if (s + 1 < blocks + blocks_after) {
        rows_of_blocks<R, 1, W, true>(x, x_stride, w + s * kBlock16 * K, K, y + s * kBlock16,
                                      w + (s + 1) * kBlock16 * K);
        continue;
      }
    }
    rows_of_blocks<R, 1>(x, x_stride, w + s * kBlock16 * K, K, y + s * kBlock16);
  }
}

// rows_of_pair in 512-bit registers: `rows` (1 to kRows512) rows of x against the one or two blocks at `w`
template <typename W>
TS_AVX512_TILES void rows_of_pair512(int64_t rows, const float* x, int64_t x_stride, const W* w, int64_t K,
                                     int64_t blocks, float* y) {
  switch (rows * 2 + (blocks == 2)) {
#define TS_ROWS(R)                                                       \
  case 2 * R: return rows_of_blocks512<R, 1>(x, x_stride, w, K, y);      \
  case 2 * R + 1: return rows_of_blocks512<R, 2>(x, x_stride, w, K, y)
    TS_ROWS(1); TS_ROWS(2); TS_ROWS(3); TS_ROWS(4); TS_ROWS(5); TS_ROWS(6);
    TS_ROWS(7); TS_ROWS(8); TS_ROWS(9); TS_ROWS(10); TS_ROWS(11); TS_ROWS(12);
#undef TS_ROWS
    default: __builtin_unreachable();  // rows_range makes groups of 1 to kRows512 rows
  }
}

// rows [r0, r1) of x (float32, rows x_stride apart) against pair p of blocks (features [32 p, 32 p + 32), weights
// `w`: bfloat16 or float32), bias added, into out (T: float32 or bfloat16); the last block of N features not a
// multiple of 16 is padded with zero weights, and only its N % 16 outputs stored; the last pair of an odd number of
// blocks is one block
template <typename W, typename T>
TS_AVX2 void rows_range(const float* x, int64_t x_stride, int64_t r0, int64_t r1, const W* w, int64_t K,
                        const T* bias, T* out, int64_t out_stride, int64_t p, int64_t N) {
  alignas(64) float y[kRows512 * kPair];
  const int64_t n = p * kPair, width = std::min(kPair, N - n), blocks = (width + kBlock16 - 1) / kBlock16;
  T bias_pair[kPair] = {};
  if (bias) std::memcpy(bias_pair, bias + n, width * sizeof(T));
  __m256 bias_v[4];
  for (int v = 0; v < 4; ++v) bias_v[v] = load8(bias_pair + v * 8);
  const int64_t group_rows = tiles_on_avx512 ? kRows512 : kRows16;
  const int64_t groups = (r1 - r0 + group_rows - 1) / group_rows;
  // float32 rows of one block at a time (4-6) request the next block's lines, a second stream beside their own (one
  // stream read 16 GB/s a Zen 3 core, two blocks at a time 23-26): 1.04-1.26x at 4, 6 and 8 rows on one core and on
  // two, 0.96-1.10x at 5; bfloat16's rows there are bound by the FMAs, and ran 0.86-0.99x at 5-6 rows with it
  const int64_t ahead = sizeof(W) == 4 && groups == 1 && n + kPair < N ? 1 : 0;
  for (int64_t g = 0; g < groups; ++g) {
    // groups as equal as they can be; bfloat16 in AVX2 registers: full groups of kRows16, the rest last (a group of 6
    // runs its FMAs at the best rate of any count: 77-83 GFLOP/s on one Zen 3 core, 43-45 at 3 rows before they ran a
    // block at a time, 60-75 at 4). 8 layers of a TP-2 rank's MLP of the widened default model (bench/ab_cpu_linear.py,
    // a Zen 3, same bits), against equal groups: 1.07-1.20x at 7 rows, 1.05-1.08x at 8, 1.19x at 15, 0.97-1.11x at
    // 9-16; the 106M model's linears 1.02-1.07x at 7-16 rows. float32 (bound by reading the weights) 0.93-0.99x at 10
    // and 16 rows so.
    const int64_t rows = sizeof(W) == 2 && !tiles_on_avx512 ? std::min<int64_t>(kRows16, r1 - r0)
                                                            : (r1 - r0) / (groups - g);
    const float* xr = x + r0 * x_stride;
    if (tiles_on_avx512) {
      rows_of_pair512(rows, xr, x_stride, w, K, blocks, y);
    } else {
      switch (rows) {
        case 1: rows_of_pair<1>(xr, x_stride, w, K, blocks, y); break;
        case 2: rows_of_pair<2>(xr, x_stride, w, K, blocks, y); break;
        case 3: rows_of_pair<3>(xr, x_stride, w, K, blocks, y); break;
        case 4: rows_of_pair<4>(xr, x_stride, w, K, blocks, y, ahead); break;
        case 5: rows_of_pair<5>(xr, x_stride, w, K, blocks, y, ahead); break;
        default: rows_of_pair<6>(xr, x_stride, w, K, blocks, y, ahead); break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* o = out + (r0 + r) * out_stride + n;
      T part[kPair];
      T* to = width == kPair ? o : part;
      for (int64_t v = 0; v < blocks * 2; ++v)
        store8(_mm256_add_ps(_mm256_load_ps(y + r * kPair + v * 8), bias_v[v]), to + v * 8);
      if (to == part) std::memcpy(o, part, width * sizeof(T));
    }
    r0 += rows;
  }
}

// x (rows x K bf16, rows apart by x_stride) as float32, rows x K
TS_AVX2 void convert_rows(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t K, float* xf) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = x + r * x_stride;
    float* dst = xf + r * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8(src + k));
    for (; k < K; ++k) dst[k] = to_float(src[k]);
  }
}

// The matmul of many rows, in the loops of BLIS (Van Zee and van de Geijn, ACM TOMS 41(3), 2015): x packed once a
// call into panels of 6 rows, each run of kKc k-steps k-major (`pack_x`); the weights' blocks already hold a run of
// kKc k-steps of 16 features contiguous (a micro-panel: 16 KiB of float32, which stays in L1 while every panel of a
// row block runs against it), bfloat16 micro-panels converted once a run; a row block's packed x (kMcPanels panels,
// 120 KiB) stays in L2 while the kNcBlocks micro-panels of a chunk of blocks run against it, and those (128 KiB) are
// read from memory once a run and from L2 for the later row blocks. The sums of a 6 x 16 tile run in registers over
// a run of k-steps and wait in float32 between runs (`tile`), so that every output is the same chain of FMAs in k
// order as the GEMV's (rows_of_blocks): a row's result does not depend on how many rows the call has. Against the
// loop before, in which every group of 6 rows read its whole block (16 x K floats, 64-180 KiB) from L2: bfloat16
// 1.03-1.09x, float32 level, at 64-2,048 rows (bench/ab_cpu_linear.py; docs/performance.md, issue 20).
constexpr int64_t kKc = 256;
constexpr int64_t kMcPanels = 20;
constexpr int64_t kNcBlocks = 8;

// xp[((c * panels + p) * kKc + kk) * 6 + r] = x[6 p + r, c kKc + kk] as float32, rows past the last zero
template <typename T>
void pack_x(const T* x, int64_t x_stride, int64_t rows, int64_t K, float* xp) {
  const int64_t panels = (rows + kRows16 - 1) / kRows16, chunks = (K + kKc - 1) / kKc;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t valid = std::min<int64_t>(kRows16, rows - p * kRows16);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = c * kKc, kc = std::min(kKc, K - k0);
        float* dst = xp + (c * panels + p) * kKc * kRows16;
        for (int64_t r = 0; r < kRows16; ++r) {
          if (r >= valid) {
            for (int64_t kk = 0; kk < kc; ++kk) dst[kk * kRows16 + r] = 0.0f;
            continue;
          }
          const T* src = x + (p * kRows16 + r) * x_stride + k0;
          for (int64_t kk = 0; kk < kc; ++kk) dst[kk * kRows16 + r] = to_float(src[kk]);
        }
      }
    }
  });
}

// c (6 x 16 float32 sums, row-major) += a panel of packed x (kc x 6) times a micro-panel (kc x 16); from zero for
// the first run of k-steps
template <bool kFirst>
TS_AVX2 void tile(const float* xp, const float* w, int64_t kc, float* c) {
  __m256 acc[kRows16][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRows16; ++r) {
    acc[r][0] = kFirst ? _mm256_setzero_ps() : _mm256_load_ps(c + r * kBlock16);
    acc[r][1] = kFirst ? _mm256_setzero_ps() : _mm256_load_ps(c + r * kBlock16 + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kBlock16), w1 = _mm256_loadu_ps(w + k * kBlock16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows16; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xp + k * kRows16 + r);
      acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows16; ++r) {
    _mm256_store_ps(c + r * kBlock16, acc[r][0]);
    _mm256_store_ps(c + r * kBlock16 + 8, acc[r][1]);
  }
}

// The same tiles on AVX-512 (CPUs whose bfloat16 runs in these blocks: AVX-512 without AVX512-BF16, such as Ice Lake
// and Cascade Lake, or a VM that hides it): P panels of 6 rows (P <= 2, `panel_stride` apart in xp) against NB blocks
// (NB <= 2: micro-panels w[0..NB), kc x 16 each) in 512-bit registers, their sums at c + b * block_stride + r * 16 for
// row r (the tile's panels adjacent there, as gemm_blocks lays them out): 24 accumulators, two weight vectors and x in
// the 32 registers. Each sum is the AVX2 tile's chain of FMAs, so a row's bits do not depend on which tile ran it.
// Against the AVX2 tile on 2 cores of a Xeon without AVX512-BF16 (bench/ab_cpu_linear.py, 8 layers of the 106M
// model's linears, same bits): bfloat16 1.40 / 1.66 / 1.80 / 1.80x at 17 / 64 / 512 / 2,048 rows (298 GFLOP/s at
// 512, oneDNN's float32 300-340 there), float32 1.57-1.78x; one thread 1.81x at 512 rows (docs/performance.md).
template <bool kFirst, int P, int NB>
TS_AVX512_TILES void tile512(const float* xp, int64_t panel_stride, const float* const* w, int64_t kc, float* c,
                             int64_t block_stride) {
  constexpr int R = P * kRows16;
  __m512 acc[R][NB];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b)
      acc[r][b] = kFirst ? _mm512_setzero_ps() : _mm512_load_ps(c + b * block_stride + r * kBlock16);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 wv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(w[b] + k * kBlock16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xp[(r / kRows16) * panel_stride + k * kRows16 + r % kRows16]);
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(wv[b], xv, acc[r][b]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) _mm512_store_ps(c + b * block_stride + r * kBlock16, acc[r][b]);
}

template <bool kFirst>
TS_AVX512_TILES void tile512_of(int panels, int blocks, const float* xp, int64_t panel_stride, const float* const* w,
                                int64_t kc, float* c, int64_t block_stride) {
  switch (panels * 2 + blocks) {
    case 3: return tile512<kFirst, 1, 1>(xp, panel_stride, w, kc, c, block_stride);
    case 4: return tile512<kFirst, 1, 2>(xp, panel_stride, w, kc, c, block_stride);
    case 5: return tile512<kFirst, 2, 1>(xp, panel_stride, w, kc, c, block_stride);
    default: return tile512<kFirst, 2, 2>(xp, panel_stride, w, kc, c, block_stride);
  }
}

// A buffer of a thread, 64-byte aligned, that lives from call to call (a fresh one a call would page-fault its memory
// in every time)
inline float* scratch(std::vector<float>& buffer, int64_t floats) {
  if (int64_t(buffer.size()) < floats + 16) buffer.resize(floats + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

// Blocks [begin, end) of a matmul against x packed (pack_x), a chunk of kNcBlocks blocks at a time (a function of its
// own: at::parallel_for's lambda would not take the AVX2 target)
template <typename T>
TS_AVX2 void gemm_blocks(const float* xp, int64_t rows, const T* w, int64_t N, int64_t K, const T* bias, T* out,
                         int64_t out_stride, int64_t begin, int64_t end) {
  const int64_t panels = (rows + kRows16 - 1) / kRows16, chunks = (K + kKc - 1) / kKc;
  thread_local std::vector<float> sums_buffer, converted_buffer;
  float* sums = scratch(sums_buffer, kNcBlocks * panels * kRows16 * kBlock16);  // [block][row][16]
  float* converted = std::is_same<T, float>::value ? nullptr : scratch(converted_buffer, kNcBlocks * kKc * kBlock16);
  for (int64_t b0 = begin; b0 < end; b0 += kNcBlocks) {
    const int64_t blocks = std::min(kNcBlocks, end - b0);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k0 = c * kKc, kc = std::min(kKc, K - k0);
      const float* panel_of[kNcBlocks];
      for (int64_t j = 0; j < blocks; ++j) {
        const T* panel = w + ((b0 + j) * K + k0) * kBlock16;
        if constexpr (std::is_same<T, float>::value) {
          panel_of[j] = panel;
        } else {
          float* dst = converted + j * kKc * kBlock16;
          for (int64_t i = 0; i < kc * kBlock16; i += 8) _mm256_store_ps(dst + i, load8(panel + i));
          panel_of[j] = dst;
        }
      }
      for (int64_t p0 = 0; p0 < panels; p0 += kMcPanels) {
        const int64_t p1 = std::min(panels, p0 + kMcPanels);
        if (tiles_on_avx512) {  // two blocks' micro-panels (32 KiB) in L1, two panels of x at a time against them
          for (int64_t j = 0; j < blocks; j += 2) {
            const int nb = int(std::min<int64_t>(2, blocks - j));
            for (int64_t p = p0; p < p1; p += 2) {
              const int np = int(std::min<int64_t>(2, p1 - p));
              const float* xc = xp + (c * panels + p) * kKc * kRows16;
              float* tile_sums = sums + (j * panels + p) * kRows16 * kBlock16;
              if (c == 0)
                tile512_of<true>(np, nb, xc, kKc * kRows16, panel_of + j, kc, tile_sums, panels * kRows16 * kBlock16);
              else
                tile512_of<false>(np, nb, xc, kKc * kRows16, panel_of + j, kc, tile_sums, panels * kRows16 * kBlock16);
            }
          }
          continue;
        }
        for (int64_t j = 0; j < blocks; ++j) {
          float* block_sums = sums + j * panels * kRows16 * kBlock16;
          for (int64_t p = p0; p < p1; ++p) {
            const float* xc = xp + (c * panels + p) * kKc * kRows16;
            float* tile_sums = block_sums + p * kRows16 * kBlock16;
            if (c == 0)
              tile<true>(xc, panel_of[j], kc, tile_sums);
            else
              tile<false>(xc, panel_of[j], kc, tile_sums);
          }
        }
      }
    }
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t n = (b0 + j) * kBlock16, width = std::min(kBlock16, N - n);
      T bias_block[kBlock16] = {};
      if (bias) std::memcpy(bias_block, bias + n, width * sizeof(T));
      const __m256 bias0 = load8(bias_block), bias1 = load8(bias_block + 8);
      const float* block_sums = sums + j * panels * kRows16 * kBlock16;
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + r * out_stride + n;
        T part[kBlock16];
        T* to = width == kBlock16 ? o : part;
        store8(_mm256_add_ps(_mm256_load_ps(block_sums + r * kBlock16), bias0), to);
        store8(_mm256_add_ps(_mm256_load_ps(block_sums + r * kBlock16 + 8), bias1), to + 8);
        if (to == part) std::memcpy(o, part, width * sizeof(T));
      }
    }
  }
}

// A matmul of many rows: x packed, the blocks split between torch's threads
template <typename T>
void gemm(const T* x, int64_t x_stride, int64_t rows, const T* w, int64_t N, int64_t K, const T* bias, T* out,
          int64_t out_stride) {
  const int64_t panels = (rows + kRows16 - 1) / kRows16, chunks = (K + kKc - 1) / kKc;
  thread_local std::vector<float> packed;
  float* xp = scratch(packed, chunks * panels * kKc * kRows16);
  pack_x(x, x_stride, rows, K, xp);
  at::parallel_for(0, (N + kBlock16 - 1) / kBlock16, 1, [&](int64_t begin, int64_t end) {
    gemm_blocks(xp, rows, w, N, K, bias, out, out_stride, begin, end);
  });
}

}  // namespace avx2

// out[rows, N] = x @ W.T (+ bias) for one block b of W (avx2: a pair of 16-feature blocks; the tile unit: 32 features),
// in the job's dtype
struct Matmul {
  // 0 float32, 1 bfloat16 (oneDNN's layouts), 4 bfloat16 in oneDNN's AMX layout; in 16-feature blocks (avx2), x in
  // float32: 2 bfloat16, 3 float32
  int dtype;
  const void* x;
  int64_t x_stride, rows;
  const void* w;
  int64_t N, K;
  const void* bias;
  void* out;
  int64_t out_stride;
  bool amx = false;  // dtype 4 on the tile unit (amx_block)
  // a job of independent pieces instead (ts_pool_run_pieces: no weight): piece(ctx, b) for b < pieces
  void (*piece)(const void* ctx, int64_t b) = nullptr;
  const void* ctx = nullptr;
  int64_t pieces = 0;

  void block(int64_t b, bool request_next = false) const {
    if (piece != nullptr)
      piece(ctx, b);
    else if (dtype != 2 && dtype != 3 && (b + 1) * block_width() > N)  // (the 16-feature blocks store their own)
      tail(b);
    else if (dtype == 2)
      avx2::rows_range(static_cast<const float*>(x), x_stride, 0, rows,
                       static_cast<const uint16_t*>(w) + b * avx2::kPair * K, K, static_cast<const uint16_t*>(bias),
                       static_cast<uint16_t*>(out), out_stride, b, N);
    else if (dtype == 3)
      avx2::rows_range(static_cast<const float*>(x), x_stride, 0, rows,
                       static_cast<const float*>(w) + b * avx2::kPair * K, K, static_cast<const float*>(bias),
                       static_cast<float*>(out), out_stride, b, N);
    else if (dtype == 0)
      rows_of_block<F32Rows>(static_cast<const float*>(x), x_stride, rows, static_cast<const float*>(w), K,
                             static_cast<const float*>(bias), static_cast<float*>(out), out_stride, b,
                             request_next ? static_cast<const float*>(w) + (b + 1) * kBlock * K : nullptr);
    else if (dtype == 1)
      rows_of_block<Bf16Rows64>(static_cast<const uint16_t*>(x), x_stride, rows, static_cast<const uint16_t*>(w), K,
                                static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_stride, b);
#ifdef TS_AMX_INTRINSICS
    else if (amx)
      amx_block(static_cast<const uint16_t*>(x), x_stride, rows, static_cast<const uint16_t*>(w), K,
                static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_stride, b);
#endif
    else
      rows_of_block<Bf16Rows32>(static_cast<const uint16_t*>(x), x_stride, rows, static_cast<const uint16_t*>(w), K,
                                static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_stride, b);
  }
  // The last block of N features not a multiple of the block's width (oneDNN's layouts; the weight's features padded
  // with zeros to whole blocks of 64): its rows into scratch, bias too, then the block's N - n outputs stored
  void tail(int64_t b) const {
    const int64_t width = block_width(), n = b * width, valid = N - n, size = dtype == 0 ? 4 : 2;
    thread_local std::vector<char> scratch;
    const int64_t out_bytes = (rows * width * size + 63) / 64 * 64;
    if (scratch.size() < size_t(out_bytes + width * size + 64)) scratch.resize(out_bytes + width * size + 64);
    char* tmp = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
    Matmul t = *this;
    t.w = static_cast<const char*>(w) + b * width * K * size;
    t.N = width;
    t.out = tmp;
    t.out_stride = width;
    if (bias != nullptr) {
      char* tail_bias = tmp + out_bytes;
      std::memcpy(tail_bias, static_cast<const char*>(bias) + n * size, valid * size);
      std::memset(tail_bias + valid * size, 0, (width - valid) * size);
      t.bias = tail_bias;
    }
    t.block(0);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(out) + (r * out_stride + n) * size, tmp + r * width * size, valid * size);
  }
  // a thread's blocks of this matmul are done: the tile unit's state given back
  void done() const {
#ifdef TS_AMX_INTRINSICS
    if (amx) amx_release();
#endif
  }
  int64_t block_width() const {
#ifdef TS_AMX_INTRINSICS
    if (amx) return kAmxBlock;
#endif
    return dtype == 2 || dtype == 3 ? avx2::kPair : kBlock;
  }
  int64_t blocks() const {
    return piece != nullptr ? pieces : (N + block_width() - 1) / block_width();
  }
  int64_t block_bytes() const { return block_width() * K * (dtype == 0 || dtype == 3 ? 4 : 2); }
};

// Blocks split between torch's threads in equal parts (the pool below runs the decode steps it is armed for).
void run_parallel(const Matmul& m) {
  at::parallel_for(0, m.blocks(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) m.block(b, b + 1 < end && row_groups(m.rows) > 1);
    m.done();
  });
}

// The decode steps' pool: threads of its own that run the GEMVs with the calling thread and, while that thread
// runs everything else of the step (the interpreter, attention, small kernels: a third of a bf16 batch-1 step),
// prefetch the weights of the matmuls that come next, so that memory streams weights during that time too. A
// worker prefetches the part of the next weight it will compute itself, then the others' parts from their ends,
// where it takes blocks when it runs out of its own: the caller reads its part from memory and the worker, which
// has its part in cache, finishes early and takes over the caller's last blocks. (A script of the 106M model's 33
// bf16 weights with 75 us of other work on the caller after each: 6.3 ms of matmul time with OpenMP's split, 4.7
// ms with this; docs/performance.md, issue 20.) Which matmul comes next is learned from the order the caller
// runs them in (a decode step runs the same weights in the same order every time). Prefetch instructions never
// fault, so a freed weight's address in that order is harmless.
//
// The caller arms the pool for a step whose matmuls all fit the GEMV (ts_gemv_pool_arm) and runs that step's
// OpenMP regions on one thread, so that torch's OpenMP threads do not compete with the pool's for the cores.
//
// A thread may also help for a while (ts_gemv_pool_help): the engine's thread, once it has prepared the next step,
// while the C++ decoder's own thread runs this one's matmuls as the caller (cpu_decoder.cpp, asynchronous
// scheduling). It takes the last part of each job posted while it helps, and prefetches as a worker does.
namespace pool {

constexpr int kMaxWorkers = 63;
constexpr int kAhead = 3;                            // weights a worker prefetches ahead, at most
constexpr int64_t kAheadBytes = int64_t(12) << 20;   // and bytes, all workers (this L3: 32 MiB, shared)
constexpr int64_t kPrefetchChunk = 4096;             // bytes prefetched between two looks for a new job
constexpr int64_t kSpinBeforeSleepNs = 5'000'000;    // a worker without work sleeps after this

struct Weight {
  const char* data = nullptr;
  int64_t blocks = 0, block_bytes = 0;
};

struct Job {
  Matmul matmul;
  int threads;
  int workers;  // the armed workers' parts are 1..workers
  int helper;   // the helper's part (threads - 1), or -1: none
  Weight next[kAhead];
  int num_next;
};

struct alignas(64) Span {
  std::atomic<uint64_t> bounds;  // (first unclaimed block << 32) | one past the last unclaimed block
};
struct alignas(64) Slot {
  std::atomic<uint32_t> in_job;  // the job a worker is inside (0: none)
};

Job job;                                  // written by the caller before it opens the job
Span spans[kMaxWorkers + 1];              // the blocks each thread owns in the open job, claimed from both ends
Slot slots[kMaxWorkers];
Slot helper_slot;                         // the helper's, as a worker's
std::atomic<int> helping{0};              // a thread helps (ts_gemv_pool_help)
thread_local bool always_caller = false;  // this thread runs its GEMVs as the pool's caller, armed or not
std::atomic<uint32_t> epoch{0};           // the last job posted (a futex word: sleeping workers wait on it)
std::atomic<uint32_t> open_job{0};        // the job that may still be entered (0: none)
struct alignas(64) Counter {
  std::atomic<int64_t> value{0};
};
Counter blocks_done;                      // of the open job (a line of its own: the claimers write it)
std::atomic<int> armed{0};                // workers taking part in jobs now
std::atomic<uint32_t> arming{0};          // changes with `armed` (a futex word)
std::atomic<int> sleepers{0};
std::atomic<bool> busy{false};            // one caller at a time; another runs its matmul itself
std::atomic<bool> stopping{false};        // ts_gemv_pool_stop: workers end
std::mutex arm_mutex;                     // arm and stop, from any thread
std::atomic<int> started{0};              // worker threads of this process (slots [0, started) in use)
pthread_t threads_started[kMaxWorkers];
pid_t owner = 0;                          // the process that started them (a forked child has none)
bool forks_handled = false;               // forget_after_fork registered (a child inherits the registration)
// the caller's record of which weight follows which; never destroyed (a daemon thread may still run a matmul while
// the process exits)
auto* weights = new std::unordered_map<const void*, Weight>;
auto* next_of = new std::unordered_map<const void*, const void*>;
const void* previous = nullptr;

// thread t's part of `blocks`: [first, last)
inline int64_t part_start(int64_t blocks, int threads, int t) { return blocks * t / threads; }

bool claim_own(int t, int64_t* b) {
  uint64_t v = spans[t].bounds.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t lo = v >> 32, hi = uint32_t(v);
    if (lo >= hi) return false;
    if (spans[t].bounds.compare_exchange_weak(v, (uint64_t(lo + 1) << 32) | hi, std::memory_order_acq_rel)) {
      *b = lo;
      return true;
    }
  }
}

bool claim_other(int t, int threads, int64_t* b) {
  for (int i = 1; i < threads; ++i) {
    Span& span = spans[(t + i) % threads];
    uint64_t v = span.bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t lo = v >> 32, hi = uint32_t(v);
      if (lo >= hi) break;
      if (span.bounds.compare_exchange_weak(v, (uint64_t(lo) << 32) | (hi - 1), std::memory_order_acq_rel)) {
        *b = hi - 1;
        return true;
      }
    }
  }
  return false;
}

void work(const Matmul& m, int t, int threads) {
  int64_t b, done = 0;
  const bool several_groups = row_groups(m.rows) > 1;  // its groups request the next block (rows_of_block)
  while (claim_own(t, &b)) {
    m.block(b, several_groups);
    ++done;
  }
  while (claim_other(t, threads, &b)) {
    m.block(b);
    ++done;
  }
  m.done();
  if (done) blocks_done.value.fetch_add(done, std::memory_order_acq_rel);
}

// A thread without a part (a helper that came after the job was posted): the others' last blocks
void take_over(const Matmul& m, int threads) {
  int64_t b, done = 0;
  while (claim_other(threads, threads + 1, &b)) {  // as the part after the last one
    m.block(b);
    ++done;
  }
  m.done();
  if (done) blocks_done.value.fetch_add(done, std::memory_order_acq_rel);
}

// What a worker prefetches after a job: byte ranges in order, each a run of whole blocks.
struct Prefetch {
  struct Range {
    const char* begin;
    int64_t bytes;
    bool down;  // from its end
  };
  Range ranges[kAhead * (kMaxWorkers + 1)];
  int count = 0, at = 0;
  int64_t done = 0;  // bytes of ranges[at] prefetched

  void plan(const Job& j, int t) {
    count = at = 0;
    done = 0;
    int64_t budget = kAheadBytes / std::max(1, j.threads - 1);  // the workers share the L3
    for (int i = 0; i < j.num_next && budget > 0; ++i) {
      const Weight& w = j.next[i];
      for (int k = 0; k < j.threads && budget > 0; ++k) {
        const int owner_t = (t + k) % j.threads;  // its own part first, ascending; then the others' from their ends
        const int64_t first = part_start(w.blocks, j.threads, owner_t);
        const int64_t bytes = std::min((part_start(w.blocks, j.threads, owner_t + 1) - first) * w.block_bytes, budget);
        if (bytes <= 0) continue;
        const char* begin = w.data + first * w.block_bytes;
        if (k > 0) begin = w.data + part_start(w.blocks, j.threads, owner_t + 1) * w.block_bytes - bytes;
        ranges[count++] = {begin, bytes, k > 0};
        budget -= bytes;
      }
    }
  }

  // one chunk; false when nothing is left
  bool step() {
    if (at >= count) return false;
    const Range& r = ranges[at];
    const int64_t n = std::min(kPrefetchChunk, r.bytes - done);
    const char* p = r.down ? r.begin + r.bytes - done - n : r.begin + done;
    for (int64_t i = 0; i < n; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
    done += n;
    if (done >= r.bytes) {
      ++at;
      done = 0;
    }
    return true;
  }
};

void* worker_main(void* arg) {
  const int w = static_cast<int>(reinterpret_cast<intptr_t>(arg));
  Prefetch prefetch;
  uint32_t seen = epoch.load(std::memory_order_acquire);
  IdleSpin idle(kSpinBeforeSleepNs, 1);  // each spin yields the core (below)
  for (;;) {
    if (stopping.load(std::memory_order_acquire)) return nullptr;
#ifdef TS_TEST_WORKER_PAUSE_US  // tests/test_decode_pool.py: the window between the two looks at `stopping`, widened
    usleep(TS_TEST_WORKER_PAUSE_US);
#endif
    if (w >= armed.load(std::memory_order_acquire)) {
      const uint32_t a = arming.load(std::memory_order_acquire);
      // `stopping` again: stop() sets it before it changes `arming`, so a worker that read the new `arming` sees it
      // (without this look, a worker that passed the one above just before stop() slept here for ever, and stop()
      // waited for it in pthread_join)
      if (w >= armed.load(std::memory_order_acquire) && !stopping.load(std::memory_order_seq_cst))
        futex_wait(&arming, a);
      prefetch.count = 0;
      seen = epoch.load(std::memory_order_acquire);
      continue;
    }
    const uint32_t e = epoch.load(std::memory_order_acquire);
    if (e != seen) {
      seen = e;
      idle.busy();
      slots[w].in_job.store(e, std::memory_order_seq_cst);
      if (open_job.load(std::memory_order_seq_cst) == e) {  // the caller waits for this slot before it reuses job
        const Job j = job;
        if (w < j.workers) {  // armed for fewer workers since this one looked: it has no part
          work(j.matmul, w + 1, j.threads);
          prefetch.plan(j, w + 1);
        }
      }
      slots[w].in_job.store(0, std::memory_order_seq_cst);
      continue;
    }
    if (prefetch.step()) continue;
    // the core to any other thread that wants it (SP-2 batch-1 decode: the rank without tokens, woken for each layer's
    // attention on this worker's core, waited for the worker's time slice; a float32 step took 7.9-8.8 ms against
    // 9.0-13.0 with a pause here, alternated; one rank's steps level)
    sched_yield();
    if (!idle.spun()) continue;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (epoch.load(std::memory_order_seq_cst) == seen) futex_wait(&epoch, seen);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    idle.busy();
  }
}

// In a forked child: the parent's threads were not copied (nor a lock one of them held).
void forget_after_fork() {
  new (&arm_mutex) std::mutex;
  started.store(0);
  owner = 0;
  armed.store(0);
  sleepers.store(0);
  busy.store(false);
  stopping.store(false);
  open_job.store(0);
  for (auto& slot : slots) slot.in_job.store(0);
  weights = new std::unordered_map<const void*, Weight>;  // the parent's may have been mid-update
  next_of = new std::unordered_map<const void*, const void*>;
  previous = nullptr;
}

// Workers beyond `count` sleep; those missing are started. Returns the workers armed (fewer where the system
// refused a thread).
int arm(int count) {
  std::lock_guard<std::mutex> lock(arm_mutex);
  count = std::max(0, std::min(count, kMaxWorkers));
  if (!forks_handled) forks_handled = pthread_atfork(nullptr, nullptr, forget_after_fork) == 0;
  if (owner != getpid()) {
    forget_after_fork();
    owner = getpid();
  }
  for (int w = started.load(); w < count; ++w) {
    if (pthread_create(&threads_started[w], nullptr, worker_main, reinterpret_cast<void*>(intptr_t(w))) != 0) {
      count = w;
      break;
    }
    started.store(w + 1, std::memory_order_release);
  }
  armed.store(count, std::memory_order_release);
  arming.fetch_add(1, std::memory_order_acq_rel);
  futex_wake(&arming);
  return count;
}

// End and join every worker (they start again when armed).
void stop() {
  std::lock_guard<std::mutex> lock(arm_mutex);
  if (owner != getpid()) return;
  while (busy.exchange(true, std::memory_order_acquire)) _mm_pause();  // no job in flight from here on
  armed.store(0, std::memory_order_release);
  stopping.store(true, std::memory_order_seq_cst);
  arming.fetch_add(1, std::memory_order_acq_rel);
  futex_wake(&arming);
  uint32_t e = epoch.load(std::memory_order_relaxed) + 1;  // a sleeper's futex word changes: it cannot miss the wake
  epoch.store(e == 0 ? 1 : e, std::memory_order_seq_cst);
  futex_wake(&epoch);
  const int n = started.load();
  for (int w = 0; w < n; ++w) pthread_join(threads_started[w], nullptr);
  started.store(0);
  stopping.store(false);
  busy.store(false, std::memory_order_release);
}

void learn_order(const Matmul& m) {
  (*weights)[m.w] = {static_cast<const char*>(m.w), m.blocks(), m.block_bytes()};
  if (previous != nullptr && previous != m.w) (*next_of)[previous] = m.w;
  previous = m.w;
  if (weights->size() > 65536) {  // weights freed and others made, for a long time: start again
    weights->clear();
    next_of->clear();
    previous = nullptr;
  }
}

void run(const Matmul& m, int workers) {
  // a job of pieces has no weight: its workers prefetch, after it, what follows the last weight
  const void* last = m.piece != nullptr ? previous : m.w;
  if (m.piece == nullptr) learn_order(m);
  const bool helper = helping.load(std::memory_order_seq_cst) != 0;
  const int threads = workers + 1 + (helper ? 1 : 0);
  const int64_t blocks = m.blocks();
  job.matmul = m;
  job.threads = threads;
  job.workers = workers;
  job.helper = helper ? threads - 1 : -1;
  job.num_next = 0;
  for (const void* at = last; at != nullptr && job.num_next < kAhead;) {
    auto it = next_of->find(at);
    if (it == next_of->end()) break;
    at = it->second;
    job.next[job.num_next++] = (*weights)[at];
  }
  for (int t = 0; t < threads; ++t)
    spans[t].bounds.store((uint64_t(part_start(blocks, threads, t)) << 32) | uint64_t(part_start(blocks, threads, t + 1)),
                          std::memory_order_relaxed);
  blocks_done.value.store(0, std::memory_order_relaxed);
  uint32_t e = epoch.load(std::memory_order_relaxed) + 1;
  if (e == 0) e = 1;  // 0 means no job
  open_job.store(e, std::memory_order_seq_cst);
  epoch.store(e, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake(&epoch);
  work(m, 0, threads);
  while (blocks_done.value.load(std::memory_order_acquire) < blocks) _mm_pause();
  open_job.store(0, std::memory_order_seq_cst);
  // every started worker, armed or not: one that looked at `armed` before it fell may still be entering this job,
  // and must be out before `job` and the spans change
  const int n = started.load(std::memory_order_acquire);
  for (int w = 0; w < n; ++w)
    while (slots[w].in_job.load(std::memory_order_seq_cst) == e) _mm_pause();
  while (helper_slot.in_job.load(std::memory_order_seq_cst) == e) _mm_pause();
}

// The calling thread takes part in the jobs posted until `*counter` reaches `target`, as a worker does; in a job posted
// before it came it takes the others' last blocks (a job posted as it leaves runs without it: its part goes to the
// others, who take any unclaimed block). One helper at a time.
void help(const std::atomic<int64_t>* counter, int64_t target) {
  Prefetch prefetch;
  uint32_t seen = 0;  // no job: the one open now is entered
  helping.store(1, std::memory_order_seq_cst);
  while (counter->load(std::memory_order_acquire) < target) {
    const uint32_t e = epoch.load(std::memory_order_acquire);
    if (e != seen) {
      seen = e;
      helper_slot.in_job.store(e, std::memory_order_seq_cst);
      if (open_job.load(std::memory_order_seq_cst) == e) {  // as worker_main: the caller waits for this slot
        const Job j = job;
        if (j.helper >= 0) {
          work(j.matmul, j.helper, j.threads);
          prefetch.plan(j, j.helper);
        } else {
          take_over(j.matmul, j.threads);
        }
      }
      helper_slot.in_job.store(0, std::memory_order_seq_cst);
      continue;
    }
    if (!prefetch.step()) _mm_pause();
  }
  helping.store(0, std::memory_order_seq_cst);
}

}  // namespace pool

// `m` on the pool where the calling thread runs there now (armed, or the C++ decoder's thread) and no other job is in
// flight; false, and nothing ran, otherwise
bool run_on_pool(const Matmul& m) {
  const int workers = pool::armed.load(std::memory_order_acquire);
  // a forked child: 0 workers (atfork)
  if ((workers > 0 || pool::always_caller) && !pool::busy.exchange(true, std::memory_order_acquire)) {
    pool::run(m, workers);
    pool::busy.store(false, std::memory_order_release);
    return true;
  }
  return false;
}

void run_matmul(const Matmul& m) {
  if (!run_on_pool(m)) run_parallel(m);
}

}  // namespace

extern "C" {

// Which dtypes this CPU can run (bit 0: float32, bit 1: bfloat16, in oneDNN's AVX-512 layouts; bit 2: float32 and
// bfloat16 in 16-feature blocks, with AVX2 and FMA: ts_blocked_linear).
int ts_packed_gemv_dtypes() {
  __builtin_cpu_init();
  int dtypes = 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) dtypes |= 4;
  if (__builtin_cpu_supports("avx512f")) dtypes |= 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512bf16"))
    dtypes |= 2;
  return dtypes;
}

// out[rows, N] = x[rows, K] @ W.T (+ bias); dtype 0 float32, 1 bfloat16, 4 bfloat16 in oneDNN's AMX layout (x,
// weight, bias and out alike); W's features in whole blocks of 64, those past N zeros (oneDNN pads so). Returns 0, or
// -1 for a shape the layouts above do not cover.
int ts_packed_gemv(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight, int64_t N,
                   int64_t K, const void* bias, void* out, int64_t out_row_stride) {
  if (dtype != 0 && dtype != 1 && dtype != 4) return -1;
  if (N < 1 || rows < 1 || (dtype != 0 && K % 2 != 0)) return -1;
  Matmul m{dtype, x, x_row_stride, rows, weight, N, K, bias, out, out_row_stride};
#ifdef TS_AMX_INTRINSICS
  m.amx = dtype == 4 && K % 32 == 0 && amx_gemv_enabled.load(std::memory_order_relaxed) && amx_bf16_usable();
#endif
  run_matmul(m);
  return 0;
}

// The rows up to which the 16-feature blocks run as the GEMV, the matmul above (PackedWeight.gemv_max_rows, the C++
// decoder): in 512-bit registers the GEMV stays ahead of the matmul up to 24 rows (bfloat16 from memory, 2 cores of
// a Xeon without AVX512-BF16: 177 against 138 GFLOP/s at 16 rows, 198 against 182 at 24, level at 28-32, behind
// from 40); in AVX2 ones up to 16 (Zen 3).
int64_t ts_blocked_gemv_rows() {
  static const bool avx512 = avx2::avx512_cpu();  // (not tiles_on_avx512: other files' static initializers call this)
  return avx512 ? 24 : 16;
}

// out[rows, N] = x[rows, K] @ W.T (+ bias), dtype 0 float32 or 1 bfloat16 (x, weight, bias and out alike), W in
// 16-feature blocks (avx2 above; ceil(N / 16) of them): matmuls of at most `gemv_rows` rows as the GEMV (on the decode
// pool when armed), others panel by panel. Returns 0, or -1 where this CPU has no AVX2 and FMA.
int ts_blocked_linear(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight, int64_t N,
                      int64_t K, const void* bias, void* out, int64_t out_row_stride, int64_t gemv_rows) {
  static const bool supported = ts_packed_gemv_dtypes() & 4;
  if (!supported || rows < 1 || K < 1 || (dtype != 0 && dtype != 1)) return -1;
  if (rows > gemv_rows) {
    if (dtype == 1)
      avx2::gemm(static_cast<const uint16_t*>(x), x_row_stride, rows, static_cast<const uint16_t*>(weight), N, K,
                 static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_row_stride);
    else
      avx2::gemm(static_cast<const float*>(x), x_row_stride, rows, static_cast<const float*>(weight), N, K,
                 static_cast<const float*>(bias), static_cast<float*>(out), out_row_stride);
    return 0;
  }
  const float* xf = static_cast<const float*>(x);
  int64_t xf_stride = x_row_stride;
  // grown, never resized down: a vector resized to each call's rows x K zero-filled what the call before had cut off
  // (every down projection after its layer's smaller inputs: 1.5% of a decoding process's cycles in memset)
  thread_local std::vector<float> converted_buffer;
  if (dtype == 1) {
    float* converted = avx2::scratch(converted_buffer, rows * K);
    avx2::convert_rows(static_cast<const uint16_t*>(x), x_row_stride, rows, K, converted);
    xf = converted;
    xf_stride = K;
  }
  run_matmul({dtype == 1 ? 2 : 3, xf, xf_stride, rows, weight, N, K, bias, out, out_row_stride});
  return 0;
}

// Whether bfloat16 in oneDNN's AMX layout runs on the tile unit where the CPU has it (1, the default) or in AVX512-BF16
// dot products (0): `enable` 0 or 1 sets it, -1 leaves it. Returns whether it runs on the tile unit now.
int ts_gemv_amx(int enable) {
#ifdef TS_AMX_INTRINSICS
  if (enable >= 0) amx_gemv_enabled.store(enable != 0);
  return amx_gemv_enabled.load() && amx_bf16_usable() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}

// Let `workers` threads of the decode pool (above) run the GEMVs with the caller from now on (0: none, OpenMP's
// split again). The caller runs its OpenMP regions on one thread while armed. Returns the workers armed.
int ts_gemv_pool_arm(int workers) { return pool::arm(workers); }

// End the pool's threads (the last engine of the process closing); arming again starts new ones.
void ts_gemv_pool_stop() { pool::stop(); }

// The workers armed now (0 in a child forked from an armed process: its threads were not copied).
int ts_gemv_pool_workers() { return pool::armed.load(std::memory_order_acquire); }

// The calling thread runs its GEMVs as the pool's caller even with no worker armed, so that a helper may join them
// (the C++ decoder's own thread: cpu_decoder.cpp)
void ts_gemv_pool_always_caller() { pool::always_caller = true; }

// Help the pool's caller (another thread) with its GEMVs until `*counter` reaches `target` (cpu_decoder.cpp)
void ts_gemv_pool_help(const std::atomic<int64_t>* counter, int64_t target) { pool::help(counter, target); }

// piece(ctx, b) for every b < pieces, on the decode pool's threads with the caller, where the calling thread runs its
// GEMVs on the pool now (armed, or the C++ decoder's thread) and no other job is in flight: returns 0. Otherwise 1,
// and nothing ran: the caller runs the pieces its own way. The pieces run in any order, on any of the threads.
int ts_pool_run_pieces(int64_t pieces, void (*piece)(const void* ctx, int64_t b), const void* ctx) {
  if (pieces <= 0 || pieces >= (int64_t(1) << 32)) return 1;
  Matmul m{};
  m.piece = piece;
  m.ctx = ctx;
  m.pieces = pieces;
  return run_on_pool(m) ? 0 : 1;
}

}  // extern "C"

#else

extern "C" {
int ts_packed_gemv_dtypes() { return 0; }
int ts_packed_gemv(int, const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*, void*, int64_t) {
  return -1;
}
int ts_blocked_linear(int, const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*, void*, int64_t,
                      int64_t) {
  return -1;
}
int64_t ts_blocked_gemv_rows() { return 0; }
int ts_gemv_amx(int) { return 0; }
int ts_gemv_pool_arm(int) { return 0; }
int ts_gemv_pool_workers() { return 0; }
void ts_gemv_pool_stop() {}
void ts_gemv_pool_always_caller() {}
void ts_gemv_pool_help(const std::atomic<int64_t>* counter, int64_t target) {
  while (counter->load(std::memory_order_acquire) < target) {
  }
}
int ts_pool_run_pieces(int64_t, void (*)(const void*, int64_t), const void*) { return 1; }
}  // extern "C"

#endif  // __x86_64__
