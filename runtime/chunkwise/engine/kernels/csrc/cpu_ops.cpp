// chunkwise's CPU kernels, registered as torch ops under torch.ops.chunkwise.
//
// Each op does in one pass what torch would do in several (reading the paged KV cache in place rather than
// gathering it, normalising a row without temporaries), with Hugging Face's rounding points kept: values are
// widened to fp32, computed, and rounded back to the tensor's dtype wherever torch would round them.
//
// Only TensorBase-level APIs are used (sizes, strides, data pointers), so the file builds in seconds; the
// Python side (chunkwise/engine/kernels/__init__.py) checks shapes, devices and dtypes before calling in.

#include <ATen/Parallel.h>
#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

using at::TensorBase;

// Eight floats: AVX2 registers on x86 (built with -mavx2), pairs of NEON registers on Arm.
typedef float v8 __attribute__((vector_size(32)));

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}

// Round a float through T and back: where torch would store an intermediate in T.
template <typename T>
inline float through(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// exp(x), x clamped to [-87, 87] (beyond which a softmax weight or a sigmoid is 0 or 1 in fp32 anyway):
// Cephes-style range reduction and a degree-6 polynomial, relative error about 2e-7, plain arithmetic so
// that a simd loop vectorises it (built with -fno-trapping-math, which lets the clamps become blends).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 87.0f);
  const float fx = x * 1.44269504088896341f;
  const float n = (fx + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

template <typename T, int D>
inline void load_row(const T* src, v8* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, D * sizeof(float));
  } else {
    float tmp[D];
#pragma omp simd
    for (int d = 0; d < D; ++d) tmp[d] = widen(src[d]);
    std::memcpy(dst, tmp, sizeof(tmp));
  }
}

inline float hsum(v8 a) {
  float t[8];
  std::memcpy(t, &a, sizeof(t));
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

// ---- paged attention for short query rows -----------------------------------------------------------
//
// One query token attends to positions [0, len) of its request, read block by block through the request's
// block table. Two passes over the blocks: scores (and their max), then exp and the weighted sum of values.
// Within a block, one KV head at a time: its rows (widened once to fp32 for a half-precision cache) serve
// every query head of its group from L1. Scores are computed eight positions at a time per head, the eight
// dot products reduced together (a transposing add tree) instead of one horizontal sum each; values are
// accumulated per head in registers, eight vectors of D at a time.

constexpr int kMaxHeads = 128;

#if defined(__clang__)
#define CW_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t i8v __attribute__((vector_size(32)));
#define CW_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i8v){__VA_ARGS__})
#endif

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7], as AVX's hadd.
inline v8 pair_add(v8 a, v8 b) {
  return CW_SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + CW_SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The horizontal sums of eight vectors, as one vector: lane p holds the sum of a[p]'s lanes.
inline v8 sum8(const v8* a) {
  const v8 lo = pair_add(pair_add(a[0], a[1]), pair_add(a[2], a[3]));
  const v8 hi = pair_add(pair_add(a[4], a[5]), pair_add(a[6], a[7]));
  return CW_SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + CW_SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

// The rows of one KV head in one block as fp32: in place for an fp32 cache (stride slot_stride), else
// widened into `scratch` (stride D).
template <typename T, int D>
inline const float* head_rows(const T* base, int64_t count, int64_t slot_stride, float* scratch,
                              int64_t* stride) {
  if constexpr (std::is_same_v<T, float>) {
    *stride = slot_stride;
    return base;
  } else {
    for (int64_t o = 0; o < count; ++o) {
      const T* src = base + o * slot_stride;
      float* dst = scratch + o * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = widen(src[d]);
    }
    *stride = D;
    return scratch;
  }
}

template <typename T, int D>
void attend_token(const T* q, int64_t q_head_stride, T* out, int64_t out_head_stride, int num_heads,
                  int num_kv_heads, const T* k_cache, const T* v_cache, int64_t block_stride,
                  int64_t slot_stride, int64_t head_stride, const int64_t* table, int64_t block_size,
                  int64_t len, float scale, float* scores, v8* qv, v8* acc, float* scratch) {
  constexpr int C = D / 8;
  const int group = num_heads / num_kv_heads;
  for (int h = 0; h < num_heads; ++h) {
    load_row<T, D>(q + h * q_head_stride, qv + h * C);
    for (int c = 0; c < C; ++c) {
      qv[h * C + c] *= scale;
      acc[h * C + c] = v8{};
    }
  }
  float mx[kMaxHeads];
  for (int h = 0; h < num_heads; ++h) mx[h] = -INFINITY;
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t p0 = b * block_size;
    const int64_t count = std::min(block_size, len - p0);
    const T* base = k_cache + table[b] * block_stride;
    for (int kh = 0; kh < num_kv_heads; ++kh) {
      int64_t rs;
      const float* rows = head_rows<T, D>(base + kh * head_stride, count, slot_stride, scratch, &rs);
      for (int g = 0; g < group; ++g) {
        const int h = kh * group + g;
        const v8* qh = qv + h * C;
        float* srow = scores + h * len + p0;
        float m = mx[h];
        int64_t o = 0;
        for (; o + 8 <= count; o += 8) {
          v8 a[8] = {};
          const float* r = rows + o * rs;
          for (int c = 0; c < C; ++c) {
            const v8 qc = qh[c];
            for (int p = 0; p < 8; ++p) a[p] += qc * load8(r + p * rs + c * 8);
          }
          const v8 s8 = sum8(a);
          store8(srow + o, s8);
          for (int p = 0; p < 8; ++p) m = s8[p] > m ? s8[p] : m;
        }
        for (; o < count; ++o) {
          const float* r = rows + o * rs;
          v8 a = qh[0] * load8(r);
          for (int c = 1; c < C; ++c) a += qh[c] * load8(r + c * 8);
          const float s = hsum(a);
          srow[o] = s;
          m = s > m ? s : m;
        }
        mx[h] = m;
      }
    }
  }
  float sum[kMaxHeads];
  for (int h = 0; h < num_heads; ++h) {
    float total = 0.f;
    float* row = scores + h * len;
    const float m = mx[h];
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < len; ++p) {
      const float e = fast_exp(row[p] - m);
      row[p] = e;
      total += e;
    }
    sum[h] = total;
  }
  constexpr int CB = C < 8 ? C : 8;  // value chunks accumulated in registers at a time
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t p0 = b * block_size;
    const int64_t count = std::min(block_size, len - p0);
    const T* base = v_cache + table[b] * block_stride;
    for (int kh = 0; kh < num_kv_heads; ++kh) {
      int64_t rs;
      const float* rows = head_rows<T, D>(base + kh * head_stride, count, slot_stride, scratch, &rs);
      for (int g = 0; g < group; ++g) {
        const int h = kh * group + g;
        const float* w = scores + h * len + p0;
        v8* ah = acc + h * C;
        for (int c0 = 0; c0 < C; c0 += CB) {
          // Head sizes of 80 or 96 (10 or 12 chunks) leave a shorter last group.
          const int cn = std::min(CB, C - c0);
          v8 a[CB];
          for (int c = 0; c < cn; ++c) a[c] = ah[c0 + c];
          for (int64_t o = 0; o < count; ++o) {
            const float wo = w[o];
            const float* r = rows + o * rs + c0 * 8;
            for (int c = 0; c < cn; ++c) a[c] += wo * load8(r + c * 8);
          }
          for (int c = 0; c < cn; ++c) ah[c0 + c] = a[c];
        }
      }
    }
  }
  for (int h = 0; h < num_heads; ++h) {
    T* oh = out + h * out_head_stride;
    const float inv = 1.f / sum[h];
    float tmp[D];
    std::memcpy(tmp, acc + h * C, sizeof(tmp));
    for (int d = 0; d < D; ++d) oh[d] = narrow<T>(tmp[d] * inv);
  }
}

template <typename T, int D>
void paged_attention_impl(TensorBase& out, const TensorBase& query, const TensorBase& kv_cache,
                          const TensorBase& block_tables, const TensorBase& token_rows,
                          const TensorBase& token_index, const TensorBase& token_lens, double scale) {
  constexpr int C = D / 8;
  const int64_t n = token_index.size(0);
  const int num_heads = static_cast<int>(query.size(1));
  const int num_kv_heads = static_cast<int>(kv_cache.size(3));
  const int64_t block_size = kv_cache.size(2);
  const T* q = query.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const T* k_cache = kv_cache.const_data_ptr<T>();
  const T* v_cache = k_cache + kv_cache.stride(0);
  const int64_t block_stride = kv_cache.stride(1), slot_stride = kv_cache.stride(2),
                head_stride = kv_cache.stride(3);
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t* rows = token_rows.const_data_ptr<int64_t>();
  const int64_t* index = token_index.const_data_ptr<int64_t>();
  const int64_t* lens = token_lens.const_data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t i = 0; i < n; ++i) max_len = std::max(max_len, lens[i]);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> scores(new float[num_heads * max_len]);
    std::unique_ptr<v8[]> qv(new v8[num_heads * C]);
    std::unique_ptr<v8[]> acc(new v8[num_heads * C]);
    std::unique_ptr<float[]> scratch(new float[block_size * D]);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = index[i];
      attend_token<T, D>(q + t * qs0, qs1, o + t * os0, os1, num_heads, num_kv_heads, k_cache, v_cache,
                         block_stride, slot_stride, head_stride, tables + rows[i] * table_stride, block_size,
                         lens[i], static_cast<float>(scale), scores.get(), qv.get(), acc.get(),
                         scratch.get());
    }
  });
}

template <typename T>
void paged_attention_dtype(TensorBase& out, const TensorBase& query, const TensorBase& kv_cache,
                           const TensorBase& block_tables, const TensorBase& token_rows,
                           const TensorBase& token_index, const TensorBase& token_lens, double scale) {
  switch (query.size(2)) {
#define CASE(D)                                                                                          \
  case D:                                                                                                \
    return paged_attention_impl<T, D>(out, query, kv_cache, block_tables, token_rows, token_index,       \
                                      token_lens, scale);
    CASE(16)
    CASE(32)
    CASE(64)
    CASE(80)
    CASE(96)
    CASE(128)
    CASE(256)
#undef CASE
    default:
      TORCH_CHECK(false, "chunkwise::paged_attention: head_dim ", query.size(2), " is not built");
  }
}

}  // namespace

bool chunkwise_paged_attention_bf16(at::TensorBase& out, const at::TensorBase& query, const at::TensorBase& kv_cache,
                                    const at::TensorBase& block_tables, const at::TensorBase& token_rows,
                                    const at::TensorBase& token_index, const at::TensorBase& token_lens,
                                    double scale);

namespace {

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& token_rows, const at::Tensor& token_index,
                     const at::Tensor& token_lens, double scale) {
  TORCH_CHECK(query.size(1) <= kMaxHeads, "chunkwise::paged_attention: at most ", kMaxHeads, " heads");
  TensorBase o = out;
  switch (query.scalar_type()) {
    case at::kFloat:
      return paged_attention_dtype<float>(o, query, kv_cache, block_tables, token_rows, token_index,
                                          token_lens, scale);
    case at::kBFloat16:
      // On AVX512-BF16, head sizes that are a multiple of 32: the bf16 dot-product path (paged_attention_bf16.cpp).
      if (chunkwise_paged_attention_bf16(o, query, kv_cache, block_tables, token_rows, token_index, token_lens,
                                         scale))
        return;
      return paged_attention_dtype<c10::BFloat16>(o, query, kv_cache, block_tables, token_rows, token_index,
                                                  token_lens, scale);
    case at::kHalf:
      return paged_attention_dtype<c10::Half>(o, query, kv_cache, block_tables, token_rows, token_index,
                                              token_lens, scale);
    default:
      TORCH_CHECK(false, "chunkwise::paged_attention: unsupported dtype ", query.scalar_type());
  }
}

// ---- vectors of the build's width -------------------------------------------------------------------
// The elementwise kernels below are written over W floats at a time (16 in an AVX-512 build, 8 otherwise) with
// explicit conversions: the compiler does not vectorise c10::BFloat16's own conversion (its NaN test and
// rounding are scalar code), which left these loops scalar and slower than torch's.

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// fp32 -> bf16 bits, round to nearest even, NaN kept quiet: what c10::BFloat16(float) does, W lanes at once.
inline vu bf16_bits(vf x) {
  const vu u = (vu)x;
  const vu rounded = (u + (((u >> 16) & 1u) + 0x7fffu)) >> 16;
  const vu nan = (vu)(x != x);
  return (rounded & ~nan) | (0x7fc0u & nan);
}

template <typename T>
inline vf vload(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vh h;
    std::memcpy(&h, p, sizeof(h));
    return (vf)(__builtin_convertvector(h, vu) << 16);
  } else {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float t[W];
    for (int i = 0; i < W; ++i) t[i] = static_cast<float>(p[i]);
    return vload<float>(t);
#endif
  }
}

template <typename T>
inline void vstore(T* p, vf v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    // One instruction, the same rounding (to nearest even; NaN stays NaN).
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
    const vh h = __builtin_convertvector(bf16_bits(v), vh);
    std::memcpy(p, &h, sizeof(h));
#endif
  } else {
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
    float t[W];
    std::memcpy(t, &v, sizeof(t));
    for (int i = 0; i < W; ++i) p[i] = static_cast<T>(t[i]);
#endif
  }
}

// The first n (< W) lanes, the rest zero; and their store.
template <typename T>
inline vf vload_part(const T* p, int64_t n) {
  float t[W] = {};
  for (int64_t i = 0; i < n; ++i) t[i] = widen(p[i]);
  return vload<float>(t);
}

template <typename T>
inline void vstore_part(T* p, vf v, int64_t n) {
  float t[W];
  std::memcpy(t, &v, sizeof(t));
  for (int64_t i = 0; i < n; ++i) p[i] = narrow<T>(t[i]);
}

// Round through T and back (where torch stores an intermediate in T), W lanes at once.
template <typename T>
inline vf vthrough(vf x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    return (vf)(bf16_bits(x) << 16);
#endif
  } else {
    T t[W];
    vstore<T>(t, x);
    return vload<T>(t);
  }
}

// fast_exp, W lanes at once (the same arithmetic, so the same results).
inline vf vexp(vf x) {
  x = vmin(vmax(x, splat(-87.0f)), splat(87.0f));
  const vf fx = x * 1.44269504088896341f;
  const vf n = (fx + 12582912.0f) - 12582912.0f;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * (vf)bits;
}

inline float vsum(vf v) {
  float t[W];
  std::memcpy(t, &v, sizeof(t));
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += t[i];
  return s;
}

// ---- RMSNorm ------------------------------------------------------------------------------------------
// HF: x32 = x.float(); y = x32 * rsqrt(mean(x32^2) + eps); out = weight * y.to(x.dtype).

template <typename T>
void rms_norm_impl(TensorBase& out, const TensorBase& x, const TensorBase& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const float feps = static_cast<float>(eps);
  const int64_t body = dim - dim % W;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * os;
      vf acc = vf{};
      for (int64_t d = 0; d < body; d += W) {
        const vf v = vload<T>(xr + d);
        acc += v * v;
      }
      if (body < dim) {
        const vf v = vload_part<T>(xr + body, dim - body);
        acc += v * v;
      }
      const float inv = 1.f / std::sqrt(vsum(acc) / static_cast<float>(dim) + feps);
      for (int64_t d = 0; d < body; d += W)
        vstore<T>(orow + d, vload<T>(wp + d) * vthrough<T>(vload<T>(xr + d) * inv));
      if (body < dim) {
        const int64_t n = dim - body;
        vstore_part<T>(orow + body, vload_part<T>(wp + body, n) * vthrough<T>(vload_part<T>(xr + body, n) * inv),
                       n);
      }
    }
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TensorBase o = out;
  switch (x.scalar_type()) {
    case at::kFloat:
      return rms_norm_impl<float>(o, x, weight, eps);
    case at::kBFloat16:
      return rms_norm_impl<c10::BFloat16>(o, x, weight, eps);
    case at::kHalf:
      return rms_norm_impl<c10::Half>(o, x, weight, eps);
    default:
      TORCH_CHECK(false, "chunkwise::rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// ---- residual add + RMSNorm, in place (vLLM's fused_add_rms_norm) ----------------------------------------
// residual = residual + x, rounded to T as torch's add rounds it; x = rms_norm(residual) as above. One pass
// over each row (the row stays in L1 between the sum and the norm) where torch reads and writes it three
// times (the add, then the norm's two passes) and allocates two tensors. The results are bit for bit those
// of `h = x + residual; rms_norm(h)`.

template <typename T>
void fused_add_rms_norm_impl(TensorBase& x, TensorBase& residual, const TensorBase& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  T* xp = x.mutable_data_ptr<T>();
  T* rp = residual.mutable_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const float feps = static_cast<float>(eps);
  const int64_t body = dim - dim % W;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      vf acc = vf{};
      for (int64_t d = 0; d < body; d += W) {
        const vf s = vthrough<T>(vload<T>(xr + d) + vload<T>(rr + d));
        vstore<T>(rr + d, s);
        acc += s * s;
      }
      if (body < dim) {
        const int64_t n = dim - body;
        const vf s = vthrough<T>(vload_part<T>(xr + body, n) + vload_part<T>(rr + body, n));
        vstore_part<T>(rr + body, s, n);
        acc += s * s;
      }
      const float inv = 1.f / std::sqrt(vsum(acc) / static_cast<float>(dim) + feps);
      for (int64_t d = 0; d < body; d += W)
        vstore<T>(xr + d, vload<T>(wp + d) * vthrough<T>(vload<T>(rr + d) * inv));
      if (body < dim) {
        const int64_t n = dim - body;
        vstore_part<T>(xr + body, vload_part<T>(wp + body, n) * vthrough<T>(vload_part<T>(rr + body, n) * inv), n);
      }
    }
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TensorBase xb = x, rb = residual;
  switch (x.scalar_type()) {
    case at::kFloat:
      return fused_add_rms_norm_impl<float>(xb, rb, weight, eps);
    case at::kBFloat16:
      return fused_add_rms_norm_impl<c10::BFloat16>(xb, rb, weight, eps);
    case at::kHalf:
      return fused_add_rms_norm_impl<c10::Half>(xb, rb, weight, eps);
    default:
      TORCH_CHECK(false, "chunkwise::fused_add_rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// ---- the KV cache write -----------------------------------------------------------------------------------
// kv_cache [2, blocks, block_size, KV, D] (contiguous); key and value [T, KV, D] with contiguous rows (views
// into the fused qkv output, as the model passes them); token t's key and value to flat slot slots[t]. One
// call for both where torch runs two index_copy_ (each a dispatch, a check of the index and a strided copy):
// a row's KV heads are consecutive in both, so a token is two memcpy's of KV*D elements.

void write_kv(at::Tensor kv_cache, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "chunkwise::write_kv: kv_cache [2, blocks, block_size, KV, D], contiguous");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(),
              "chunkwise::write_kv: key and value [T, KV, D] of one shape");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "chunkwise::write_kv: key, value and the cache of one dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == key.size(0) &&
                  slots.stride(0) == 1,
              "chunkwise::write_kv: slots [T] int64, one per token");
  const int64_t T = key.size(0), KV = key.size(1), D = key.size(2);
  TORCH_CHECK(kv_cache.size(3) == KV && kv_cache.size(4) == D, "chunkwise::write_kv: heads differ from the cache's");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && (KV == 1 || t->stride(1) == D),
                "chunkwise::write_kv: each token's KV heads must be one contiguous row");
  const int64_t nslots = kv_cache.size(1) * kv_cache.size(2), row = KV * D;
  const int64_t esize = static_cast<int64_t>(kv_cache.element_size()), bytes = row * esize;
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + nslots * bytes;
  const char* kp = static_cast<const char*>(key.const_data_ptr());
  const char* vp = static_cast<const char*>(value.const_data_ptr());
  const int64_t ks = key.stride(0) * esize, vs = value.stride(0) * esize;
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "chunkwise::write_kv: slot ", sp[t], " out of range");
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

// ---- rotary embedding, in place -----------------------------------------------------------------------
// x [T, heads, D] (rotate-half layout); cos_sin [P, 2, D/2] fp32. HF casts cos/sin to x's dtype and rounds
// each product and each sum: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).

template <typename T>
inline vf rotate_first(vf x1, vf x2, vf c, vf s) {
  return vthrough<T>(x1 * c) - vthrough<T>(x2 * s);
}

template <typename T>
void rotary_impl(TensorBase& x, const TensorBase& cos_sin, const TensorBase& positions) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.mutable_data_ptr<T>();
  const float* table = cos_sin.const_data_ptr<float>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), ts = cos_sin.stride(0);
  const int64_t body = half - half % W;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = table + pos[t] * ts;
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + t * s0 + h * s1;
        for (int64_t d = 0; d < body; d += W) {
          const vf cd = vthrough<T>(vload<float>(c + d)), sd = vthrough<T>(vload<float>(s + d));
          const vf x1 = vload<T>(row + d), x2 = vload<T>(row + d + half);
          vstore<T>(row + d, rotate_first<T>(x1, x2, cd, sd));
          vstore<T>(row + d + half, vthrough<T>(x2 * cd) + vthrough<T>(x1 * sd));
        }
        if (body < half) {
          const int64_t n = half - body;
          const vf cd = vthrough<T>(vload_part<float>(c + body, n)), sd = vthrough<T>(vload_part<float>(s + body, n));
          const vf x1 = vload_part<T>(row + body, n), x2 = vload_part<T>(row + body + half, n);
          vstore_part<T>(row + body, rotate_first<T>(x1, x2, cd, sd), n);
          vstore_part<T>(row + body + half, vthrough<T>(x2 * cd) + vthrough<T>(x1 * sd), n);
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor x, const at::Tensor& cos_sin, const at::Tensor& positions) {
  TensorBase xb = x;
  switch (x.scalar_type()) {
    case at::kFloat:
      return rotary_impl<float>(xb, cos_sin, positions);
    case at::kBFloat16:
      return rotary_impl<c10::BFloat16>(xb, cos_sin, positions);
    case at::kHalf:
      return rotary_impl<c10::Half>(xb, cos_sin, positions);
    default:
      TORCH_CHECK(false, "chunkwise::rotary_embedding: unsupported dtype ", x.scalar_type());
  }
}

// ---- silu(gate) * up ------------------------------------------------------------------------------------
// x [T, 2I] = [gate | up] -> out [T, I]; HF rounds silu(gate) to the dtype before the product.

template <typename T>
inline vf silu_mul(vf g, vf u) {
  return vthrough<T>(g / (1.f + vexp(-g))) * u;
}

template <typename T>
void silu_and_mul_impl(TensorBase& out, const TensorBase& x) {
  const int64_t rows = x.size(0), inner = out.size(1);
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t body = inner - inner % W;
  // Enough rows per thread that a small step stays on one.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inner, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + inner;
      T* orow = op + r * os;
      for (int64_t d = 0; d < body; d += W) vstore<T>(orow + d, silu_mul<T>(vload<T>(g + d), vload<T>(u + d)));
      if (body < inner) {
        const int64_t n = inner - body;
        vstore_part<T>(orow + body, silu_mul<T>(vload_part<T>(g + body, n), vload_part<T>(u + body, n)), n);
      }
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TensorBase o = out;
  switch (x.scalar_type()) {
    case at::kFloat:
      return silu_and_mul_impl<float>(o, x);
    case at::kBFloat16:
      return silu_and_mul_impl<c10::BFloat16>(o, x);
    case at::kHalf:
      return silu_and_mul_impl<c10::Half>(o, x);
    default:
      TORCH_CHECK(false, "chunkwise::silu_and_mul: unsupported dtype ", x.scalar_type());
  }
}

// ---- argmax of each row of fp32 logits -------------------------------------------------------------------
// torch.argmax's answer (the first index of the largest value; the first NaN if the row has one) in one pass
// of W lanes: each lane keeps its own best and where it was, the lanes are merged at the end. torch's own
// argmax over a [rows, vocab] tensor runs about 1 ns an element here, a tenth of this.

void argmax_rows(at::Tensor out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "chunkwise::argmax: empty rows");
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  const int64_t xs = x.stride(0);
  const int64_t body = n - n % W;
  vi lane_ids;
  for (int i = 0; i < W; ++i) lane_ids[i] = i;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = xp + r * xs;
      vf best = splat(-INFINITY);
      vi where = lane_ids, idx = lane_ids;
      vi nan = vi{};
      for (int64_t j = 0; j < body; j += W) {
        const vf v = vload<float>(p + j);
        const vi gt = v > best;
        best = gt ? v : best;
        where = gt ? idx : where;
        nan |= (v != v);
        idx += W;
      }
      float bv = -INFINITY;
      int64_t bi = 0;
      bool any_nan = false;
      for (int i = 0; i < W; ++i) {
        any_nan |= nan[i] != 0;
        if (body == 0) break;
        if (best[i] > bv || (best[i] == bv && where[i] < bi)) bv = best[i], bi = where[i];
      }
      for (int64_t j = body; j < n; ++j) {
        any_nan |= p[j] != p[j];
        if (p[j] > bv) bv = p[j], bi = j;
      }
      if (any_nan) {
        for (int64_t j = 0; j < n; ++j)
          if (p[j] != p[j]) {
            bi = j;
            break;
          }
      }
      op[r] = bi;
    }
  });
}

// ---- sampling: the exponential race over each row ------------------------------------------------------
// out[r] = argmax_i exp((x[r,i] - max_r x[r]) * inv_t[r]) / E_ri, E_ri = -log(U_ri): the index of the smallest
// Exp(1) arrival scaled by each token's weight, which is token i with probability softmax(x[r] * inv_t[r])_i.
// No softmax, no normalisation and no stored noise: the uniforms U_ri are a counter-based hash of (seeds[r], i)
// made on the fly, so a row's draw depends on its own seed only. torch's exponential_ alone took three quarters
// of a served step's sampling (a scalar Mersenne twister and a log per element); this is one pass of vector
// arithmetic after the row max. -inf (a token cut by top-k/top-p or a grammar) weighs exactly 0.

// Chris Wellons' lowbias32 integer hash, W lanes at once.
inline vu hash32(vu x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// log(x) for positive normal x, Cephes' logf (relative error about 1e-7), W lanes at once.
inline vf vlog(vf x) {
  const vi bits = (vi)x;
  vi e = ((bits >> 23) & 0xff) - 126;
  vf m = (vf)((bits & static_cast<int32_t>(0x807fffffu)) | 0x3f000000);  // in [0.5, 1)
  const vi small = m < 0.707106781186547524f;
  e -= small & 1;
  m = (small ? m + m : m) - 1.0f;
  const vf z = m * m;
  vf y = splat(7.0376836292E-2f);
  y = y * m - 1.1514610310E-1f;
  y = y * m + 1.1676998740E-1f;
  y = y * m - 1.2420140846E-1f;
  y = y * m + 1.4249322787E-1f;
  y = y * m - 1.6668057665E-1f;
  y = y * m + 2.0000714765E-1f;
  y = y * m - 2.4999993993E-1f;
  y = y * m + 3.3333331174E-1f;
  y = y * m * z;
  const vf ef = __builtin_convertvector(e, vf);
  y += ef * -2.12194440e-4f;
  y -= z * 0.5f;
  return m + y + ef * 0.693359375f;
}

void exponential_race(at::Tensor out, const at::Tensor& x, const at::Tensor& inv_temperature,
                      const at::Tensor& seeds) {
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "chunkwise::exponential_race: empty rows");
  const float* xp = x.const_data_ptr<float>();
  const float* tp = inv_temperature.const_data_ptr<float>();
  const int64_t* sp = seeds.const_data_ptr<int64_t>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  const int64_t xs = x.stride(0);
  vi lane_ids;
  for (int i = 0; i < W; ++i) lane_ids[i] = i;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* p = xp + r * xs;
      vf mv = splat(-INFINITY);
      int64_t j = 0;
      for (; j + W <= n; j += W) mv = vmax(mv, vload<float>(p + j));
      float m = -INFINITY;
      for (int i = 0; i < W; ++i) m = std::max(m, mv[i]);
      for (; j < n; ++j) m = std::max(m, p[j]);
      const float inv_t = tp[r];
      const uint64_t seed = static_cast<uint64_t>(sp[r]);
      const uint32_t k1 = static_cast<uint32_t>(seed), k2 = static_cast<uint32_t>(seed >> 32);
      vf best = splat(-1.0f);
      vi where = lane_ids, idx = lane_ids;
      for (j = 0; j < n; j += W) {
        const int64_t left = n - j;
        const vf v = left >= W ? vload<float>(p + j) : vload_part<float>(p + j, left);
        const vu h = hash32(hash32((vu)idx + k1) ^ k2);
        const vf u = (__builtin_convertvector((vi)(h >> 8), vf) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
        const vf weight = vexp((v - m) * inv_t);
        vf score = weight / -vlog(u);
        // Cut tokens (-inf) and the lanes past the row's end never win.
        const vi out_of_row = idx >= static_cast<int32_t>(n);
        score = (v == -INFINITY) | out_of_row ? splat(-1.0f) : score;
        const vi gt = score > best;
        best = gt ? score : best;
        where = gt ? idx : where;
        idx += W;
      }
      float bv = -2.0f;
      int64_t bi = 0;
      for (int i = 0; i < W; ++i)
        if (best[i] > bv || (best[i] == bv && where[i] < bi)) bv = best[i], bi = where[i];
      op[r] = bi;
    }
  });
}

// ---- a linear layer over a few rows ---------------------------------------------------------------------
// out [M, N] = x [M, K] . W [N, K]^T (+ bias), fp32, W in Hugging Face's row-major layout.
// At decode's few rows a linear layer is a stream over its weight. oneDNN's GEMMs, tuned for many rows, reach
// about half this core's memory bandwidth there (bench/cpu/linear_small_m.py). Here each tile of MR input
// rows and NR weight rows reads its weight rows once, dotted against input rows that stay in L1, while the
// next tile's weight rows are prefetched; MR x NR accumulators hide the FMA latency. The weight streams
// from memory once per call, whatever the number of rows.

inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// out[i] = the sum of the lanes of the i-th vector.
inline void hsum4(v8 a, v8 b, v8 c, v8 d, float* out) {
#if defined(__AVX__)
  const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b);
  const __m256 cd = _mm256_hadd_ps((__m256)c, (__m256)d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lanes 0-3: the low halves' sums, 4-7: the high halves'
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

template <int MR, int NR>
inline void linear_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                        int64_t ldy) {
  v8 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = v8{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load8(w + n * K + k);
    if ((k & 15) == 0)  // a cache line per weight row every other step: the next tile's rows
      for (int n = 0; n < NR; ++n) __builtin_prefetch(w + (n + NR) * K + k, 0, 3);
    for (int m = 0; m < MR; ++m) {
      const v8 xv = load8(x + m * ldx + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = fma8(xv, wv[n], acc[m][n]);
    }
  }
  // Each row's sums four at a time: one reduction for four accumulators (a scalar one each cost a fifth of
  // the tile at K = 512).
  for (int m = 0; m < MR; ++m)
    for (int n0 = 0; n0 < NR; n0 += 4) {
      float s[4];
      hsum4(acc[m][n0], n0 + 1 < NR ? acc[m][n0 + 1] : v8{}, n0 + 2 < NR ? acc[m][n0 + 2] : v8{},
            n0 + 3 < NR ? acc[m][n0 + 3] : v8{}, s);
      for (int j = 0; j < 4 && n0 + j < NR; ++j) {
        const int n = n0 + j;
        float v = s[j];
        for (int64_t kk = k; kk < K; ++kk) v += x[m * ldx + kk] * w[n * K + kk];
        y[m * ldy + n] = bias ? v + bias[n] : v;
      }
    }
}

// Weight rows [n0, n1) against MR input rows, NR at a time, the remainder in one narrower tile.
template <int MR, int NR>
void linear_rows(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                 int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) linear_tile<MR, NR>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy);
  if constexpr (NR > 1) {
    if (n < n1) linear_rows<MR, NR - 1>(x, ldx, w, K, bias, y, ldy, n, n1);
  }
}

// Tile widths by input rows: as many accumulators as the 16 AVX2 registers hold beside the loads.
template <int MR>
void linear_rows_for(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                     int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int NR = MR == 1 ? 8 : MR == 2 ? 5 : 3;
  linear_rows<MR, NR>(x, ldx, w, K, bias, y, ldy, n0, n1);
}

// Every input row against NR weight rows (NR <= 3): four rows at a time, then the rest in one tile.
template <int NR>
void linear_all_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, const float* bias,
                     float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) linear_tile<4, NR>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy);
  switch (M - m) {
    case 3:
      return linear_tile<3, NR>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy);
    case 2:
      return linear_tile<2, NR>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy);
    case 1:
      return linear_tile<1, NR>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy);
    default:
      return;
  }
}

void linear_small_m(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (M == 0 || N == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  float* yp = out.mutable_data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = out.stride(0);
  // Blocks of weight rows (a multiple of every tile width) are what threads divide.
  const int64_t block = 120;
  const int64_t blocks = (N + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * block, n1 = std::min(N, n0 + block);
      switch (M) {
        case 1:
          linear_rows_for<1>(xp, ldx, wp, K, bp, yp, ldy, n0, n1);
          continue;
        case 2:
          linear_rows_for<2>(xp, ldx, wp, K, bp, yp, ldy, n0, n1);
          continue;
        case 3:
          linear_rows_for<3>(xp, ldx, wp, K, bp, yp, ldy, n0, n1);
          continue;
        case 4:
          linear_rows_for<4>(xp, ldx, wp, K, bp, yp, ldy, n0, n1);
          continue;
        default:
          break;
      }
      // More rows than one tile: each tile of 3 weight rows is read from memory once and dotted against
      // every row tile while it sits in L1 (1.15x the other order at 5-8 rows, even from 48).
      int64_t n = n0;
      for (; n + 3 <= n1; n += 3) linear_all_rows<3>(xp, ldx, M, wp + n * K, K, bp ? bp + n : nullptr, yp + n, ldy);
      if (n1 - n == 2) linear_all_rows<2>(xp, ldx, M, wp + n * K, K, bp ? bp + n : nullptr, yp + n, ldy);
      if (n1 - n == 1) linear_all_rows<1>(xp, ldx, M, wp + n * K, K, bp ? bp + n : nullptr, yp + n, ldy);
    }
  });
}

}  // namespace

TORCH_LIBRARY(chunkwise, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor token_rows, "
      "Tensor token_index, Tensor token_lens, float scale) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slots) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos_sin, Tensor positions) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("linear_small_m(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("argmax(Tensor(a!) out, Tensor x) -> ()");
  m.def("exponential_race(Tensor(a!) out, Tensor x, Tensor inv_temperature, Tensor seeds) -> ()");
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) {
  m.impl("paged_attention", TORCH_FN(paged_attention));
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("fused_add_rms_norm", TORCH_FN(fused_add_rms_norm));
  m.impl("write_kv", TORCH_FN(write_kv));
  m.impl("rotary_embedding", TORCH_FN(rotary_embedding));
  m.impl("silu_and_mul", TORCH_FN(silu_and_mul));
  m.impl("linear_small_m", TORCH_FN(linear_small_m));
  m.impl("argmax", TORCH_FN(argmax_rows));
  m.impl("exponential_race", TORCH_FN(exponential_race));
}
