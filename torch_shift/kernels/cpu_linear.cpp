// A matmul of a few rows against a weight in oneDNN's blocked layout: the decode step's GEMV, read at the
// rate memory streams it.
//
// oneDNN's packed inner-product weight on AVX-512 CPUs (what torch.ops.mkldnn._reorder_linear_weight gives
// for the large-batch path) keeps blocks of 64 output features, each block's rows of K contiguous:
//   float32:  element (n, k) at ((n / 64) * K + k) * 64 + n % 64
//   bfloat16: element (n, k) at (((n / 64) * (K / 2) + k / 2) * 64 + n % 64) * 2 + k % 2   (pairs of k, VNNI)
// Each block is one contiguous stream of 64 * K elements, so a thread walking its blocks in order reads
// memory sequentially and every weight element once for all rows of x. The caller checks the layout on the
// real weight before it uses this kernel (torch_shift/models/linear.py), so a oneDNN that packs differently
// only loses the fast path.
//
// oneDNN's own one-row matmul on this layout reads about 21 GB/s on 2 cores, against 33 GB/s for a
// streaming sum (docs/performance.md, issue 20).

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)  // AVX-512 paths, chosen at run time; elsewhere the kernel declines and oneDNN runs
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 64;
constexpr int kMaxRows = 6;  // 6 x 4 accumulators, 4 weight vectors and x: 29 of the 32 AVX-512 registers

__attribute__((target("avx512f"))) inline __m512 load_bias_f32(const float* bias, int64_t n) {
  return bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
}

// R rows of x against the weight's blocks [begin, end); one struct per dtype, so that run_rows picks R.
template <int R>
struct F32Rows {
  __attribute__((target("avx512f"))) static void run(const float* x, int64_t x_stride, const float* w, int64_t K,
                                                     const float* bias, float* out, int64_t out_stride,
                                                     int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* wb = w + b * kBlock * K;
      __m512 acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const float* wk = wb + k * kBlock;
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
      const int64_t n = b * kBlock;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
          _mm512_storeu_ps(out + r * out_stride + n + 16 * j,
                           _mm512_add_ps(acc[r][j], load_bias_f32(bias, n + 16 * j)));
    }
  }
};

__attribute__((target("avx512f"))) inline __m512 bf16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int R>
struct Bf16Rows {
  __attribute__((target("avx512f,avx512bf16,avx512bw"))) static void run(
      const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t K, const uint16_t* bias, uint16_t* out,
      int64_t out_stride, int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* wb = w + b * kBlock * K;
      __m512 acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* wk = wb + k * kBlock;  // 64 outputs x 2 consecutive k
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * x_stride + k, sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
          acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xv);
          acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xv);
        }
      }
      const int64_t n = b * kBlock;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) {
          __m512 y = acc[r][j];
          if (bias) y = _mm512_add_ps(y, bf16_to_f32(bias + n + 16 * j));
          _mm256_storeu_si256((__m256i*)(out + r * out_stride + n + 16 * j), (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
  }
};

template <template <int> class Rows, typename T>
void run_rows(const T* x, int64_t x_stride, int64_t rows, const T* w, int64_t N, int64_t K, const T* bias, T* out,
              int64_t out_stride) {
  // Blocks are split between threads; rows of x in groups of at most kMaxRows, as equal as they can be. Each
  // block (64 x K weights, at most a few hundred KiB) is read from memory for its first group and from L2 for
  // the others.
  const int64_t blocks = N / kBlock;
  const int64_t groups = (rows + kMaxRows - 1) / kMaxRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0, r0 = 0; g < groups; ++g) {
        const int64_t n = (rows - r0) / (groups - g);
        const T* xr = x + r0 * x_stride;
        T* outr = out + r0 * out_stride;
        switch (n) {
          case 1: Rows<1>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1); break;
          case 2: Rows<2>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1); break;
          case 3: Rows<3>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1); break;
          case 4: Rows<4>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1); break;
          case 5: Rows<5>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1); break;
          default: Rows<6>::run(xr, x_stride, w, K, bias, outr, out_stride, b, b + 1); break;
        }
        r0 += n;
      }
    }
  });
}

}  // namespace

extern "C" {

// Which dtypes this CPU can run (bit 0: float32, bit 1: bfloat16); 0 where it has no AVX-512.
int ts_packed_gemv_dtypes() {
  __builtin_cpu_init();
  int dtypes = 0;
  if (__builtin_cpu_supports("avx512f")) dtypes |= 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512bf16"))
    dtypes |= 2;
  return dtypes;
}

// out[rows, N] = x[rows, K] @ W.T (+ bias); dtype 0 float32, 1 bfloat16 (x, weight, bias and out alike).
// Returns 0, or -1 for a shape the layout above does not cover.
int ts_packed_gemv(int dtype, const void* x, int64_t x_row_stride, int64_t rows, const void* weight, int64_t N,
                   int64_t K, const void* bias, void* out, int64_t out_row_stride) {
  if (N % kBlock != 0 || rows < 1 || (dtype == 1 && K % 2 != 0)) return -1;
  if (dtype == 0) {
    run_rows<F32Rows>(static_cast<const float*>(x), x_row_stride, rows, static_cast<const float*>(weight), N, K,
                      static_cast<const float*>(bias), static_cast<float*>(out), out_row_stride);
    return 0;
  }
  if (dtype == 1) {
    run_rows<Bf16Rows>(static_cast<const uint16_t*>(x), x_row_stride, rows, static_cast<const uint16_t*>(weight), N,
                       K, static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_row_stride);
    return 0;
  }
  return -1;
}

}  // extern "C"

#else

extern "C" {
int ts_packed_gemv_dtypes() { return 0; }
int ts_packed_gemv(int, const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*, void*, int64_t) {
  return -1;
}
}  // extern "C"

#endif  // __x86_64__
