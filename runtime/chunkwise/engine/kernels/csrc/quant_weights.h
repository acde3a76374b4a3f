// What quant_linear.cpp and quant_linear_amx.cpp share: loading quantized weights (chunkwise/engine/quant/
// weights.py says the formats) as vectors of floats, 16 lanes (AVX-512) or 8 (AVX2).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <optional>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace chunkwise_quant {

#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

enum Kind { INT8 = 0, FP8 = 1, INT4 = 2 };

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
#else
  float r = 0;
  for (int i = 0; i < VW; ++i) r += v[i];
  return r;
#endif
}

// Widening loads as explicit instructions: GCC 12 turns a __builtin_convertvector from bytes into a scalar
// conversion a lane.
inline vi load_i8(const void* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
#endif
}

inline vi load_u8(const void* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
#endif
}

inline vf to_float(vi v) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps((__m512i)v);
#else
  return (vf)_mm256_cvtepi32_ps((__m256i)v);
#endif
}

template <typename T>
inline vf load_x(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {  // bf16: the high half of a float
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#endif
  }
}

template <typename T>
inline float scalar_x(const T* p) {
  return static_cast<float>(*p);
}

// float8_e4m3fn bytes -> floats: (8 + m) 2^(e - 10) for a normal exponent e, m 2^-9 for e = 0, built from
// normal floats only (a subnormal intermediate would read as zero under denormals-are-zero).
inline vf fp8_to_float(vi u) {
  const vi e = (u >> 3) & 15;
  const vi normal = e != 0;  // -1 or 0 a lane
  const vf mant = to_float((u & 7) | (normal & 8));
  const vi pow2 = ((e | (~normal & 1)) + (127 - 10)) << 23;
  const vf f = mant * (vf)pow2;
  return (vf)((vi)f | ((u & 0x80) << 24));
}

inline float fp8_scalar(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? (8 + m) * std::ldexp(1.0f, e - 10) : m * std::ldexp(1.0f, -9);
  return (b & 0x80) ? -v : v;
}

// VW weights of one row from column c (a multiple of VW), before scaling.
template <int KIND>
inline vf load_w(const uint8_t* row, int64_t c) {
  if constexpr (KIND == INT8) {
    return to_float(load_i8(row + c));
  } else if constexpr (KIND == FP8) {
    return fp8_to_float(load_u8(row + c));
  } else {
    // Within a block of 32 columns, byte i holds column i (low nibble) and 16 + i (high nibble).
    constexpr int per_half = 16 / VW;
    const int s = (c % 32) / VW;
    const vi b = load_u8(row + (c / 32) * 16 + (s % per_half) * VW);
    return to_float(s < per_half ? (b & 15) : (b >> 4));
  }
}

template <int KIND>
inline float scalar_w(const uint8_t* row, int64_t c) {
  if constexpr (KIND == INT8) {
    return static_cast<float>(static_cast<int8_t>(row[c]));
  } else if constexpr (KIND == FP8) {
    return fp8_scalar(row[c]);
  } else {
    const uint8_t b = row[(c / 32) * 16 + (c % 16)];
    return static_cast<float>((c % 32) < 16 ? (b & 15) : (b >> 4));
  }
}

struct Weights {
  const uint8_t* data;
  int64_t ld;  // bytes a row
  const float* scale;
  const float* zero;  // int4 only
  int64_t groups;     // scales (and zeros) a row
  int64_t group_k;
};

// A weight's tensors as the kernels read them (the ops' shared arguments: data, scale, zero, group_k).
inline Weights weights_of(const at::Tensor& data, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                          int64_t group_k) {
  return Weights{static_cast<const uint8_t*>(data.const_data_ptr()),
                 data.stride(0) * static_cast<int64_t>(data.element_size()),
                 scale.const_data_ptr<float>(),
                 zero.has_value() ? zero->const_data_ptr<float>() : nullptr,
                 scale.size(1),
                 group_k};
}


}  // namespace chunkwise_quant
