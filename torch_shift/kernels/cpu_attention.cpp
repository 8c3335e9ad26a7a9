// Paged attention on the CPU: every query run of a step (a decode token, or a chunk of a prompt) attends to
// its own sequence's keys, read in place from the paged KV cache through its block table, causally (and
// within a sliding window), with an optional sink per query head: a logit that every row's softmax also
// normalises over and that contributes no value (GPT-OSS). No padding to the longest context and no gathered copy of the context: each
// key and value is read once per (run, KV head, tile of queries) and converted to float32 in registers.
//
// A bfloat16 prompt chunk of 64 queries or more multiplies in AVX512-BF16 dot products instead, its
// probabilities rounded to bfloat16 for the values' sum (1.6-1.7x faster; see kDotMinQueries), and on CPUs with AMX
// the same products on the tile unit (chunk_head_amx).
//
// Online softmax over chunks of keys (FlashAttention's recurrence, one pass), accumulated in float32. The
// query heads that share a KV head are computed together (GQA), so a KV head's keys are read once for all
// of them. Work items (run, KV head, tile of queries) go to torch's intra-op threads (at::parallel_for)
// dynamically, the most expensive first.
//
// Vectors are GCC/Clang vector extensions of 16 floats: 512-bit registers with AVX-512, two 256-bit ones
// with AVX2, four 128-bit ones on NEON; head_dim not a multiple of 16 takes a scalar path.
//
// Entry points are extern "C" with raw pointers and strides (called through ctypes): the C++ side needs
// only ATen/Parallel.h, which compiles in about a second.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

// cpu_linear.cpp (the same library): independent pieces on the decode pool's threads, where the caller runs there
extern "C" int ts_pool_run_pieces(int64_t pieces, void (*piece)(const void* ctx, int64_t b), const void* ctx);

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int kItemRows = 64;  // query rows (queries x heads of a KV head) of one work item
// and of a prompt's item whose chunks are put in pairs for the dot products (pair_chunk): every item pairs each chunk
// it sees, so larger items pair less (a bf16 512-token prompt on AMX: pairing was 16% of its attention at 64 rows)
constexpr int kPairedItemRows = 256;  // (a power of 2 times kItemRows)
constexpr int kMaxRows = kPairedItemRows;
constexpr int kPieces = 4;    // pieces of kLanes keys in a chunk: one online-softmax update per chunk
constexpr int kChunk = kPieces * kLanes;
static_assert(kPieces == 4, "chunk_rows dispatches on 1 to 4 pieces");
constexpr int kRowsConvertedOnce = 4;  // more rows of a KV head than this: convert its chunk to float32 once

static_assert(sizeof(vfloat) == kLanes * sizeof(float), "a vector is a piece of keys");

#if defined(__FLT16_MAX__)
#define TS_HAVE_FP16 1
using fp16_t = _Float16;
typedef _Float16 vfp16 __attribute__((vector_size(kLanes * sizeof(_Float16))));
inline float to_float(fp16_t v) { return static_cast<float>(v); }
inline void store(float v, fp16_t* out) { *out = static_cast<fp16_t>(v); }
#endif

inline void store(float v, float* out) { *out = v; }
inline void store(float v, bf16_t* out) { *out = to_bf16(v); }

#ifdef TS_HAVE_FP16
inline vfloat load16(const fp16_t* p) {
  vfp16 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vfloat);
}
#endif

inline vfloat splat(float x) { return vfloat{} + x; }

// x in every lane, kept in a register: a row's query or probability, multiplied by several vectors.
// (`splat` above costs a scalar add, as 0 + -0 is +0; a broadcast folded into each multiply-add as a memory
// operand, or spilled with the accumulators, measured slower for bfloat16 keys.)
inline vfloat broadcast(float x) {
  vfloat v = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#if defined(__AVX512F__)  // one register (with AVX2 a vector is two, which the constraint cannot name)
  asm("" : "+v"(v));
#endif
  return v;
}

// A vector loaded once into a register for the rows that multiply it. Left to itself GCC folds the load into each
// row's multiply-add as a memory operand: one load per row per vector, free where a core loads two vectors a cycle
// (Sapphire Rapids) but not on AMD's Zen 4, which loads one: its float32 prompt attention ran at 47 GFLOP/s against
// 70 with this (bench_attention.py, one thread, alternated), decode 10-19% faster. The same multiply-adds in the
// same order (a register operand instead of a memory one): the same bits.
template <typename T>
inline vfloat load16_once(const T* p) {
  vfloat v = load16(p);
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

#if defined(__clang__)
#define TS_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define TS_SHUFFLE(v, ...) __builtin_shuffle(v, vint{__VA_ARGS__})
#endif

inline float hsum(vfloat v) {
  v += TS_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  v += TS_SHUFFLE(v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  v += TS_SHUFFLE(v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  v += TS_SHUFFLE(v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return v[0];
}

inline float hmax(vfloat v) {
  v = v > TS_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)
          ? v : TS_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  v = v > TS_SHUFFLE(v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7)
          ? v : TS_SHUFFLE(v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  v = v > TS_SHUFFLE(v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3)
          ? v : TS_SHUFFLE(v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  return std::max(v[0], v[1]);
}

// exp_nonpositive's template: cpu_common.h
inline vfloat exp_nonpositive(vfloat x) { return exp_nonpositive<vfloat, vint>(x); }

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// Strides (elements) of one layer's cache: element [block, token, head, dim].
struct CacheLayout {
  int64_t block, token, head, dim;
};

struct Problem {
  void* out;
  int64_t out_row_stride, out_head_stride;
  const void* q;
  int64_t q_row_stride, q_head_stride;
  const void* k_cache;
  const void* v_cache;
  CacheLayout k, v;  // k: dim-major (token stride 1); v: token-major (dim stride 1)
  const int32_t* query_start;
  const int32_t* query_len;
  const int32_t* num_computed;
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* block_table_row;
  int64_t block_size, num_heads, num_kv_heads, head_dim, sliding_window;
  float scale;
  const float* sinks;  // [num_heads] or null
};

struct Item {
  int32_t run, first_kv_head, num_kv_heads, first_query, num_queries;
  double cost;
};

// One work item's rows: queries and accumulators in float32, the running max and sum of each row, and the
// keys each row sees [lo, hi]. Row (i * num_kv_heads + h) * G + g: query i, KV head h of the item, the g-th
// query head of that KV head.
struct Rows {
  int64_t count, head_dim;
  float* q;    // [count, head_dim], scaled
  float* acc;  // [count, head_dim]
  float max[kMaxRows], sum[kMaxRows];
  int64_t lo[kMaxRows], hi[kMaxRows];
};

// A chunk of keys is up to kPieces pieces of kLanes consecutive positions; each piece lies in one block (or
// in a buffer the keys were copied to). Keys dim-major: dimension d of key j at keys[d * key_dim_stride + j]
// (the piece's keys are one vector per dimension); values token-major: value j at values[j * value_stride].
template <typename KT, typename VT>
struct Piece {
  const KT* keys;
  const VT* values;
  int64_t n;  // valid keys (<= kLanes)
};

// A partial piece's keys as float32 in `padded` (D x kLanes, dim-major), zeros past its n keys, never reading them
template <typename KT, typename VT>
inline void pad_keys(const Piece<KT, VT>& piece, int64_t D, int64_t key_dim_stride, float* padded) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = 0; j < kLanes; ++j)
      padded[d * kLanes + j] = j < piece.n ? to_float(piece.keys[d * key_dim_stride + j]) : 0.f;
}

// The next chunk's keys and values, requested a few cache lines at a time from inside the loops over the
// current chunk. A sequence's blocks are scattered in the pool, so the hardware's prefetchers start over at
// each one; requested all at once, a chunk's lines fill the core's miss buffers and stall it until they
// return, so that reading and computing take turns instead of overlapping.
struct Prefetcher {
  static constexpr int kMaxRanges = kChunk + kPieces + 2;
  const char* start[kMaxRanges];
  int64_t bytes[kMaxRanges];
  int count = 0, next = 0;
  int64_t offset = 0, lines = 0, per_step = 0;

  void add(const void* p, int64_t n) {
    const char* c = static_cast<const char*>(p);
    if (count > 0 && start[count - 1] + bytes[count - 1] == c) {
      bytes[count - 1] += n;
    } else {
      assert(count < kMaxRanges);
      start[count] = c;
      bytes[count++] = n;
    }
    lines += (n + 63) / 64;
  }
  // the lines spread over `steps` calls of step()
  void spread(int64_t steps) { per_step = std::max<int64_t>(1, (lines + steps - 1) / std::max<int64_t>(steps, 1)); }
  inline void step() {
    int64_t at = offset;  // in registers for the loop, stored once
    int range = next;
    for (int64_t i = 0; i < per_step && range < count; ++i) {
      __builtin_prefetch(start[range] + at, 0, 1);  // to L2: measured faster than to L1
      at += 64;
      if (at >= bytes[range]) {
        ++range;
        at = 0;
      }
    }
    offset = at;
    next = range;
  }
  // the AVX2 loops' calls: during a chunk's first piece of keys and its first 16 dimensions of values
  inline void key_row(int64_t s, int64_t) {
    if (s == 0) step();
  }
  inline void value_row(int64_t, int64_t, int64_t dv) {
    if (dv == 0) step();
  }
  // the rest now, and empty again
  void finish() {
    per_step = INT64_MAX;
    step();
    count = next = 0;
    offset = lines = 0;
  }
};

// A prompt tile's requests: none inside its loops (its next chunk was requested before them), and no registers held
// for them there (with an empty Prefetcher's loop in them, GCC kept pointers in vector registers and spilled a row's
// probability to the stack in the values loop)
struct NoPrefetch {
  inline void step() {}
  inline void key_row(int64_t, int64_t) {}
  inline void value_row(int64_t, int64_t, int64_t) {}
};

// A chunk's first `seen` values weighted by `probs` added into rows [r0, r0 + RB)'s accumulators (first scaled by
// `correction`), DVB vectors of a row at a time: RB x DVB independent chains of multiply-adds.
template <int RB, int DVB, typename KT, typename VT, typename Requests>
inline void chunk_values(Rows& rows, int64_t r0, const Piece<KT, VT>* pieces, int64_t num_pieces,
                         int64_t value_stride, int64_t seen, const float (&probs)[RB][kChunk],
                         const float (&correction)[RB], Requests& prefetcher) {
  const int64_t D = rows.head_dim;
  for (int64_t dv = 0; dv < D; dv += DVB * kLanes) {
    vfloat out[RB][DVB];
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < DVB; ++b) out[r][b] = load16(rows.acc + (r0 + r) * D + dv + b * kLanes) * correction[r];
    for (int64_t s = 0; s < num_pieces; ++s) {
      const VT* values = pieces[s].values + dv;
      const int64_t n = std::min<int64_t>(pieces[s].n, seen - s * kLanes);
      for (int64_t j = 0; j < n; ++j) {
        prefetcher.step();
        vfloat weight[RB];
        for (int r = 0; r < RB; ++r) weight[r] = broadcast(probs[r][s * kLanes + j]);
        for (int b = 0; b < DVB; ++b) {
          const vfloat vv = load16_once(values + j * value_stride + b * kLanes);
          for (int r = 0; r < RB; ++r) out[r][b] += weight[r] * vv;
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < DVB; ++b)
        std::memcpy(rows.acc + (r0 + r) * D + dv + b * kLanes, &out[r][b], sizeof(vfloat));
  }
}

// The scores of rows [r0, r0 + RB) against NF full pieces and, if PARTIAL, one partial piece after
// them (its keys padded with zeros in `padded`, never reading past them). The piece count is a template
// argument so that the RB x kPieces accumulators are registers, RB x NF independent chains.
template <int RB, int NF, bool PARTIAL, typename KT, typename VT, typename Requests>
inline void chunk_scores(const Rows& rows, int64_t r0, const Piece<KT, VT>* pieces, int64_t key_dim_stride,
                         float* padded, Requests& prefetcher, vfloat (&scores)[RB][kPieces]) {
  const int64_t D = rows.head_dim;
  if (PARTIAL) pad_keys(pieces[NF], D, key_dim_stride, padded);
  const float* q = rows.q + r0 * D;
  for (int64_t d = 0; d < D; ++d) {
    prefetcher.step();
    vfloat qd[RB];
    for (int r = 0; r < RB; ++r) qd[r] = broadcast(q[r * D + d]);
    for (int s = 0; s < NF; ++s) {
      const vfloat kd = load16_once(pieces[s].keys + d * key_dim_stride);
      for (int r = 0; r < RB; ++r) scores[r][s] += qd[r] * kd;
    }
    if (PARTIAL) {
      const vfloat kd = load16_once(padded + d * kLanes);
      for (int r = 0; r < RB; ++r) scores[r][NF] += qd[r] * kd;
    }
  }
}

// The online softmax update of rows [r0, r0 + RB) for one chunk (FlashAttention's recurrence): each row's
// visible scores exponentiated into `probs` (0 where not visible), its running max and sum updated, and the
// factor its accumulators must be scaled by in `correction`.
#if defined(__AVX2__) && !defined(__AVX512F__)
// chunk_softmax below on vectors of 8 floats, one register with AVX2 (GCC lowers its 16-float shuffles, selects and
// masks through the stack there: half of a float32 prompt tile's time, perf). Each piece is two halves; every lane
// takes the same operations in the same order, the reductions the same tree, so the results are the same bits.
#define TS_AVX2_SOFTMAX 1
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t vint8 __attribute__((vector_size(8 * sizeof(int32_t))));
#if defined(__clang__)
#define TS_SHUFFLE8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define TS_SHUFFLE8(v, ...) __builtin_shuffle(v, vint8{__VA_ARGS__})
#endif

template <int RB, typename KT, typename VT>
inline void chunk_softmax8(Rows& rows, int64_t r0, const Piece<KT, VT>* pieces, int64_t num_pieces, int64_t chunk,
                           const vfloat (&scores)[RB][kPieces], float (&probs)[RB][kChunk], float (&correction)[RB]) {
  const vint8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const vfloat8 minus_infinity = vfloat8{} - INFINITY;
  const bool whole = num_pieces == kPieces && pieces[kPieces - 1].n == kLanes;
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    const int32_t a = static_cast<int32_t>(std::max<int64_t>(rows.lo[row] - chunk, 0));
    const int32_t b = static_cast<int32_t>(std::min<int64_t>(rows.hi[row] + 1 - chunk, kPieces * kLanes));
    const bool all = a == 0 && b == kChunk && whole;
    vint8 visible[2 * kPieces];
    vfloat8 masked[2 * kPieces];
    vfloat8 top[2] = {minus_infinity, minus_infinity};
    for (int s = 0; s < kPieces; ++s) {
      const int32_t n = static_cast<int32_t>(s < num_pieces ? pieces[s].n : 0);
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * s + h;
        vfloat8 half;
        std::memcpy(&half, reinterpret_cast<const float*>(&scores[r][s]) + 8 * h, sizeof half);
        if (all) {
          visible[i] = vint8{} - 1;
          masked[i] = half;
        } else {
          const vint8 at = lane + (s * kLanes + 8 * h);
          visible[i] = (at >= a) & (at < b) & (lane + 8 * h < n);
          masked[i] = visible[i] ? half : minus_infinity;
        }
        top[h] = top[h] > masked[i] ? top[h] : masked[i];
      }
    }
    vfloat8 m = top[0] > top[1] ? top[0] : top[1];  // hmax's tree
    m = m > TS_SHUFFLE8(m, 4, 5, 6, 7, 4, 5, 6, 7) ? m : TS_SHUFFLE8(m, 4, 5, 6, 7, 4, 5, 6, 7);
    m = m > TS_SHUFFLE8(m, 2, 3, 2, 3, 2, 3, 2, 3) ? m : TS_SHUFFLE8(m, 2, 3, 2, 3, 2, 3, 2, 3);
    const float chunk_max = std::max(m[0], m[1]);
    if (chunk_max == -INFINITY) {
      std::memset(probs[r], 0, sizeof probs[r]);
      correction[r] = 1.0f;
      continue;
    }
    const float new_max = std::max(rows.max[row], chunk_max);
    correction[r] = rows.max[row] == -INFINITY ? 0.0f
                    : rows.max[row] == new_max ? 1.0f
                                               : exp_nonpositive(rows.max[row] - new_max);
    vfloat8 total[2] = {vfloat8{}, vfloat8{}};
    for (int i = 0; i < 2 * kPieces; ++i) {
      const vfloat8 e = visible[i] ? exp_nonpositive<vfloat8, vint8>(masked[i] - new_max) : vfloat8{};
      total[i % 2] += e;
      std::memcpy(probs[r] + 8 * i, &e, sizeof e);
    }
    vfloat8 t = total[0] + total[1];  // hsum's tree
    t += TS_SHUFFLE8(t, 4, 5, 6, 7, 4, 5, 6, 7);
    t += TS_SHUFFLE8(t, 2, 3, 2, 3, 2, 3, 2, 3);
    t += TS_SHUFFLE8(t, 1, 1, 1, 1, 1, 1, 1, 1);
    rows.sum[row] = rows.sum[row] * correction[r] + t[0];
    rows.max[row] = new_max;
  }
}
#endif

template <int RB, typename KT, typename VT>
inline void chunk_softmax(Rows& rows, int64_t r0, const Piece<KT, VT>* pieces, int64_t num_pieces, int64_t chunk,
                          const vfloat (&scores)[RB][kPieces], float (&probs)[RB][kChunk], float (&correction)[RB]) {
#ifdef TS_AVX2_SOFTMAX
  chunk_softmax8<RB>(rows, r0, pieces, num_pieces, chunk, scores, probs, correction);
#else
  vint lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  const bool whole = num_pieces == kPieces && pieces[kPieces - 1].n == kLanes;
  for (int r = 0; r < RB; ++r) {
    const int64_t row = r0 + r;
    // this row's visible keys of the chunk: [a, b) relative to the chunk
    const int32_t a = static_cast<int32_t>(std::max<int64_t>(rows.lo[row] - chunk, 0));
    const int32_t b = static_cast<int32_t>(std::min<int64_t>(rows.hi[row] + 1 - chunk, kPieces * kLanes));
    vint visible[kPieces];
    vfloat masked[kPieces];
    vfloat top = splat(-INFINITY);
    if (a == 0 && b == kChunk && whole) {  // every key of the chunk visible: no masks to build
      for (int s = 0; s < kPieces; ++s) {
        visible[s] = vint{} - 1;
        masked[s] = scores[r][s];
        top = top > masked[s] ? top : masked[s];
      }
    } else {
      for (int s = 0; s < kPieces; ++s) {
        visible[s] = (lane + s * kLanes >= a) & (lane + s * kLanes < b) &
                     (lane < static_cast<int32_t>(s < num_pieces ? pieces[s].n : 0));
        masked[s] = visible[s] ? scores[r][s] : splat(-INFINITY);
        top = top > masked[s] ? top : masked[s];
      }
    }
    const float chunk_max = hmax(top);
    if (chunk_max == -INFINITY) {  // nothing of this chunk is visible to the row
      std::memset(probs[r], 0, sizeof probs[r]);
      correction[r] = 1.0f;
      continue;
    }
    const float new_max = std::max(rows.max[row], chunk_max);
    correction[r] = rows.max[row] == -INFINITY ? 0.0f
                    : rows.max[row] == new_max ? 1.0f  // exp(0), exactly
                                               : exp_nonpositive(rows.max[row] - new_max);
    vfloat total = vfloat{};
    for (int s = 0; s < kPieces; ++s) {
      const vfloat e = visible[s] ? exp_nonpositive(masked[s] - new_max) : vfloat{};
      total += e;
      std::memcpy(probs[r] + s * kLanes, &e, sizeof e);
    }
    rows.sum[row] = rows.sum[row] * correction[r] + hsum(total);
    rows.max[row] = new_max;
  }
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// With AVX2 a vector of 16 floats is two registers, and GCC lowers the loops below on such vectors through the stack
// and general registers (perf: a prompt tile took 48 ms a layer for a 512-token prompt of the 106M model, against
// SDPA's 12; a bf16 decode step's attention was a sixth of the step). The same sums in AVX2 intrinsics, in the same
// order with the same multiply-adds (so the same bits), 8 keys or dimensions a register; float32 and bfloat16 keys
// and values.
#define TS_AVX2_TILES 1

template <typename T>
constexpr bool kAvx2Type = std::is_same<T, float>::value || std::is_same<T, bf16_t>::value;

// A decode item's requests for its next chunk from the AVX2 loops: the line of the next chunk's piece s that holds
// what the loop reads of the current piece s (dimension d of its keys; dimensions [16 dv, 16 dv + 16) of value j), one
// prefetch an iteration and no bookkeeping. A spread Prefetcher costs about ten instructions a line in these loops: on
// a Zen 3 most of a float32 decode's samples fell in the quarter of its loops that requested (perf), and decodes with
// no requests at all ran 1.2-1.3x faster in cache (1.3x slower from memory). With these (and the loads below held in
// registers) float32 decodes in cache ran 1.3-1.5x faster than with it, bfloat16 ones from memory 1.2x.
template <typename T>
struct NextChunk {
  const T* keys[kPieces];
  const T* values[kPieces];
  int64_t key_dim_stride, value_stride;
  inline void key_row(int64_t s, int64_t d) const { __builtin_prefetch(keys[s] + d * key_dim_stride, 0, 1); }
  inline void value_row(int64_t s, int64_t j, int64_t dv) const {
    __builtin_prefetch(values[s] + j * value_stride + dv * kLanes, 0, 1);
  }
};

// scores[r][s] of rows [0, RB) (their queries `q`, D apart) against one piece of 16 keys, dim-major `stride` apart;
// a decode item's loop also requests its next chunk as it goes (`requests`)
template <int RB, typename KT, typename Requests>
inline void piece_scores_avx2(const float* q, int64_t D, const KT* keys, int64_t stride, vfloat (*scores)[kPieces],
                              int64_t s, Requests& requests) {
  __m256 lo[RB], hi[RB];
  for (int r = 0; r < RB; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    requests.key_row(s, d);
    __m256 k0 = load8(keys + d * stride), k1 = load8(keys + d * stride + 8);
    // loaded once into registers: GCC folded each load into every row's multiply-add (twice the loads; float32
    // decodes 1.09-1.14x slower, alternated on a Zen 3)
    asm("" : "+x"(k0), "+x"(k1));
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * D + d);
      lo[r] = _mm256_fmadd_ps(qv, k0, lo[r]);
      hi[r] = _mm256_fmadd_ps(qv, k1, hi[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    float* out = reinterpret_cast<float*>(&scores[r][s]);
    _mm256_storeu_ps(out, lo[r]);
    _mm256_storeu_ps(out + 8, hi[r]);
  }
}

// rows [0, RB)'s accumulators (`acc`, D apart), dimensions [16 dv, 16 dv + 16): scaled by `correction`, plus the
// chunk's first `seen` values weighted by `probs` (a decode item's loop requesting its next chunk: `requests`)
template <int RB, typename VT, typename Requests>
inline void tile_values_avx2(float* acc, int64_t D, int64_t dv, const Piece<VT, VT>* pieces, int64_t num_pieces,
                             int64_t value_stride, int64_t seen, const float (*probs)[kChunk],
                             const float* correction, Requests& requests) {
  __m256 lo[RB], hi[RB];
  for (int r = 0; r < RB; ++r) {
    const __m256 c = _mm256_set1_ps(correction[r]);
    lo[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + dv * kLanes), c);
    hi[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + dv * kLanes + 8), c);
  }
  for (int64_t s = 0; s < num_pieces; ++s) {
    const VT* values = pieces[s].values + dv * kLanes;
    const int64_t n = std::min<int64_t>(pieces[s].n, seen - s * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      requests.value_row(s, j, dv);
      __m256 v0 = load8(values + j * value_stride), v1 = load8(values + j * value_stride + 8);
      asm("" : "+x"(v0), "+x"(v1));
      for (int r = 0; r < RB; ++r) {
        const __m256 p = _mm256_broadcast_ss(&probs[r][s * kLanes + j]);
        lo[r] = _mm256_fmadd_ps(p, v0, lo[r]);
        hi[r] = _mm256_fmadd_ps(p, v1, hi[r]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(acc + r * D + dv * kLanes, lo[r]);
    _mm256_storeu_ps(acc + r * D + dv * kLanes + 8, hi[r]);
  }
}

// rows [0, RB)'s accumulators (`acc`, D apart), dimensions [d0, d0 + 8 NV) (NV <= 8: the sums in registers), scaled by
// `correction`, plus the chunk's first `seen` float32 values weighted by `probs`: one row at a time, each value's
// dimensions read in order. A value row holds every KV head's dimensions (this head's 256 B of every 1 KB), and
// tile_values_avx2's passes of 16 dimensions over all the rows read 64 B of it at a time, an order the hardware's
// prefetchers follow badly: a C model of a 64-sequence decode's reads ran 1.2-1.4x faster so, the kernel 1.14-1.2x
// from memory on two threads (docs/performance.md). The other rows read the values from L1. Each sum is the same chain
// of multiply-adds as there (the same bits). A decode's requests go in the same order: the next chunk's lines of the
// group, position by position as its first row will read them, one an iteration.
template <int RB, int NV, typename Requests>
inline void row_values_group_avx2(float* acc, int64_t D, int64_t d0, const Piece<float, float>* pieces,
                                  int64_t num_pieces, int64_t value_stride, int64_t seen, const float (*probs)[kChunk],
                                  const float* correction, Requests& requests) {
  constexpr int kUnits = NV / 2;  // of 16 dimensions
  for (int r = 0; r < RB; ++r) {
    __m256 sum[NV];
    const __m256 c = _mm256_set1_ps(correction[r]);
    for (int v = 0; v < NV; ++v) sum[v] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * v), c);
    for (int64_t s = 0; s < num_pieces; ++s) {
      const float* values = pieces[s].values + d0;
      const int64_t n = std::min<int64_t>(pieces[s].n, seen - s * kLanes);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = r * kLanes + j; i < kLanes * kUnits; i += RB * kLanes)
          requests.value_row(s, i / kUnits, d0 / kLanes + i % kUnits);
        const __m256 p = _mm256_broadcast_ss(&probs[r][s * kLanes + j]);
        for (int v = 0; v < NV; ++v)
          sum[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(values + j * value_stride + 8 * v), sum[v]);
      }
    }
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + r * D + d0 + 8 * v, sum[v]);
  }
}

template <int RB, typename Requests>
inline void row_values_avx2(float* acc, int64_t D, const Piece<float, float>* pieces, int64_t num_pieces,
                            int64_t value_stride, int64_t seen, const float (*probs)[kChunk], const float* correction,
                            Requests& requests) {
  for (int64_t d0 = 0; d0 < D; d0 += 4 * kLanes) {  // groups of up to 64 dimensions
    switch (std::min<int64_t>(4 * kLanes, D - d0) / kLanes) {
#define TS_GROUP(U)                                                                                                 \
  case U:                                                                                                           \
    row_values_group_avx2<RB, 2 * U>(acc, D, d0, pieces, num_pieces, value_stride, seen, probs, correction, requests); \
    break
      TS_GROUP(1);
      TS_GROUP(2);
      TS_GROUP(3);
      TS_GROUP(4);
#undef TS_GROUP
      default: assert(false);
    }
  }
}
#endif

// Rows [r0, r0 + RB) (one KV head) against one chunk of keys starting at position `chunk`: scores, the online
// softmax update (once per chunk: FlashAttention's recurrence), and the values added into the accumulators.
// Decode and prompt rows alike take the loops above: RB x pieces (scores) and RB x DVB (values) independent
// chains of multiply-adds. (Prompt tiles once looped over one piece, then one vector of dimensions, at a time:
// RB chains, each waiting on its last multiply-add; float32 prompts of 512 and chunks after 1,024 ran at 56-67
// GFLOP/s against 74-92 now: bench_attention.py's shapes, one thread, alternated.) With AVX2, a float32 decode's
// values take row_values_avx2 instead, a row at a time. A decode item also requests its next chunk as it goes
// (`requests`: a Prefetcher, or a NextChunk in the AVX2 loops); a prompt tile's loops take NoPrefetch. Only a chunk's
// last piece can be partial.
template <int RB, bool DECODE, typename KT, typename VT, typename Requests>
void chunk_rows(Rows& rows, int64_t r0, const Piece<KT, VT>* pieces, int64_t num_pieces, int64_t key_dim_stride,
                int64_t value_stride, int64_t chunk, float* padded, Requests& requests) {
  const int64_t D = rows.head_dim;
  const int64_t DV = D / kLanes;
  // a tile's rows see keys up to their last row's position (rows are in position order): the chunk's keys
  // past it only add zeros (a decode row sees the whole chunk)
  int64_t seen = kChunk;
  if constexpr (!DECODE) {
    seen = std::min<int64_t>(rows.hi[r0 + RB - 1] + 1 - chunk, kChunk);
    if (seen <= 0) return;
    num_pieces = std::min<int64_t>(num_pieces, (seen + kLanes - 1) / kLanes);
  }
  vfloat scores[RB][kPieces];
  for (int r = 0; r < RB; ++r)
    for (int s = 0; s < kPieces; ++s) scores[r][s] = vfloat{};
#ifdef TS_AVX2_TILES
  constexpr bool avx2 = kAvx2Type<KT> && kAvx2Type<VT> && std::is_same<KT, VT>::value;
#else
  constexpr bool avx2 = false;
#endif
  if constexpr (avx2) {
#ifdef TS_AVX2_TILES
    for (int64_t s = 0; s < num_pieces; ++s) {
      if (pieces[s].n < kLanes) {
        pad_keys(pieces[s], D, key_dim_stride, padded);
        piece_scores_avx2<RB>(rows.q + r0 * D, D, padded, kLanes, scores, s, requests);
      } else {
        piece_scores_avx2<RB>(rows.q + r0 * D, D, pieces[s].keys, key_dim_stride, scores, s, requests);
      }
    }
#endif
  } else {
    switch (num_pieces * 2 + (pieces[num_pieces - 1].n < kLanes)) {
#define TS_SCORES(NF, PARTIAL)                                                                \
  chunk_scores<RB, NF, PARTIAL>(rows, r0, pieces, key_dim_stride, padded, requests, scores); \
  break
      case 2: TS_SCORES(1, false);
      case 3: TS_SCORES(0, true);
      case 4: TS_SCORES(2, false);
      case 5: TS_SCORES(1, true);
      case 6: TS_SCORES(3, false);
      case 7: TS_SCORES(2, true);
      case 8: TS_SCORES(4, false);
      case 9: TS_SCORES(3, true);
#undef TS_SCORES
      default: assert(false);
    }
  }

  alignas(64) float probs[RB][kChunk];
  float correction[RB];
  chunk_softmax<RB>(rows, r0, pieces, num_pieces, chunk, scores, probs, correction);
#ifdef TS_AVX2_TILES
  if constexpr (avx2) {
    if constexpr (DECODE && std::is_same<VT, float>::value) {
      row_values_avx2<RB>(rows.acc + r0 * D, D, pieces, num_pieces, value_stride, seen, probs, correction, requests);
    } else {
      for (int64_t dv = 0; dv < DV; ++dv)
        tile_values_avx2<RB>(rows.acc + r0 * D, D, dv, pieces, num_pieces, value_stride, seen, probs, correction,
                             requests);
    }
  } else
#endif
  {
    const int dvb = DV % 4 == 0 ? 4 : DV % 2 == 0 ? 2 : 1;
    if (dvb == 4)
      chunk_values<RB, 4>(rows, r0, pieces, num_pieces, value_stride, seen, probs, correction, requests);
    else if (dvb == 2)
      chunk_values<RB, 2>(rows, r0, pieces, num_pieces, value_stride, seen, probs, correction, requests);
    else
      chunk_values<RB, 1>(rows, r0, pieces, num_pieces, value_stride, seen, probs, correction, requests);
  }
}

#if defined(__x86_64__)
#define TS_BF16_DOT 1
#define TS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// A bfloat16 prompt tile computes its scores and value sums with AVX512-BF16 dot products (vdpbf16ps: 32
// products a step, twice float32's 16 multiply-adds), the probabilities rounded to bfloat16 for the values'
// sum as FlashAttention rounds them on GPUs. Only runs of at least this many queries (a prompt's chunk) take
// it: decode steps and the checks of proposed tokens keep the float32 tiles, whose rows round exactly as a
// decode row does, so greedy output is the same with and without speculation.
constexpr int32_t kDotMinQueries = 64;

// word 2j of a pair vector comes from word j of the first row, word 2j + 1 from word j of the second
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// 16 bfloat16 values of two rows (the first `n` of each, the rest zero) as 16 pairs
TS_BF16_TARGET inline __m512i interleave_rows(const bf16_t* a, const bf16_t* b, __mmask16 valid) {
  const __m512i both = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(valid, a)),
                                          _mm256_maskz_loadu_epi16(valid, b), 1);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
}

// A chunk's keys and values in pairs for the dot products. keys[s * D / 2 + e]: piece s, dimensions 2e and
// 2e + 1 of its 16 keys (lane j holds key j's pair); values[t * DV + v]: keys 2t and 2t + 1 of the chunk,
// dimensions [16 v, 16 v + 16) (lane i holds dimension 16 v + i of both). Missing pieces and keys past a piece's
// end are zero, so that their products are 0 (a probability of 0 times a value never read).
template <int DV>
TS_BF16_TARGET void pair_chunk(const Piece<bf16_t, bf16_t>* pieces, int64_t num_pieces, int64_t key_dim_stride,
                               int64_t value_stride, __m512i* keys, __m512i* values) {
  constexpr int64_t D = DV * kLanes;
  for (int64_t s = 0; s < kPieces; ++s) {
    if (s >= num_pieces) {  // (values too: AMX tiles multiply 16 pairs at a time, past the chunk's end)
      for (int64_t e = 0; e < D / 2; ++e) keys[s * D / 2 + e] = _mm512_setzero_si512();
      for (int64_t t = s * kLanes / 2; t < (s + 1) * kLanes / 2; ++t)
        for (int v = 0; v < DV; ++v) values[t * DV + v] = _mm512_setzero_si512();
      continue;
    }
    const Piece<bf16_t, bf16_t>& piece = pieces[s];
    const __mmask16 valid = piece.n >= kLanes ? __mmask16(0xffff) : __mmask16((1u << piece.n) - 1);
    for (int64_t e = 0; e < D / 2; ++e)
      keys[s * D / 2 + e] = interleave_rows(piece.keys + 2 * e * key_dim_stride,
                                            piece.keys + (2 * e + 1) * key_dim_stride, valid);
    for (int64_t j = 0; j < kLanes; j += 2) {
      const int64_t t = (s * kLanes + j) / 2;
      const bf16_t* first = piece.values + j * value_stride;
      const bf16_t* second = piece.values + (j + 1) * value_stride;
      const __mmask16 rows_valid = j + 1 < piece.n ? __mmask16(0xffff) : __mmask16(0);
      for (int v = 0; v < DV; ++v) {
        if (j >= piece.n) {
          values[t * DV + v] = _mm512_setzero_si512();
        } else {  // the pair's second key may be past the end: its half is zero
          const __m512i both = _mm512_inserti64x4(
              _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + v * kLanes))),
              _mm256_maskz_loadu_epi16(rows_valid, second + v * kLanes), 1);
          values[t * DV + v] = _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
        }
      }
    }
  }
}

// Rows [r0, r0 + RB) of a bfloat16 prompt tile against one chunk in pairs (pair_chunk): scores from the rows'
// query pairs (`queries`: [rows][D / 2], unscaled), the online softmax update, and the values' sum with the
// probabilities rounded to bfloat16. RB x DV accumulators (at most 16) plus DV values and RB probabilities
// stay in registers.
// Only the first NP pieces are multiplied (the rows see no key past them); the others' scores are 0, masked.
template <int RB, int DV, int NP>
TS_BF16_TARGET void chunk_rows_dot(Rows& rows, int64_t r0, const uint32_t* queries, const __m512i* keys,
                                   const __m512i* values, const Piece<bf16_t, bf16_t>* pieces, int64_t num_pieces,
                                   int64_t chunk, int64_t num_pairs, float scale) {
  constexpr int64_t D = DV * kLanes;
  __m512 acc[RB][kPieces];
  for (int r = 0; r < RB; ++r)
    for (int s = 0; s < kPieces; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t e = 0; e < D / 2; ++e) {
    __m512bh q[RB];
    for (int r = 0; r < RB; ++r) q[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[(r0 + r) * D / 2 + e]));
    for (int s = 0; s < NP; ++s) {
      const __m512bh k = (__m512bh)keys[s * D / 2 + e];
      for (int r = 0; r < RB; ++r) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], q[r], k);
    }
  }
  vfloat scores[RB][kPieces];
  for (int r = 0; r < RB; ++r)
    for (int s = 0; s < kPieces; ++s) scores[r][s] = (vfloat)_mm512_mul_ps(acc[r][s], _mm512_set1_ps(scale));
  alignas(64) float probs[RB][kChunk];
  float correction[RB];
  chunk_softmax<RB>(rows, r0, pieces, num_pieces, chunk, scores, probs, correction);
  alignas(64) uint32_t prob_pairs[RB][kChunk / 2];
  for (int r = 0; r < RB; ++r)
    for (int s = 0; s < kPieces; s += 2) {
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(probs[r] + (s + 1) * kLanes),
                                                _mm512_load_ps(probs[r] + s * kLanes));
      _mm512_store_si512(prob_pairs[r] + s * kLanes / 2, (__m512i)both);
    }
  __m512 out[RB][DV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < DV; ++v)
      out[r][v] = _mm512_mul_ps(_mm512_loadu_ps(rows.acc + (r0 + r) * D + v * kLanes), _mm512_set1_ps(correction[r]));
  for (int64_t t = 0; t < num_pairs; ++t) {
    __m512bh weight[RB];
    for (int r = 0; r < RB; ++r) weight[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[r][t]));
    for (int v = 0; v < DV; ++v) {
      const __m512bh value = (__m512bh)values[t * DV + v];
      for (int r = 0; r < RB; ++r) out[r][v] = _mm512_dpbf16_ps(out[r][v], weight[r], value);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(rows.acc + (r0 + r) * D + v * kLanes, out[r][v]);
}

// Rows [r0, r0 + count) of one KV head against a chunk in pairs, RB rows at a time (RB x DV <= 16), the rest
// one by one.
template <int DV>
void chunk_head_dot(Rows& rows, int64_t r0, int64_t count, const uint32_t* queries, const __m512i* keys,
                    const __m512i* values, const Piece<bf16_t, bf16_t>* pieces, int64_t num_pieces, int64_t chunk,
                    int64_t num_pairs, float scale) {
  constexpr int RB = DV <= 4 ? 4 : 2;
  // rows [r, r + rb): the pieces and pairs up to the last key they see (rows are in position order)
  auto block = [&](int64_t r, auto rb) {
    const int64_t seen = std::min<int64_t>(rows.hi[r + decltype(rb)::value - 1] + 1 - chunk, kChunk);
    if (seen <= 0) return;  // the chunk is past every row of the block
    if (rows.lo[r] >= chunk + kChunk) return;  // or before every row's window
    const int64_t pairs = std::min<int64_t>(num_pairs, (seen + 1) / 2);
    switch ((seen + kLanes - 1) / kLanes) {
#define TS_PIECES(NP)                                                                                        \
  case NP:                                                                                                   \
    chunk_rows_dot<decltype(rb)::value, DV, NP>(rows, r, queries, keys, values, pieces, num_pieces, chunk, pairs, \
                                                scale);                                                      \
    break
      TS_PIECES(1);
      TS_PIECES(2);
      TS_PIECES(3);
      TS_PIECES(4);
#undef TS_PIECES
      default: assert(false);
    }
  };
  int64_t r = r0;
  for (; r + RB <= r0 + count; r += RB) block(r, std::integral_constant<int, RB>{});
  for (; r < r0 + count; ++r) block(r, std::integral_constant<int, 1>{});
}

// On CPUs with AMX (Sapphire Rapids and later) the same tiles' products run on the tile unit: 16 rows against 16 keys
// (or dimensions) times 16 pairs in one instruction (TDPBF16PS), in the same order as chunk_head_dot's; the unit
// rounds a pair's two products into a sum differently from VDPBF16PS in a few sums (about 0.03% of a prompt's outputs
// differ, by one unit in bfloat16's last place). A row's result still depends only on its position: every row of a
// dot-product run takes the tiles. A 512-token bf16 prompt of the 106M model: 5.5 ms a layer in dot products against
// 3.2 ms for PyTorch's SDPA, whose matmuls oneDNN runs on AMX (bench_attention.py; docs/performance.md, issue 20).
std::atomic<bool> amx_enabled{true};  // ts_attention_amx: off to compare with the dot products

#ifdef TS_AMX_INTRINSICS
bool amx_supported() { return amx_bf16_usable() && amx_enabled.load(std::memory_order_relaxed); }

// tmm0-3: 16 x 16 float32 sums each; tmm4: m rows of 16 pairs (queries or probabilities); tmm5: 16 pairs of 16
// columns (keys or dimensions). m rows in tmm0-4.
TS_AMX_TARGET void configure_tiles(int m) {
  TileConfig config;
  for (int t = 0; t < 6; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t == 5 ? 16 : m;
  }
  load_tile_config(config);
}

// x + y, or the larger (kMax)
template <bool kMax>
TS_BF16_TARGET inline __m512 combine(__m512 x, __m512 y) {
  return kMax ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y);
}

// Per lane i of the result: v[i]'s 16 lanes summed (or their maximum: kMax) in hsum's tree ((j, j + 8), then
// (j, j + 4), (j, j + 2), (j, j + 1)), so that a sum is the same bits as hsum's, for 16 vectors at once: 15 shuffled
// pairs instead of 16 trees of dependent shuffles. (No lambdas here: GCC compiles them without the function's target.)
template <bool kMax>
TS_BF16_TARGET __m512 reduce16(const __m512 (&v)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)  // lanes [8 h, 8 h + 8): row 2 i + h's lanes j + (j + 8)
    halves[i] = combine<kMax>(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  for (int i = 0; i < 4; ++i)  // 128-bit block c: row 4 i + c's pairs j + (j + 4)
    quarters[i] = combine<kMax>(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; ++i)  // block c: rows 8 i + c and 8 i + 4 + c, two lanes each (j + (j + 2))
    eighths[i] = combine<kMax>(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xee));
  // lane 4 c + p: row 4 p + c
  const __m512 mixed =
      combine<kMax>(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88), _mm512_shuffle_ps(eighths[0], eighths[1], 0xdd));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), mixed);
}

// Row i's sums against piece s of the chunk from a tile's ([16][kChunk]); 0 past the pieces computed
TS_BF16_TARGET inline __m512 tile_sum(const float* sums, int i, int s, int64_t pieces_computed) {
  return s < pieces_computed ? _mm512_load_ps(sums + i * kChunk + s * kLanes) : _mm512_setzero_ps();
}

// The softmax of a tile's rows [r, r + m), m <= 16, from their sums against the chunk (`sums`: [16][kChunk], the first
// `pieces_computed` pieces computed): their probabilities in bfloat16 pairs into `prob_pairs` ([16][kChunk / 2]) and
// their accumulators scaled by the correction, in chunk_softmax's arithmetic (a row's sum in hsum's tree). Row by row,
// the maxima, sums and corrections (each a chain of dependent shuffles, a correction an exp of its own) took most of a
// bf16 prompt's attention on AMX (perf); here the 16 rows' maxima and sums reduce together and their corrections are
// one exp: a 512-token prompt's attention 8% faster (bench_attention.py). Against the rows one by one (random prompts
// with windows and sinks, head_dim 32-128) 4e-5 of the outputs differ, by a unit in bfloat16's last place: where GCC
// had contracted a score's scaling and the row's maximum into one rounding in some instantiations and not in others,
// it is one multiply-subtract here in all.
// kWhole: 16 rows that each see every key of a whole chunk (most of a prompt's blocks), without the masks' arithmetic
// (the same operations on every lane otherwise: the same bits). kScaleAfter (scale > 0): a row's largest score is
// its largest sum times scale (rounding is monotonic), one product a row instead of one a score.
template <int DV, bool kWhole, bool kScaleAfter>
TS_BF16_TARGET void softmax16_to_pairs(Rows& rows, int64_t r, int m, const float* sums, int64_t pieces_computed,
                                       const Piece<bf16_t, bf16_t>* pieces, int64_t num_pieces, int64_t chunk,
                                       float scale, uint32_t* prob_pairs) {
  constexpr int64_t D = DV * kLanes;
  const __m512 minus_infinity = _mm512_set1_ps(-INFINITY);
  __mmask16 visible[16][kPieces];
  // kWhole: 0xffff, not known to GCC (only then is the last piece there to read)
  const __mmask16 every_key = kWhole ? __mmask16((1u << pieces[kPieces - 1].n) - 1) : __mmask16(0);
  __m512 top[16];
  for (int i = 0; i < 16; ++i) {
    top[i] = minus_infinity;
    if constexpr (kWhole) {
      for (int s = 0; s < kPieces; ++s) {
        const __m512 sum = tile_sum(sums, i, s, kPieces);
        top[i] = _mm512_max_ps(top[i], kScaleAfter ? sum : _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
      }
      continue;
    }
    if (i >= m) continue;
    // this row's visible keys of the chunk: [a, b) relative to the chunk, and each piece's keys
    const int64_t a = std::max<int64_t>(rows.lo[r + i] - chunk, 0);
    const int64_t b = std::min<int64_t>(rows.hi[r + i] + 1 - chunk, kChunk);
    for (int s = 0; s < kPieces; ++s) {
      const int64_t from = std::clamp<int64_t>(a - s * kLanes, 0, kLanes);
      const int64_t to = std::clamp<int64_t>(std::min<int64_t>(b - s * kLanes, s < num_pieces ? pieces[s].n : 0), 0,
                                             kLanes);
      visible[i][s] = to > from ? __mmask16(((1u << to) - 1) & ~((1u << from) - 1)) : __mmask16(0);
      const __m512 sum = tile_sum(sums, i, s, pieces_computed);
      const __m512 score = kScaleAfter ? sum : _mm512_mul_ps(sum, _mm512_set1_ps(scale));
      top[i] = _mm512_max_ps(top[i], _mm512_mask_blend_ps(visible[i][s], minus_infinity, score));
    }
  }
  const __mmask16 valid = __mmask16((1u << m) - 1);
  const vfloat chunk_max =
      kScaleAfter ? (vfloat)_mm512_mul_ps(reduce16<true>(top), _mm512_set1_ps(scale)) : (vfloat)reduce16<true>(top);
  const vfloat old_max = (vfloat)_mm512_maskz_loadu_ps(valid, rows.max + r);
  const vfloat new_max = old_max > chunk_max ? old_max : chunk_max;
  const vint none_seen = chunk_max == splat(-INFINITY);  // such a row keeps its state: correction 1, probabilities 0
  const vfloat correction = (none_seen | (old_max == new_max)) ? splat(1.0f)
                            : old_max == splat(-INFINITY)          ? vfloat{}
                                                                   : exp_nonpositive(old_max - new_max);
  // (lanes broadcast from the registers: a lane read back from the vectors' stores stalled on its forwarding, perf)
  const __mmask16 corrected = _mm512_cmp_ps_mask((__m512)correction, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
  __m512 total[16];
  for (int i = 0; i < 16; ++i) {
    const vfloat row_max = (vfloat)_mm512_permutexvar_ps(_mm512_set1_epi32(i), (__m512)new_max);
    vfloat sum = vfloat{};
    vfloat e[kPieces];
    for (int s = 0; s < kPieces; ++s) {
      e[s] = vfloat{};
      if (kWhole || (i < m && visible[i][s])) {  // score - row max in one rounding (GCC contracts chunk_softmax's so)
        const __m512 sum = tile_sum(sums, i, s, kWhole ? kPieces : pieces_computed);
        const vfloat x = (vfloat)_mm512_fmsub_ps(sum, _mm512_set1_ps(scale), (__m512)row_max);
        // (masked in both: a plain product into the sum below could be contracted into one rounding)
        e[s] = (vfloat)_mm512_maskz_mov_ps(kWhole ? every_key : visible[i][s], (__m512)exp_nonpositive(x));
      }
      sum += e[s];
    }
    total[i] = (__m512)sum;
    if (!kWhole && i >= m) continue;
    for (int s = 0; s < kPieces; s += 2)
      _mm512_store_si512(prob_pairs + i * kChunk / 2 + s * kLanes / 2,
                         (__m512i)_mm512_cvtne2ps_pbh((__m512)e[s + 1], (__m512)e[s]));
    if ((corrected >> i) & 1) {  // (x * 1 is x)
      const __m512 factor = _mm512_permutexvar_ps(_mm512_set1_epi32(i), (__m512)correction);
      float* acc = rows.acc + (r + i) * D;
      for (int v = 0; v < DV; ++v)
        _mm512_storeu_ps(acc + v * kLanes, _mm512_mul_ps(_mm512_loadu_ps(acc + v * kLanes), factor));
    }
  }
  const vfloat chunk_sum = (vfloat)reduce16<false>(total);
  const vfloat old_sum = (vfloat)_mm512_maskz_loadu_ps(valid, rows.sum + r);
  _mm512_mask_storeu_ps(rows.sum + r, valid, (__m512)(old_sum * correction + chunk_sum));
  _mm512_mask_storeu_ps(rows.max + r, valid, (__m512)new_max);
}

// Rows [r0, r0 + count) of one KV head against a chunk in pairs (pair_chunk), 16 rows at a time on the tiles.
template <int DV>
TS_AMX_TARGET void chunk_head_amx(Rows& rows, int64_t r0, int64_t count, const uint32_t* queries, const __m512i* keys,
                                  const __m512i* values, const Piece<bf16_t, bf16_t>* pieces, int64_t num_pieces,
                                  int64_t chunk, float scale) {
  constexpr int64_t D = DV * kLanes;
  alignas(64) float sums[16 * kChunk];
  alignas(64) uint32_t prob_pairs[16 * kChunk / 2];
  int configured = 0;
  for (int64_t r = r0; r < r0 + count; r += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, r0 + count - r));
    const int64_t seen = std::min<int64_t>(rows.hi[r + m - 1] + 1 - chunk, kChunk);  // rows in position order
    // the chunk past every row of the block, or before every row's window (an item's rows start at the chunk of its
    // first row's window: with 256-row items and a window of 128, a block's rows saw up to 4 chunks of nothing)
    if (seen <= 0 || rows.lo[r] >= chunk + kChunk) continue;
    if (m != configured) {
      configure_tiles(m);
      configured = m;
    }
    const int64_t np = (seen + kLanes - 1) / kLanes;  // pieces any row of the block sees
    // sums[i][16 s + j] = query r + i . key j of piece s, over the dimensions' pairs 16 at a time
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t e = 0; e < D / 2; e += 16) {
      _tile_loadd(4, queries + r * D / 2 + e, D * 2);
      _tile_loadd(5, keys + e, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (np > 1) {
        _tile_loadd(5, keys + D / 2 + e, 64);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (np > 2) {
        _tile_loadd(5, keys + D + e, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (np > 3) {
        _tile_loadd(5, keys + 3 * D / 2 + e, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, sums, kChunk * 4);
    _tile_stored(1, sums + kLanes, kChunk * 4);
    _tile_stored(2, sums + 2 * kLanes, kChunk * 4);
    _tile_stored(3, sums + 3 * kLanes, kChunk * 4);
    const bool whole = m == 16 && np == kPieces && num_pieces == kPieces && pieces[kPieces - 1].n == kLanes &&
                       rows.lo[r + 15] <= chunk && rows.hi[r] + 1 - chunk >= kChunk;  // rows in position order
    if (whole && scale > 0.0f)
      softmax16_to_pairs<DV, true, true>(rows, r, m, sums, np, pieces, num_pieces, chunk, scale, prob_pairs);
    else if (whole)
      softmax16_to_pairs<DV, true, false>(rows, r, m, sums, np, pieces, num_pieces, chunk, scale, prob_pairs);
    else if (scale > 0.0f)
      softmax16_to_pairs<DV, false, true>(rows, r, m, sums, np, pieces, num_pieces, chunk, scale, prob_pairs);
    else
      softmax16_to_pairs<DV, false, false>(rows, r, m, sums, np, pieces, num_pieces, chunk, scale, prob_pairs);
    // acc[i][16 v + d] += probabilities of row r + i . values of dimension 16 v + d, 16 pairs of keys at a time
    // (pairs past the chunk's keys are zero in both)
    const int64_t steps = seen > kChunk / 2 ? 2 : 1;
    float* acc = rows.acc + r * D;
    for (int64_t v0 = 0; v0 < DV; v0 += 4) {
      _tile_loadd(0, acc + v0 * kLanes, D * 4);
      _tile_loadd(1, acc + (v0 + 1) * kLanes, D * 4);
      if (DV > 2) {
        _tile_loadd(2, acc + (v0 + 2) * kLanes, D * 4);
        _tile_loadd(3, acc + (v0 + 3) * kLanes, D * 4);
      }
      for (int64_t t = 0; t < steps; ++t) {
        _tile_loadd(4, prob_pairs + t * 16, kChunk * 2);
        const __m512i* pairs = values + 16 * t * DV + v0;
        _tile_loadd(5, pairs, DV * 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, pairs + 1, DV * 64);
        _tile_dpbf16ps(1, 4, 5);
        if (DV > 2) {
          _tile_loadd(5, pairs + 2, DV * 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, pairs + 3, DV * 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, acc + v0 * kLanes, D * 4);
      _tile_stored(1, acc + (v0 + 1) * kLanes, D * 4);
      if (DV > 2) {
        _tile_stored(2, acc + (v0 + 2) * kLanes, D * 4);
        _tile_stored(3, acc + (v0 + 3) * kLanes, D * 4);
      }
    }
  }
  if (configured) _tile_release();
}
#else
bool amx_supported() { return false; }

template <int DV>
void chunk_head_amx(Rows&, int64_t, int64_t, const uint32_t*, const __m512i*, const __m512i*,
                    const Piece<bf16_t, bf16_t>*, int64_t, int64_t, float) {
  assert(false);  // amx_supported() is false
}
#endif
#endif  // __x86_64__

// The same for any head_dim, one row at a time, in scalars.
template <typename KT, typename VT>
void chunk_row_scalar(Rows& rows, int64_t row, const Piece<KT, VT>* pieces, int64_t num_pieces,
                      int64_t key_dim_stride, int64_t value_stride, int64_t chunk) {
  const int64_t D = rows.head_dim;
  float s[kPieces * kLanes];
  bool seen[kPieces * kLanes];
  float chunk_max = -INFINITY;
  for (int64_t piece = 0; piece < num_pieces; ++piece) {
    for (int64_t j = 0; j < pieces[piece].n; ++j) {
      const int64_t pos = chunk + piece * kLanes + j;
      const int64_t at = piece * kLanes + j;
      seen[at] = pos >= rows.lo[row] && pos <= rows.hi[row];
      if (!seen[at]) continue;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d)
        dot += rows.q[row * D + d] * to_float(pieces[piece].keys[d * key_dim_stride + j]);
      s[at] = dot;
      chunk_max = std::max(chunk_max, dot);
    }
  }
  if (chunk_max == -INFINITY) return;
  const float new_max = std::max(rows.max[row], chunk_max);
  const float correction = rows.max[row] == -INFINITY ? 0.0f : exp_nonpositive(rows.max[row] - new_max);
  float* o = rows.acc + row * D;
  for (int64_t d = 0; d < D; ++d) o[d] *= correction;
  float sum = 0.0f;
  for (int64_t piece = 0; piece < num_pieces; ++piece) {
    for (int64_t j = 0; j < pieces[piece].n; ++j) {
      const int64_t at = piece * kLanes + j;
      if (!seen[at]) continue;
      const float w = exp_nonpositive(s[at] - new_max);
      sum += w;
      for (int64_t d = 0; d < D; ++d) o[d] += w * to_float(pieces[piece].values[j * value_stride + d]);
    }
  }
  rows.sum[row] = rows.sum[row] * correction + sum;
  rows.max[row] = new_max;
}

// Whether a run of `query_len` queries takes the bfloat16 dot products (or the tile unit) on its chunks in pairs
template <typename T>
bool paired_dots(const Problem& p, int64_t query_len) {
#ifdef TS_BF16_DOT
  const int64_t D = p.head_dim;  // (pieces read in place: blocks of whole pieces)
  return std::is_same<T, bf16_t>::value && (D == 32 || D == 64 || D == 128) && p.block_size % kLanes == 0 &&
         query_len >= kDotMinQueries && bf16_dot_supported();
#else
  (void)p, (void)query_len;
  return false;
#endif
}

// One work item. `following`: the item its thread takes next (or null), whose first chunk a decode requests during
// its own last one; `first_requested`: this item's first chunk was requested so by the one before. Returns whether
// it requested the following item's.
template <typename T>
bool attend(const Problem& p, const Item& item, const Item* following = nullptr, bool first_requested = false) {
  const int64_t D = p.head_dim;
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t NH = item.num_kv_heads;
  auto table_of = [&](const Item& it) {
    return p.block_table +
           static_cast<int64_t>(p.block_table_row ? p.block_table_row[it.run] : it.run) * p.block_table_stride;
  };
  const int32_t* table = table_of(item);
  const int64_t first_pos = static_cast<int64_t>(p.num_computed[item.run]) + item.first_query;
  const int64_t row0 = static_cast<int64_t>(p.query_start[item.run]) + item.first_query;
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);

  // per thread: queries and accumulators, a padded piece of keys, and a chunk's keys and values copied out
  thread_local std::vector<float> scratch;
  // and, for bfloat16 dot products, the rows' queries and a chunk's keys and values in pairs
  const size_t need = static_cast<size_t>(2 * kMaxRows * D + D * kLanes + 2 * kChunk * D) +
                      static_cast<size_t>(kMaxRows * D / 2 + kChunk * D + 16);
  if (scratch.size() < need) scratch.resize(need);
  Rows rows;
  rows.count = item.num_queries * NH * G;
  rows.head_dim = D;
  rows.q = scratch.data();
  rows.acc = rows.q + kMaxRows * D;
  float* padded = rows.acc + kMaxRows * D;
  float* copied_keys = padded + D * kLanes;         // [kPieces][D][kLanes]
  float* copied_values = copied_keys + kChunk * D;  // [kChunk][D]
#ifdef TS_BF16_DOT
  const int64_t DV = D / kLanes;
  const bool dot = paired_dots<T>(p, p.query_len[item.run]);
  const bool amx = dot && amx_supported();
  uint32_t* query_pairs = reinterpret_cast<uint32_t*>(copied_values + kChunk * D);  // [rows][D / 2]
  __m512i* key_pairs = reinterpret_cast<__m512i*>(
      (reinterpret_cast<uintptr_t>(query_pairs + kMaxRows * D / 2) + 63) & ~uintptr_t(63));  // [kPieces][D / 2]
  __m512i* value_pairs = key_pairs + kPieces * D / 2;                                      // [kChunk / 2][DV]
#endif
  for (int64_t m = 0; m < rows.count; ++m) {
    const int64_t i = m / (NH * G), head = item.first_kv_head * G + m % (NH * G);
    const T* src = q + (row0 + i) * p.q_row_stride + head * p.q_head_stride;
#ifdef TS_BF16_DOT
    if (dot)  // the dot-product tiles read the queries in pairs, unscaled
      std::memcpy(query_pairs + m * D / 2, src, D * sizeof(T));
    else
#endif
      for (int64_t d = 0; d < D; ++d) rows.q[m * D + d] = to_float(src[d]) * p.scale;
    std::fill(rows.acc + m * D, rows.acc + (m + 1) * D, 0.0f);
    // a sink starts the online softmax as a key seen first, with score sinks[head] and a zero value
    rows.max[m] = p.sinks ? p.sinks[head] : -INFINITY;
    rows.sum[m] = p.sinks ? 1.0f : 0.0f;
    rows.hi[m] = first_pos + i;
    rows.lo[m] = p.sliding_window > 0 ? std::max<int64_t>(0, rows.hi[m] - p.sliding_window + 1) : 0;
  }
  assert(NH == 1 || item.num_queries == 1);  // so that the rows of one KV head are contiguous
  const int64_t rows_per_head = rows.count / NH;
  const bool vector = D % kLanes == 0;

  // A decode item's next chunk is requested a few lines at a time from inside its loops (the AVX2 loops' float32 and
  // bfloat16 chunks read in place: a NextChunk); a prompt tile's at once, before the current chunk (requests spread
  // inside its loops cost it 2x, measured), and its loops take NoPrefetch (chunk_rows). The prefetcher stays empty
  // where blocks are copied out.
  Prefetcher prefetcher;
  NoPrefetch none;
  const bool decode = item.num_queries == 1;
  bool requested_following = false;
  // one chunk of head h against that head's rows; a decode's loops request its next chunk (`requests`), a prompt
  // tile's take `none`
  auto attend_chunk = [&](int64_t h, auto* pieces, int64_t num_pieces, int64_t key_dim_stride, int64_t value_stride,
                          int64_t chunk, auto& requests) {
    using P = std::remove_pointer_t<decltype(pieces)>;
    using KT = std::remove_cv_t<std::remove_pointer_t<decltype(P::keys)>>;
    using VT = std::remove_cv_t<std::remove_pointer_t<decltype(P::values)>>;
    const int64_t r0 = h * rows_per_head;
    if (!vector) {
      for (int64_t r = r0; r < r0 + rows_per_head; ++r)
        chunk_row_scalar<KT, VT>(rows, r, pieces, num_pieces, key_dim_stride, value_stride, chunk);
    } else {
      // rows [from, to) RB at a time (a row rounds the same whatever its block: its sums run in the same order)
      auto row_blocks = [&](auto rb, int64_t from, int64_t to) {
        constexpr int RB = decltype(rb)::value;
        for (int64_t r = from; r < to; r += RB) {
          if (decode)
            chunk_rows<RB, true>(rows, r, pieces, num_pieces, key_dim_stride, value_stride, chunk, padded, requests);
          else
            chunk_rows<RB, false>(rows, r, pieces, num_pieces, key_dim_stride, value_stride, chunk, padded, none);
        }
      };
      // rows [from, from + count) in blocks of the largest of 4, 3, 2, 1 that divides count
      auto divided_blocks = [&](int64_t from, int64_t count) {
        if (count % 4 == 0)
          row_blocks(std::integral_constant<int, 4>{}, from, from + count);
        else if (count % 3 == 0)
          row_blocks(std::integral_constant<int, 3>{}, from, from + count);
        else if (count % 2 == 0)
          row_blocks(std::integral_constant<int, 2>{}, from, from + count);
        else
          row_blocks(std::integral_constant<int, 1>{}, from, from + count);
      };
      // a KV head's rows 4 at a time, then the rest (a decode item's rows, the KV head's query heads: 3 at a time
      // where 3 divides them and 4 does not). Rows one at a time, each reading the chunk again, made decodes with 7
      // query heads a KV head (Qwen2.5) 1.35-1.44x slower (docs/performance.md)
      if (decode && rows_per_head % 4 != 0 && rows_per_head % 3 == 0) {
        divided_blocks(r0, rows_per_head);
      } else {
        const int64_t bulk = rows_per_head / 4 * 4;
        row_blocks(std::integral_constant<int, 4>{}, r0, r0 + bulk);
        if (bulk < rows_per_head) divided_blocks(r0 + bulk, rows_per_head - bulk);
      }
    }
  };

  // Chunks of kChunk positions aligned to multiples of kChunk (pieces aligned to kLanes): a row's sequence
  // of chunks (and so its rounding) depends only on its position, not on the block size, the KV width or
  // the other rows.
  const int64_t key_end = rows.hi[rows.count - 1] + 1;  // rows are in position order: the last sees the most
  const int64_t first_chunk = rows.lo[0] / kChunk * kChunk;
  if (p.block_size % kLanes == 0) {  // every piece lies in one block: read in place
    // the item's heads of a block: its keys (all of the block's positions, requested with the chunk holding
    // the block's first one) and the values of each position
    const int64_t k_bytes = ((NH - 1) * p.k.head + (D - 1) * p.k.dim + p.block_size) * int64_t(sizeof(T));
    const int64_t v_bytes = ((NH - 1) * p.v.head + D) * int64_t(sizeof(T));
    auto request = [&](int64_t chunk) {
      const int64_t chunk_end = std::min(key_end, chunk + kChunk);
      for (int64_t pos = chunk; pos < chunk_end; pos = (pos / p.block_size + 1) * p.block_size) {
        const int64_t block = pos / p.block_size, physical = table[block];
        if (pos % p.block_size == 0 || chunk == first_chunk)
          prefetcher.add(kc + physical * p.k.block + item.first_kv_head * p.k.head, k_bytes);
        const T* values = vc + physical * p.v.block + item.first_kv_head * p.v.head;
        for (int64_t t = pos % p.block_size; t < p.block_size && block * p.block_size + t < chunk_end; ++t)
          prefetcher.add(values + t * p.v.token, v_bytes);
      }
      prefetcher.spread(NH * (D + kChunk));  // about the calls of step() in one chunk of every head
    };
    if (!first_requested) {
      request(first_chunk);
      prefetcher.finish();
    }
    // head h (of those from first_kv_head) of a run's chunk at `chunk` (its keys end at `end`, its blocks in `blocks`):
    // its pieces, in place, and their count
    auto run_pieces = [&](const int32_t* blocks, int64_t first_kv_head, int64_t end, int64_t chunk, int64_t h,
                          Piece<T, T>* pieces) {
      const int64_t chunk_end = std::min(end, chunk + kChunk);
      int64_t num_pieces = 0;
      for (int64_t start = chunk; start < chunk_end; start += kLanes) {
        const int64_t block = start / p.block_size, offset = start % p.block_size;
        const int64_t physical = blocks[block];
        pieces[num_pieces++] = {kc + physical * p.k.block + (first_kv_head + h) * p.k.head + offset * p.k.token,
                                vc + physical * p.v.block + (first_kv_head + h) * p.v.head + offset * p.v.token,
                                std::min<int64_t>(kLanes, chunk_end - start)};
      }
      return num_pieces;
    };
    auto chunk_pieces = [&](int64_t chunk, int64_t h, Piece<T, T>* pieces) {
      return run_pieces(table, item.first_kv_head, key_end, chunk, h, pieces);
    };
    Piece<T, T> pieces[kPieces];
    // bfloat16 and float16 keys and values are converted once per chunk where many row blocks read them (a
    // prompt's tile), not at every read
    const bool convert_once = !std::is_same<T, float>::value && vector && rows_per_head > kRowsConvertedOnce;
    Piece<float, float> converted[kPieces];
#ifdef TS_AVX2_TILES
    const bool next_in_loops = kAvx2Type<T> && decode && vector && !convert_once;
    // the following item's first chunk, requested during this item's last: a decode's of as many KV heads, its keys
    // from position 0 (decodes of 300 tokens have 5 chunks: their first, requested at once, stalls the core where the
    // loops' requests do not; 64 and 256 of them 1.07-1.16x faster in bfloat16, 1.02-1.11x in float32, alternated)
    const bool request_following = next_in_loops && following && following->num_queries == 1 &&
                                   following->num_kv_heads == NH && p.sliding_window <= 0;
    const int64_t following_end = request_following ? p.num_computed[following->run] + following->first_query + 1 : 0;
#else
    const bool next_in_loops = false;
    (void)following;
#endif
    for (int64_t chunk = first_chunk; chunk < key_end; chunk += kChunk) {
      const int64_t chunk_end = std::min(key_end, chunk + kChunk);
      if (chunk + kChunk < key_end && !next_in_loops) {
        request(chunk + kChunk);
        if (!decode) prefetcher.finish();
      }
      for (int64_t h = 0; h < NH; ++h) {
        const int64_t num_pieces = chunk_pieces(chunk, h, pieces);
#ifdef TS_BF16_DOT
        if constexpr (std::is_same<T, bf16_t>::value) {
          if (dot) {
            const int64_t num_pairs = (chunk_end - chunk + 1) / 2;
            switch (DV) {
#define TS_DOT(DVC)                                                                                           \
  case DVC:                                                                                                   \
    pair_chunk<DVC>(pieces, num_pieces, p.k.dim, p.v.token, key_pairs, value_pairs);                          \
    if (amx)                                                                                                  \
      chunk_head_amx<DVC>(rows, h * rows_per_head, rows_per_head, query_pairs, key_pairs, value_pairs, pieces, \
                          num_pieces, chunk, p.scale);                                                        \
    else                                                                                                      \
      chunk_head_dot<DVC>(rows, h * rows_per_head, rows_per_head, query_pairs, key_pairs, value_pairs, pieces, \
                          num_pieces, chunk, num_pairs, p.scale);                                             \
    break
              TS_DOT(2);
              TS_DOT(4);
              TS_DOT(8);
#undef TS_DOT
              default: assert(false);
            }
            continue;
          }
        }
#endif
        if (convert_once) {  // the chunk in float32 once, for every row block of the prompt's tile
          for (int64_t s = 0; s < num_pieces; ++s) {
            float* keys = copied_keys + s * D * kLanes;
            for (int64_t d = 0; d < D; ++d) {  // a piece never crosses its block (block_size % kLanes == 0)
              const vfloat kd = load16(pieces[s].keys + d * p.k.dim);
              std::memcpy(keys + d * kLanes, &kd, sizeof kd);
            }
            for (int64_t j = 0; j < pieces[s].n; ++j)
              for (int64_t dv = 0; dv < D / kLanes; ++dv) {
                const vfloat vd = load16(pieces[s].values + j * p.v.token + dv * kLanes);
                std::memcpy(copied_values + (s * kLanes + j) * D + dv * kLanes, &vd, sizeof vd);
              }
            converted[s] = {keys, copied_values + s * kLanes * D, pieces[s].n};
          }
          attend_chunk(h, converted, num_pieces, kLanes, D, chunk, prefetcher);
          continue;
        }
#ifdef TS_AVX2_TILES
        if constexpr (kAvx2Type<T>) {
          if (next_in_loops && (chunk + kChunk < key_end || request_following)) {
            Piece<T, T> next_pieces[kPieces];
            const int64_t num_next = chunk + kChunk < key_end
                                         ? chunk_pieces(chunk + kChunk, h, next_pieces)
                                         : run_pieces(table_of(*following), following->first_kv_head, following_end, 0,
                                                      h, next_pieces);
            requested_following = chunk + kChunk >= key_end;
            NextChunk<T> next{{}, {}, p.k.dim, p.v.token};
            for (int64_t s = 0; s < kPieces; ++s) {  // (a piece the next chunk lacks: its lines in this one, in cache)
              const Piece<T, T>& piece = s < num_next ? next_pieces[s] : pieces[std::min(s, num_pieces - 1)];
              next.keys[s] = piece.keys;
              next.values[s] = piece.values;
            }
            attend_chunk(h, pieces, num_pieces, p.k.dim, p.v.token, chunk, next);
            continue;
          }
        }
#endif
        attend_chunk(h, pieces, num_pieces, p.k.dim, p.v.token, chunk, prefetcher);
      }
      prefetcher.finish();
    }
  } else {  // blocks smaller than a piece (or not a multiple of it): copy each chunk's keys and values out
    Piece<float, float> pieces[kPieces];
    for (int64_t chunk = first_chunk; chunk < key_end; chunk += kChunk) {
      const int64_t n = std::min<int64_t>(kChunk, key_end - chunk);
      for (int64_t h = 0; h < NH; ++h) {
        int64_t num_pieces = 0;
        for (int64_t start = 0; start < n; start += kLanes) {
          float* keys = copied_keys + num_pieces * D * kLanes;
          const int64_t valid = std::min<int64_t>(kLanes, n - start);
          for (int64_t j = 0; j < kLanes; ++j) {
            const int64_t pos = chunk + start + std::min(j, valid - 1);  // lanes past the keys repeat the last
            const int64_t block = table[pos / p.block_size], offset = pos % p.block_size;
            const T* k = kc + block * p.k.block + (item.first_kv_head + h) * p.k.head + offset * p.k.token;
            const T* v = vc + block * p.v.block + (item.first_kv_head + h) * p.v.head + offset * p.v.token;
            for (int64_t d = 0; d < D; ++d) keys[d * kLanes + j] = to_float(k[d * p.k.dim]);
            for (int64_t d = 0; d < D; ++d) copied_values[(start + j) * D + d] = to_float(v[d]);
          }
          pieces[num_pieces++] = {keys, copied_values + start * D, valid};
        }
        attend_chunk(h, pieces, num_pieces, kLanes, D, chunk, none);
      }
    }
  }

  T* out = static_cast<T*>(p.out);
  for (int64_t m = 0; m < rows.count; ++m) {
    const int64_t i = m / (NH * G), head = item.first_kv_head * G + m % (NH * G);
    T* dst = out + (row0 + i) * p.out_row_stride + head * p.out_head_stride;
    const float inv = 1.0f / rows.sum[m];
    int64_t d = 0;
#if defined(__AVX512F__)
    if constexpr (std::is_same<T, bf16_t>::value)  // 16 at a time, rounded as to_bf16 (GCC vectorized 8 at a time)
      for (; d + 16 <= D; d += 16)
        store_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(rows.acc + m * D + d), _mm512_set1_ps(inv)), dst + d);
#endif
    for (; d < D; ++d) store(rows.acc[m * D + d] * inv, dst + d);
  }
  return requested_following;
}

template <typename T>
void run(const Problem& p, int64_t num_runs) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t threads = at::get_num_threads();
  // Decode runs (one query) take every KV head in one item, so that a block's keys and values are read as
  // contiguous runs, unless there are too few runs to keep the threads busy; a prompt chunk is cut into
  // tiles of queries of one KV head.
  int64_t num_decodes = 0;
  for (int32_t r = 0; r < num_runs; ++r) num_decodes += p.query_len[r] == 1;
  int64_t heads_per_decode = std::min<int64_t>(p.num_kv_heads, std::max<int64_t>(1, kItemRows / G));
  while (heads_per_decode > 1 && (num_decodes * (p.num_kv_heads / heads_per_decode) < 4 * threads ||
                                  p.num_kv_heads % heads_per_decode != 0))
    --heads_per_decode;
  // paired prompt runs: items of up to kPairedItemRows rows, fewer where that would leave threads without items
  auto paired_items = [&](int64_t rows) {
    int64_t n = 0;
    for (int32_t r = 0; r < num_runs; ++r)
      if (paired_dots<T>(p, p.query_len[r]))
        n += (p.query_len[r] + std::max<int64_t>(1, rows / G) - 1) / std::max<int64_t>(1, rows / G) * p.num_kv_heads;
    return n;
  };
  int64_t paired_rows = kPairedItemRows;
  while (paired_rows > kItemRows && paired_items(paired_rows) < 4 * threads) paired_rows /= 2;
  std::vector<Item> items;
  for (int32_t r = 0; r < num_runs; ++r) {
    const int32_t len = p.query_len[r];
    const int32_t nh = static_cast<int32_t>(len == 1 ? heads_per_decode : 1);
    const int64_t queries_per_item = std::max<int64_t>(1, (paired_dots<T>(p, len) ? paired_rows : kItemRows) / G);
    for (int32_t first = 0; first < len; first += static_cast<int32_t>(queries_per_item)) {
      const int32_t nq = std::min<int32_t>(static_cast<int32_t>(queries_per_item), len - first);
      int64_t keys = static_cast<int64_t>(p.num_computed[r]) + first + nq;
      if (p.sliding_window > 0) keys = std::min<int64_t>(keys, p.sliding_window + nq);
      for (int32_t h = 0; h < p.num_kv_heads; h += nh)
        items.push_back({r, h, nh, first, nq, double(keys) * (nq * G * nh + 8)});
    }
  }
  // the most expensive first, then handed out one at a time: no thread waits on another's long tail
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(threads, num_items);
  if (workers <= 1) {
    // one thread (a pooled step's; or one item): the items on the decode pool's threads where the caller runs its GEMVs
    // there
    // (an item's results do not depend on the thread that computes it)
    struct Pieces {
      const Problem* p;
      const Item* items;
    } pieces{&p, items.data()};
    const auto piece = [](const void* ctx, int64_t i) {
      const Pieces& c = *static_cast<const Pieces*>(ctx);
      attend<T>(*c.p, c.items[i]);
    };
    if (num_items < 2 || ts_pool_run_pieces(num_items, piece, &pieces) != 0) {
      bool requested = false;
      for (int64_t i = 0; i < num_items; ++i)
        requested = attend<T>(p, items[i], i + 1 < num_items ? &items[i + 1] : nullptr, requested);
    }
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // each thread claims its next item before it attends to the current one, whose last chunk requests its first
    bool requested = false;
    for (int64_t i = next.fetch_add(1); i < num_items;) {
      const int64_t following = next.fetch_add(1);
      requested = attend<T>(p, items[i], following < num_items ? &items[following] : nullptr, requested);
      i = following;
    }
  });
}

template <typename T>
void write_kv(const Problem& p, void* k_cache, void* v_cache, const void* k, int64_t k_row_stride,
              int64_t k_head_stride, const void* v, int64_t v_row_stride, int64_t v_head_stride,
              const int64_t* slot_mapping, int64_t num_tokens) {
  T* kc = static_cast<T*>(k_cache);
  T* vc = static_cast<T*>(v_cache);
  const T* ks = static_cast<const T*>(k);
  const T* vs = static_cast<const T*>(v);
  const int64_t D = p.head_dim;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slot_mapping[t] / p.block_size, offset = slot_mapping[t] % p.block_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      T* kd = kc + block * p.k.block + offset * p.k.token + h * p.k.head;
      const T* src = ks + t * k_row_stride + h * k_head_stride;
      for (int64_t d = 0; d < D; ++d) kd[d * p.k.dim] = src[d];
      std::memcpy(vc + block * p.v.block + offset * p.v.token + h * p.v.head, vs + t * v_row_stride + h * v_head_stride,
                  D * sizeof(T));
    }
  }
}

Problem make_problem(const int64_t* k_layout, const int64_t* v_layout, int64_t block_size, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim) {
  Problem p{};
  p.k = {k_layout[0], k_layout[1], k_layout[2], k_layout[3]};
  p.v = {v_layout[0], v_layout[1], v_layout[2], v_layout[3]};
  p.block_size = block_size;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  return p;
}

bool valid(const Problem& p) {
  return p.head_dim > 0 && p.num_kv_heads > 0 && p.num_heads > 0 && p.num_heads % p.num_kv_heads == 0 &&
         p.num_heads / p.num_kv_heads <= kItemRows && p.k.token == 1 && p.v.dim == 1;
}

}  // namespace

extern "C" {

// Whether bfloat16 prompt tiles run on AMX where the CPU has it (1, the default) or in AVX512-BF16 dot products (0):
// `enable` 0 or 1 sets it, -1 leaves it. Returns whether they run on AMX now (tests compare the two).
int ts_attention_amx(int enable) {
#if defined(__x86_64__)
  if (enable >= 0) amx_enabled.store(enable != 0);
  return amx_supported() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}

// The cache layouts are 4 strides each (elements): block, token, head, dim of one layer's K and V caches;
// keys must be dim-major (token stride 1) and values token-major (dim stride 1).
// dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0, or a negative number for arguments it cannot take.
int ts_paged_attention(int dtype, void* out, int64_t out_row_stride, int64_t out_head_stride, const void* q,
                       int64_t q_row_stride, int64_t q_head_stride, const void* k_cache, const void* v_cache,
                       const int64_t* k_layout, const int64_t* v_layout, int64_t num_runs,
                       const int32_t* query_start, const int32_t* query_len, const int32_t* num_computed,
                       const int32_t* block_table, int64_t block_table_stride, const int32_t* block_table_row,
                       int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t sliding_window, float scale, const float* sinks) {
  Problem p = make_problem(k_layout, v_layout, block_size, num_heads, num_kv_heads, head_dim);
  if (!valid(p)) return -1;
  p.out = out;
  p.out_row_stride = out_row_stride;
  p.out_head_stride = out_head_stride;
  p.q = q;
  p.q_row_stride = q_row_stride;
  p.q_head_stride = q_head_stride;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.query_start = query_start;
  p.query_len = query_len;
  p.num_computed = num_computed;
  p.block_table = block_table;
  p.block_table_stride = block_table_stride;
  p.block_table_row = block_table_row;
  p.sliding_window = sliding_window;
  p.scale = scale;
  p.sinks = sinks;
  switch (dtype) {
    case 0: run<float>(p, num_runs); return 0;
    case 1: run<bf16_t>(p, num_runs); return 0;
#ifdef TS_HAVE_FP16
    case 2: run<fp16_t>(p, num_runs); return 0;
#endif
    default: return -2;
  }
}

// Writes the step's keys and values ([tokens, kv_heads, head_dim] each, with their own strides) into their
// slots (slot = block * block_size + offset).
int ts_write_kv(int dtype, void* k_cache, void* v_cache, const int64_t* k_layout, const int64_t* v_layout,
                const void* k, int64_t k_row_stride, int64_t k_head_stride, const void* v, int64_t v_row_stride,
                int64_t v_head_stride, const int64_t* slot_mapping, int64_t num_tokens, int64_t block_size,
                int64_t num_kv_heads, int64_t head_dim) {
  Problem p = make_problem(k_layout, v_layout, block_size, num_kv_heads, num_kv_heads, head_dim);
  if (!valid(p)) return -1;
#define TS_WRITE(T)                                                                                            \
  write_kv<T>(p, k_cache, v_cache, k, k_row_stride, k_head_stride, v, v_row_stride, v_head_stride, slot_mapping, \
              num_tokens)
  switch (dtype) {
    case 0: TS_WRITE(float); return 0;
    case 1: TS_WRITE(bf16_t); return 0;
#ifdef TS_HAVE_FP16
    case 2: TS_WRITE(fp16_t); return 0;
#endif
    default: return -2;
  }
#undef TS_WRITE
}

}  // extern "C"
