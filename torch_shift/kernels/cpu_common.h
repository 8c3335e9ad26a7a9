// What the CPU kernels share: bfloat16 <-> float32 as torch converts them, and 16 floats as one vector (GCC/Clang
// vector extensions: one 512-bit register with AVX-512, two 256-bit ones with AVX2, four 128-bit ones on NEON).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using bf16_t = uint16_t;

typedef float vfloat __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(16 * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(16 * sizeof(uint32_t))));
typedef uint16_t vhalfbits __attribute__((vector_size(16 * sizeof(uint16_t))));

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> bfloat16, rounding to nearest even as torch's conversion does; NaN stays NaN
inline bf16_t to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>(bits >> 16);
}

// 16 consecutive values as float32
inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#if defined(__AVX512F__)
inline vfloat load16(const bf16_t* p) {
  // one widening move of 16 words: the vector extension's conversion became two 8-word moves and an insert
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vfloat>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}
#else
inline vfloat load16(const bf16_t* p) {
  vhalfbits h;
  std::memcpy(&h, p, sizeof h);
  const vuint w = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
#endif

#if defined(__x86_64__)
// Whether the CPU has AVX512-BF16's dot products and the AVX-512 subsets their kernels use
inline bool bf16_dot_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
}

// Whether the CPU has the tile unit with bfloat16 (AMX-TILE, AMX-BF16) and AVX512-BF16, and Linux gives this process
// the tile registers' state, which it gives only to a process that asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA;
// oneDNN asks the same way for its bf16 matmuls on these CPUs; a forked child keeps the permission)
inline bool amx_bf16_usable() {
  static const bool usable = [] {
    if (!bf16_dot_supported()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

#if defined(__clang__) || __GNUC__ >= 11  // compilers with AMX intrinsics
#define TS_AMX_INTRINSICS 1
#define TS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

// The tile unit's configuration (palette 1): each tile's bytes a row and rows
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifdef TS_AMX_INTRINSICS
// LDTILECFG of the whole 64-byte configuration: GCC's _tile_loadconfig tells the compiler that it reads 8 bytes, so
// where the function that fills `config` is not inlined the stores of its rows and widths can be dropped (every tile
// then has 0 rows, and the products and stores do nothing)
TS_AMX_TARGET inline void load_tile_config(const TileConfig& config) {
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}
#endif

// 8 consecutive values as float32 in one AVX2 register; callable from code built for AVX2 by its flags (-march=native:
// cpu_attention.cpp) or by a target attribute (cpu_linear.cpp's run-time choice)
__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 8 floats -> bfloat16 bits in the low half of each 32-bit lane, rounding as to_bf16 (nearest even, NaN kept quiet)
__attribute__((target("avx2"))) inline __m256i bf16_words8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// 8 floats stored as bfloat16 (to_bf16, 8 at a time)
__attribute__((target("avx2"))) inline void store_bf16x8(__m256 v, bf16_t* out) {
  const __m256i words = bf16_words8(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), 0x08);
  _mm_storeu_si128((__m128i*)out, _mm256_castsi256_si128(packed));
}

// and 16 at a time with AVX-512
__attribute__((target("avx512f"))) inline __m512i bf16_words16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff))),
      16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

// 16 floats as bfloat16 words, rounding as to_bf16. Where the build targets AVX512-BF16 (-march=native on such a
// CPU), VCVTNEPS2BF16, which rounds alike (nearest even, a NaN's high half quieted) but takes denormal inputs as
// zero: a vector holding one (or a zero) takes the integer rounding. A bfloat16 silu(gate) * up of 512 x 2816 took
// 1.2x longer with the integer rounding on a Zen 5.
__attribute__((target("avx512f"))) inline __m256i bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
  if (_mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ) == 0)
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return _mm512_cvtepi32_epi16(bf16_words16(v));
}

// v rounded to bfloat16 and back
__attribute__((target("avx512f"))) inline __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(v)), 16));
}

__attribute__((target("avx512f"))) inline void store_bf16x16(__m512 v, bf16_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16x16(v));
}
#endif

// exp(x) for x <= 0 to about 2 ulp: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-7 Taylor
// polynomial; below -87 it is 2^-126 * p (callers mask those lanes).
// (V, VI: a float vector and the int vector of its width; the same expressions at every width, so the same bits)
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  const V lowest = V{} + -87.0f;
  x = x > lowest ? x : lowest;
  const V shifter = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (|x| < 2^22)
  const V n = (x * 1.44269504088896341f + shifter) - shifter;
  const V r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
#if defined(__AVX512F__)
  // p 2^n in one vscalefps: a multiplication by a power of two either way (n in [-126, 0]: a normal one), rounded
  // once, so the same bits as below in 13 vector operations instead of 16 (a bf16 prompt's attention on AMX, which
  // its exps bound, 4-8% faster: docs/performance.md)
  if constexpr (sizeof(V) == sizeof(__m512)) return (V)_mm512_scalef_ps((__m512)p, (__m512)n);
#endif
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace
