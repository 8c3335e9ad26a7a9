// RMSNorm and rotary embeddings in one pass each, for models run eagerly on the CPU (a rank of a parallel layout,
// or a model below the size that is compiled): the PyTorch expressions take 9 (RMSNorm) and 7 per tensor (rotary)
// operators, each a pass over the activations and 2-5 us of dispatch at a decode step (docs/performance.md).
// Compiled forwards keep the expressions, which inductor fuses. Also the sampler's row argmax (argmax_rows) and its
// draws (sample_rows).
//
// Both round exactly as the expressions do in the tensor's dtype: rotary's products and sum each rounded,
// RMSNorm's sum of squares added in the order of PyTorch's own reduction (sum_of_squares), so their results are
// bitwise the expressions'.
//
// Entry points are extern "C" with raw pointers and strides (called through ctypes), as cpu_attention.cpp's.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "cpu_common.h"

#include "cpu_no_contract.h"  // PyTorch's separate operators round each result

namespace {

// float -> T, rounding to nearest even as torch's conversion to bfloat16 does
template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline bf16_t from_float<bf16_t>(float v) {
  return to_bf16(v);
}

// a value rounded to T and back: the result of an operator in dtype T
template <typename T>
inline float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The sum of a row's squares in the order of PyTorch's CPU sum (aten/src/ATen/native/cpu/SumKernel.cpp,
// `vectorized_inner_sum` / `scalar_inner_sum`), so that RMSNorm rounds exactly as `x.pow(2).mean(-1)` does: the row
// as vectors of `lanes` floats (Vectorized<float>::size(): 16 with AVX-512, 8 with AVX2; 1 where the row is
// shorter), four interleaved accumulators (its ILP factor) over blocks of 16 vectors each, their block sums
// cascaded (`multi_row_sum`'s levels), the four added, then the lanes in order after the row's scalar tail.
constexpr int kMaxLanes = 16;
constexpr int kIlp = 4;
constexpr int kLevels = 4;

// multi_row_sum's cascade over `groups` groups of kIlp vectors: a level's sums go up one level every `step` groups
struct Cascade {
  int64_t power, step, mask;
  explicit Cascade(int64_t groups) {
    int64_t ceil_log2 = 1;
    if (groups > 2) {
      ceil_log2 = 0;
      while ((int64_t(1) << ceil_log2) < groups) ++ceil_log2;
    }
    power = std::max<int64_t>(4, ceil_log2 / kLevels);
    step = int64_t(1) << power;
    mask = step - 1;
  }
};

template <typename T>
float sum_of_squares(const T* row, int64_t dim, int64_t lanes) {
  if (dim < lanes) lanes = 1;
  const int64_t vectors = dim / lanes;
  const int64_t groups = vectors / kIlp;  // multi_row_sum's rows: kIlp vectors each
  const Cascade cascade(groups);
  const int64_t level_power = cascade.power, level_step = cascade.step, level_mask = cascade.mask;
  float acc[kLevels][kIlp][kMaxLanes] = {};
  auto add_group = [&](int64_t g) {
    for (int k = 0; k < kIlp; ++k)
      for (int64_t l = 0; l < lanes; ++l) {
        const float v = to_float(row[(g * kIlp + k) * lanes + l]);
        acc[0][k][l] += v * v;
      }
  };
  int64_t g = 0;
  while (g + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++g) add_group(g);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int64_t l = 0; l < lanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((g & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(g);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = groups * kIlp; v < vectors; ++v)  // row_sum's tail of vectors
    for (int64_t l = 0; l < lanes; ++l) {
      const float x = to_float(row[v * lanes + l]);
      acc[0][0][l] += x * x;
    }
  for (int k = 1; k < kIlp; ++k)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.0f;
  for (int64_t d = vectors * lanes; d < dim; ++d) {  // the scalar tail, then the lanes
    const float x = to_float(row[d]);
    sum += x * x;
  }
  for (int64_t l = 0; l < lanes; ++l) sum += acc[0][0][l];
  return sum;
}

// The same sums with the lanes as vectors of L floats (GCC/Clang vector extensions: a register where the build
// targets this CPU), every lane's operations in the same order, so the same bits; and the scaling of a row 16
// elements at a time (each element on its own). The scalar loops above took 515 us for a 512 x 1024 bf16 RMSNorm
// (a 512-token prompt of the 106M model runs 17: 8.6 ms of a 207 ms prefill) on a 2-core Sapphire Rapids, these
// 250-285 us (torch profile; docs/performance.md, issue 20).
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef uint32_t vuint8 __attribute__((vector_size(8 * sizeof(uint32_t))));
template <int L>
struct LaneTypes;
template <>
struct LaneTypes<16> {
  using F = vfloat;
  using U = vuint;
};
template <>
struct LaneTypes<8> {
  using F = vfloat8;
  using U = vuint8;
};

template <int L>
struct Lanes {
  using F = typename LaneTypes<L>::F;
  using U = typename LaneTypes<L>::U;

  static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static F load(const bf16_t* p) {
    if constexpr (L == 16) {
      return load16(p);  // cpu_common.h: one widening move with AVX-512
    } else {
      U w;
      for (int l = 0; l < L; ++l) w[l] = static_cast<uint32_t>(p[l]) << 16;
      F v;
      std::memcpy(&v, &w, sizeof v);
      return v;
    }
  }
  // v rounded to T and back (to_bf16's rounding, lane by lane)
  static F round(F v, float*) { return v; }
  static F round(F v, bf16_t*) {
#if defined(__AVX512F__)
    if constexpr (L == 16) return reinterpret_cast<F>(round_bf16x16(reinterpret_cast<__m512>(v)));
#endif
    U bits;
    std::memcpy(&bits, &v, sizeof bits);
    const U nan = (U)((bits & 0x7fffffffu) > 0x7f800000u);
    const U rounded = ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
    const U quiet = ((bits >> 16) | 0x40u) << 16;
    const U result = (nan & quiet) | (~nan & rounded);
    F out;
    std::memcpy(&out, &result, sizeof out);
    return out;
  }
  static void store(F v, float* p) { std::memcpy(p, &v, sizeof v); }
  static void store(F v, bf16_t* p) {
#if defined(__AVX512F__)
    if constexpr (L == 16) {
      store_bf16x16(reinterpret_cast<__m512>(v), p);
      return;
    }
#endif
    const F r = round(v, p);
    U bits;
    std::memcpy(&bits, &r, sizeof bits);
    for (int l = 0; l < L; ++l) p[l] = static_cast<bf16_t>(bits[l] >> 16);
  }
};

template <int L, typename T>
float sum_of_squares_vec(const T* row, int64_t dim) {
  using V = Lanes<L>;
  using F = typename V::F;
  const int64_t vectors = dim / L;
  const int64_t groups = vectors / kIlp;
  const Cascade cascade(groups);
  const int64_t level_power = cascade.power, level_step = cascade.step, level_mask = cascade.mask;
  F acc[kLevels][kIlp] = {};
  int64_t g = 0;
  auto add_group = [&](int64_t group) {
    for (int k = 0; k < kIlp; ++k) {
      const F v = V::load(row + (group * kIlp + k) * L);
      acc[0][k] += v * v;
    }
  };
  while (g + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++g) add_group(g);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = F{};
      }
      if ((g & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(g);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k] += acc[j][k];
  for (int64_t v = groups * kIlp; v < vectors; ++v) {
    const F x = V::load(row + v * L);
    acc[0][0] += x * x;
  }
  for (int k = 1; k < kIlp; ++k) acc[0][0] += acc[0][k];
  float sum = 0.0f;
  for (int64_t d = vectors * L; d < dim; ++d) {
    const float x = to_float(row[d]);
    sum += x * x;
  }
  for (int l = 0; l < L; ++l) sum += acc[0][0][l];
  return sum;
}

// one row: weight * (x * scale).to(dtype), in dtype
template <int L, typename T>
void scale_row_vec(const T* row, const T* weight, float scale, int64_t dim, T* o) {
  using V = Lanes<L>;
  using F = typename V::F;
  F s;
  for (int l = 0; l < L; ++l) s[l] = scale;
  int64_t d = 0;
  for (; d + L <= dim; d += L) V::store(V::load(weight + d) * V::round(V::load(row + d) * s, o), o + d);
  for (; d < dim; ++d) o[d] = from_float<T>(to_float(weight[d]) * round_to<T>(to_float(row[d]) * scale));
}

// one row's RMSNorm into o
template <typename T>
void norm_row(const T* row, int64_t dim, const T* weight, float eps, int64_t lanes, T* o) {
  const float squares = lanes == 16 && dim >= 16 ? sum_of_squares_vec<16>(row, dim)
                        : lanes == 8 && dim >= 8 ? sum_of_squares_vec<8>(row, dim)
                                                 : sum_of_squares(row, dim, lanes);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
  scale_row_vec<16>(row, weight, scale, dim, o);  // each element on its own: any width
}

inline int64_t norm_grain(int64_t dim) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(dim, 1)); }

// row r = (o, i): x[o * outer_stride + i * inner_stride + d], out[(o * inner + i) * dim + d]
template <typename T>
void rms_norm(const T* x, int64_t outer, int64_t inner, int64_t outer_stride, int64_t inner_stride, int64_t dim,
              const T* weight, float eps, int64_t lanes, T* out) {
  at::parallel_for(0, outer * inner, norm_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(x + (r / inner) * outer_stride + (r % inner) * inner_stride, dim, weight, eps, lanes, out + r * dim);
  });
}

// A decoder layer's residual add and the norm after it, row by row: sum = x + residual rounded to T (PyTorch's add),
// out = sum's RMSNorm, the row's sum still in L1 when the norm reads it. Rows of dim, contiguous. (Inductor's add
// and the norm apart passed over a 512-token prompt's residual stream twice: 1.4 ms of a 119 ms bfloat16 prefill of
// the 106M model on a Zen 5.)
template <typename T>
void add_rms_norm(const T* x, const T* residual, int64_t rows, int64_t dim, const T* weight, float eps,
                  int64_t lanes, T* sum, T* out) {
  using V = Lanes<16>;
  at::parallel_for(0, rows, norm_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *a = x + r * dim, *b = residual + r * dim;
      T* row = sum + r * dim;
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16) V::store(V::load(a + d) + V::load(b + d), row + d);
      for (; d < dim; ++d) row[d] = from_float<T>(to_float(a[d]) + to_float(b[d]));
      norm_row(row, dim, weight, eps, lanes, out + r * dim);
    }
  });
}

// One head's rotation, `half` = dim / 2 a multiple of L: L dimensions of each half a vector, every product and sum
// rounded to T as the scalar loop below rounds them (rounding to nearest is symmetric, so -(x * s) is (-x) * s).
// The scalar loop took 398 us for a 512-token bf16 prompt's q and k (16 and 4 heads of 64) on a 2-core Sapphire
// Rapids, a tenth of that in memory traffic. ROUNDED: cos and sin were rounded to T already (once per token).
template <int L, bool ROUNDED, typename T>
void rotate_head_vec(const T* v, const float* cos, const float* sin, int64_t half, T* o) {
  using V = Lanes<L>;
  using F = typename V::F;
  T* tag = nullptr;
  auto table = [&](const float* p) { return ROUNDED ? V::load(p) : V::round(V::load(p), tag); };
  for (int64_t d = 0; d < half; d += L) {
    const F lo = V::load(v + d), hi = V::load(v + d + half);
    const F cos_lo = table(cos + d), cos_hi = table(cos + d + half);
    const F sin_lo = table(sin + d), sin_hi = table(sin + d + half);
    V::store(V::round(lo * cos_lo, tag) + V::round(-hi * sin_lo, tag), o + d);
    V::store(V::round(hi * cos_hi, tag) + V::round(lo * sin_hi, tag), o + d + half);
  }
}

// x [tokens, heads, dim] (strides token_stride, head_stride; dimension stride 1) rotated by its token's position:
// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]); cos_sin [2, positions, dim] float32,
// rounded to T first (as `.to(dtype)`). out [tokens, heads, dim] contiguous.
template <typename T>
void rotate(const T* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride, int64_t dim,
            const int64_t* positions, const float* cos_sin, int64_t table_positions, T* out) {
  const int64_t half = dim / 2;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * dim, 1));
  const int lanes = half % 16 == 0 ? 16 : half % 8 == 0 ? 8 : 1;
  // bfloat16: a token's cos and sin rounded once for all its heads (a 512-token prompt's q and k, 20 heads of 64, took
  // 1.6x as long rounding them per head on a Zen 5)
  constexpr int64_t kMaxRoundedDim = 512;
  const bool round_once = std::is_same<T, bf16_t>::value && lanes > 1 && dim <= kMaxRoundedDim;
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float rounded[2 * kMaxRoundedDim];
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * dim;
      const float* sin = cos + table_positions * dim;
      if (round_once) {
        for (int64_t d = 0; d < dim; ++d) {
          rounded[d] = round_to<T>(cos[d]);
          rounded[kMaxRoundedDim + d] = round_to<T>(sin[d]);
        }
        cos = rounded, sin = rounded + kMaxRoundedDim;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const T* v = x + t * token_stride + h * head_stride;
        T* o = out + (t * heads + h) * dim;
        if (lanes == 16) {
          if (round_once)
            rotate_head_vec<16, true>(v, cos, sin, half, o);
          else
            rotate_head_vec<16, false>(v, cos, sin, half, o);
          continue;
        }
        if (lanes == 8) {
          if (round_once)
            rotate_head_vec<8, true>(v, cos, sin, half, o);
          else
            rotate_head_vec<8, false>(v, cos, sin, half, o);
          continue;
        }
        for (int64_t d = 0; d < dim; ++d) {
          const float rotated = d < half ? -to_float(v[d + half]) : to_float(v[d - half]);
          const float a = round_to<T>(to_float(v[d]) * round_to<T>(cos[d]));
          const float b = round_to<T>(rotated * round_to<T>(sin[d]));
          o[d] = from_float<T>(a + b);
        }
      }
    }
  });
}

// The index of each row's largest value, as torch.argmax: the first of equal maxima, and the first NaN where a row
// has one. Lanes keep their own best (the first, by a strict comparison), then the lanes are merged by value and
// index: one pass over the row, which PyTorch's CPU argmax walks one element at a time (0.46 ms for a row of 128k
// bfloat16 logits, docs/performance.md).
template <typename T>
int64_t argmax_row(const T* row, int64_t cols) {
  vint lane;
  for (int l = 0; l < 16; ++l) lane[l] = l;
  vfloat best = vfloat{} - INFINITY;
  vint index = vint{} - 1;
  vint nan = vint{};
  int64_t c = 0;
  for (; c + 16 <= cols && c + 16 <= INT32_MAX; c += 16) {
    const vfloat v = load16(row + c);
    const vint better = v > best;  // strict: a lane keeps its first maximum
    best = better ? v : best;
    index = better ? lane + static_cast<int32_t>(c) : index;
    nan |= v != v;
  }
  float top = -INFINITY;
  int64_t result = -1;
  bool has_nan = false;
  for (int l = 0; l < 16; ++l) {
    has_nan |= nan[l] != 0;
    if (index[l] >= 0 && (best[l] > top || (best[l] == top && index[l] < result))) {
      top = best[l];
      result = index[l];
    }
  }
  for (; c < cols; ++c) {
    const float v = to_float(row[c]);
    has_nan |= v != v;
    if (v > top) {
      top = v;
      result = c;
    }
  }
  if (has_nan) {
    result = 0;
    while (to_float(row[result]) == to_float(row[result])) ++result;
  }
  return result < 0 ? 0 : result;  // every value -inf: the first
}

template <typename T>
void argmax_rows(const T* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 262144 / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * row_stride, cols);
  });
}

// The sum of w[begin, end) added one by one in double: the blocks' sums that sample_row's total and its walk share.
inline double block_sum(const float* w, int64_t begin, int64_t end) {
  double sum = 0.0;
  for (int64_t c = begin; c < end; ++c) sum += w[c];
  return sum;
}

constexpr int64_t kSampleBlock = 16;

// The sum of w[0, cols) over blocks of kSampleBlock (each block_sum).
inline double weight_sum(const float* w, int64_t cols) {
  double total = 0.0;
  for (int64_t b = 0; b < cols; b += kSampleBlock) total += block_sum(w, b, std::min(cols, b + kSampleBlock));
  return total;
}

// Top-k and top-p bin the weights (in [0, 1]) by their float's top 12 bits: exponent and 3 bits of mantissa, eighths
// of a binade, in the order of the floats. Only the weights of the bin where the cut falls are sorted.
constexpr int kBinShift = 20;

inline uint32_t weight_bin(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof bits);
  return bits >> kBinShift;
}

// Where the cut falls in `bin`: the weights of the bins below are zeroed, and the bin's positive ones are in `order`,
// largest first (equal ones by index).
void sort_bin(float* w, int64_t cols, uint32_t bin, std::vector<std::pair<float, int32_t>>& order) {
  order.clear();
  for (int64_t c = 0; c < cols; ++c) {
    const uint32_t at = weight_bin(w[c]);
    if (at == bin && w[c] > 0.0f)
      order.emplace_back(w[c], static_cast<int32_t>(c));
    else if (at < bin)
      w[c] = 0.0f;
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
}

// The bins' sums (of the positive weights' count where `count`, else of the weights) added from the largest bin down to
// the one where they reach `target`: that bin's weights sorted into `order`, those of the bins below zeroed (sort_bin).
// Returns the sum of the bins above it.
double cut_at_bin(float* w, int64_t cols, bool count, double target, std::vector<double>& bins,
                  std::vector<std::pair<float, int32_t>>& order) {
  bins.assign(weight_bin(1.0f) + 1, 0.0);
  for (int64_t c = 0; c < cols; ++c) bins[weight_bin(w[c])] += count ? w[c] > 0.0f : w[c];  // 0 adds nothing
  double before = 0.0;
  uint32_t bin = static_cast<uint32_t>(bins.size()) - 1;
  for (; bin > 0 && before + bins[bin] < target; --bin) before += bins[bin];
  sort_bin(w, cols, bin, order);
  return before;
}

// Keeps the top_k largest positive weights (the lowest indices among equal ones), the others zeroed.
void keep_top_k(float* w, int64_t cols, int64_t top_k, std::vector<double>& bins,
                std::vector<std::pair<float, int32_t>>& order) {
  const double before = cut_at_bin(w, cols, true, static_cast<double>(top_k), bins, order);
  for (size_t i = 0; i < order.size(); ++i)
    if (before + static_cast<double>(i) >= static_cast<double>(top_k)) w[order[i].second] = 0.0f;
}

// Zeroes the weights past the smallest set of the largest whose sum reaches top_p of the total: a weight is kept
// while the weights before it (larger, or equal and of a lower index) sum to less than top_p * total (the bins above
// its own, then its bin's larger ones), the largest always.
void keep_top_p(float* w, int64_t cols, float top_p, std::vector<double>& bins,
                std::vector<std::pair<float, int32_t>>& order) {
  const double target = static_cast<double>(top_p) * weight_sum(w, cols);
  double before = cut_at_bin(w, cols, false, target, bins, order);
  for (const auto& [weight, c] : order) {  // the largest (1) has nothing before it: kept, as target > 0
    if (before >= target) w[c] = 0.0f;
    before += weight;
  }
}

// One token drawn from a row of logits: temperature <= 0 draws the argmax (argmax_row). Else, with x = logits /
// temperature (float32), weights w = exp(x - max x) (exp_nonpositive; 0 below e^-87), the weights below min_p of
// the largest (1) zeroed, then the top_k largest kept (keep_top_k) where 0 < top_k < cols, then the top_p mass of
// what is left (keep_top_p) where top_p < 1 (vLLM's order: min_p before top-k/top-p): the first token whose
// cumulative weight (in double, over blocks of kSampleBlock) exceeds uniform (in [0, 1)) times their total; never a
// token of weight 0. A row with a NaN, or all -inf, draws its argmax.
// PyTorch's operators (the sampler's path elsewhere) took 2 ms for top-p or top-k over 32k logits, 9 ms over 128k;
// this 0.05-0.09 and 0.2-0.55 ms (docs/performance.md).
template <typename T>
int64_t sample_row(const T* row, int64_t cols, float temperature, int64_t top_k, float top_p, float min_p,
                   float uniform) {
  if (!(temperature > 0.0f)) return argmax_row(row, cols);
  thread_local std::vector<float> w;
  thread_local std::vector<double> bins;
  thread_local std::vector<std::pair<float, int32_t>> order;
  w.resize(cols);
  float* x = w.data();
  const vfloat divisor = vfloat{} + temperature;
  vfloat top = vfloat{} - INFINITY;
  vint nan = vint{};
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const vfloat v = load16(row + c) / divisor;
    std::memcpy(x + c, &v, sizeof v);
    top = v > top ? v : top;
    nan |= v != v;
  }
  float largest = -INFINITY;
  bool has_nan = false;
  for (int l = 0; l < 16; ++l) {
    largest = std::max(largest, top[l]);
    has_nan |= nan[l] != 0;
  }
  for (; c < cols; ++c) {
    x[c] = to_float(row[c]) / temperature;
    largest = std::max(largest, x[c]);
    has_nan |= x[c] != x[c];
  }
  if (has_nan || largest == -INFINITY) return argmax_row(row, cols);
  const vfloat shift = vfloat{} + largest;
  const vfloat lowest = vfloat{} + -87.0f;
  for (c = 0; c + 16 <= cols; c += 16) {
    const vfloat d = load16(x + c) - shift;
    const vfloat e = exp_nonpositive<vfloat, vint>(d);
    const vfloat kept = d > lowest ? e : vfloat{};
    std::memcpy(x + c, &kept, sizeof kept);
  }
  for (; c < cols; ++c) {
    const float d = x[c] - largest;
    x[c] = d > -87.0f ? exp_nonpositive<vfloat, vint>(vfloat{} + d)[0] : 0.0f;
  }
  if (min_p > 0.0f)
    for (c = 0; c < cols; ++c) x[c] = x[c] < min_p ? 0.0f : x[c];
  if (top_k > 0 && top_k < cols) keep_top_k(x, cols, top_k, bins, order);
  if (top_p < 1.0f) keep_top_p(x, cols, top_p, bins, order);
  const double total = weight_sum(x, cols);
  if (!(total > 0.0)) return argmax_row(row, cols);
  const double target = static_cast<double>(uniform) * total;
  double before = 0.0;
  for (int64_t b = 0; b < cols; b += kSampleBlock) {
    const int64_t end = std::min(cols, b + kSampleBlock);
    const double sum = block_sum(x, b, end);
    if (before + sum <= target) {
      before += sum;
      continue;
    }
    // the block's own walk; where its sum rounded above its walk's, its last weighted token
    double cumulative = before;
    int64_t last = -1;
    for (c = b; c < end; ++c) {
      if (x[c] <= 0.0f) continue;
      cumulative += x[c];
      last = c;
      if (cumulative > target) return c;
    }
    return last;
  }
  for (c = cols - 1; c >= 0; --c)  // not reached (uniform < 1, and the blocks' sums add to the total)
    if (x[c] > 0.0f) return c;
  return argmax_row(row, cols);
}

template <typename T>
void sample_rows(const T* x, int64_t rows, int64_t cols, int64_t row_stride, const float* draws, int64_t* out) {
  const float *temperature = draws, *top_k = draws + rows, *top_p = draws + 2 * rows, *min_p = draws + 3 * rows,
              *uniform = draws + 4 * rows;
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      out[r] = sample_row(x + r * row_stride, cols, temperature[r], static_cast<int64_t>(top_k[r]), top_p[r], min_p[r],
                          uniform[r]);
  });
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (x, weight and out alike); lanes: PyTorch's float vector width (sum_of_squares).
// Returns 0, or -1 / -2 for lanes out of range / another dtype.
int ts_rms_norm(int dtype, const void* x, int64_t outer, int64_t inner, int64_t outer_stride, int64_t inner_stride,
                int64_t dim, const void* weight, float eps, int64_t lanes, void* out) {
  if (lanes < 1 || lanes > kMaxLanes) return -1;
  switch (dtype) {
    case 0:
      rms_norm(static_cast<const float*>(x), outer, inner, outer_stride, inner_stride, dim,
               static_cast<const float*>(weight), eps, lanes, static_cast<float*>(out));
      return 0;
    case 1:
      rms_norm(static_cast<const bf16_t*>(x), outer, inner, outer_stride, inner_stride, dim,
               static_cast<const bf16_t*>(weight), eps, lanes, static_cast<bf16_t*>(out));
      return 0;
    default: return -2;
  }
}

// sum = x + residual and out = RMSNorm(sum), all [rows, dim] contiguous; dtype and lanes as ts_rms_norm's. In place
// too: sum may be x and out residual (each row is read before it is written).
int ts_add_rms_norm(int dtype, const void* x, const void* residual, int64_t rows, int64_t dim, const void* weight,
                    float eps, int64_t lanes, void* sum, void* out) {
  if (lanes < 1 || lanes > kMaxLanes) return -1;
  switch (dtype) {
    case 0:
      add_rms_norm(static_cast<const float*>(x), static_cast<const float*>(residual), rows, dim,
                   static_cast<const float*>(weight), eps, lanes, static_cast<float*>(sum), static_cast<float*>(out));
      return 0;
    case 1:
      add_rms_norm(static_cast<const bf16_t*>(x), static_cast<const bf16_t*>(residual), rows, dim,
                   static_cast<const bf16_t*>(weight), eps, lanes, static_cast<bf16_t*>(sum),
                   static_cast<bf16_t*>(out));
      return 0;
    default: return -2;
  }
}

// dtype as ts_rms_norm's; positions int64 [tokens]. Returns 0, or -1 / -2 / -3 for an odd dim / another dtype /
// a position outside the table.
int ts_rotary(int dtype, const void* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
              int64_t dim, const int64_t* positions, const float* cos_sin, int64_t table_positions, void* out) {
  if (dim % 2 != 0) return -1;
  for (int64_t t = 0; t < tokens; ++t)
    if (positions[t] < 0 || positions[t] >= table_positions) return -3;
  switch (dtype) {
    case 0:
      rotate(static_cast<const float*>(x), tokens, heads, token_stride, head_stride, dim, positions, cos_sin,
             table_positions, static_cast<float*>(out));
      return 0;
    case 1:
      rotate(static_cast<const bf16_t*>(x), tokens, heads, token_stride, head_stride, dim, positions, cos_sin,
             table_positions, static_cast<bf16_t*>(out));
      return 0;
    default: return -2;
  }
}

// out[r] = argmax of row r (int64). dtype as ts_rms_norm's. Returns 0, or -2 for another dtype.
int ts_argmax(int dtype, const void* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
  switch (dtype) {
    case 0: argmax_rows(static_cast<const float*>(x), rows, cols, row_stride, out); return 0;
    case 1: argmax_rows(static_cast<const bf16_t*>(x), rows, cols, row_stride, out); return 0;
    default: return -2;
  }
}

// out[r] = a token drawn from row r (int64) by sample_row. draws: float32 [5, rows], each row's temperature, top_k
// (0: all), top_p, min_p and uniform (in [0, 1)). dtype as ts_rms_norm's. Returns 0, or -2 for another dtype.
int ts_sample_rows(int dtype, const void* x, int64_t rows, int64_t cols, int64_t row_stride, const float* draws,
                   int64_t* out) {
  switch (dtype) {
    case 0: sample_rows(static_cast<const float*>(x), rows, cols, row_stride, draws, out); return 0;
    case 1: sample_rows(static_cast<const bf16_t*>(x), rows, cols, row_stride, draws, out); return 0;
    default: return -2;
  }
}

}  // extern "C"
