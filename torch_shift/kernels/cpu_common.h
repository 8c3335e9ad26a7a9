// What the CPU kernels share: bfloat16 <-> float32 as torch converts them, and 16 floats as one vector (GCC/Clang
// vector extensions: one 512-bit register with AVX-512, two 256-bit ones with AVX2, four 128-bit ones on NEON).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
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
// 8 consecutive values as float32 in one AVX2 register; callable from code built for AVX2 by its flags (-march=native:
// cpu_attention.cpp) or by a target attribute (cpu_linear.cpp's run-time choice)
__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

}  // namespace
