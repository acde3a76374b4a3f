// Decode attention in bf16 on AVX512-BF16: the bf16 case of cpu_ops.cpp's paged_attention (same operands,
// same meaning), for head sizes that are a multiple of 32.
//
// The generic kernel widens every key and value to fp32 and multiplies with 8-float FMAs. Here both
// products run on VDPBF16PS straight from the cache's bf16 rows, each row loaded once for all the query heads
// of its KV group:
// - scores: a key row (D bf16) times a query (D bf16) gives 16 lane sums, and 16 keys' lane sums are
//   reduced together by a transposing tree (45 shuffles and adds for 16 scores);
// - values: two consecutive keys' rows are interleaved (unpacklo/hi_epi16) into pairs of keys, so one
//   VDPBF16PS adds p_j v_j + p_j+1 v_j+1 for 16 outputs; the interleave permutes the outputs within each
//   128-bit lane, undone once per row at the end.
// Scores, the softmax and the sums are fp32; the probabilities are rounded to bf16 for the value product (as
// the prefill kernel and torch's flash attention do in bf16), and the normaliser sums the rounded values.

#include <ATen/Parallel.h>
#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "avx512_math.h"
#include "paged_operands.h"

namespace {

constexpr int kMaxGroup = 16;   // query heads per KV head this path takes (more: the generic kernel)
constexpr int kMaxHeads = 128;  // as cpu_ops.cpp

using chunkwise_avx512::exp16;

// out[j] = sum of p[j]'s 16 lanes, for 16 vectors.
inline __m512 reduce16(const __m512* p) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // u[i] holds, in each 128-bit quarter q, the partial sums of keys 4i..4i+3 over that quarter's lanes.
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// One query token over its `len` keys. Keys and values are read position by position with every KV head of
// a slot together (its heads are adjacent in the cache): one pass over the context for the scores, one for the
// values, whatever the number of KV heads.
template <int D>
void attend(const uint16_t* q, int64_t q_head_stride, uint16_t* out, int64_t out_head_stride, int num_heads,
            int num_kv_heads, const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_stride,
            int64_t slot_stride, int64_t head_stride, const int64_t* table, int64_t block_size, int64_t len,
            float scale, float* scores, uint16_t* probs, __m512bh* qz, __m512* acc) {
  constexpr int Z = D / 32;  // zmm registers of bf16 per row
  const int G = num_heads / num_kv_heads;
  const int64_t padded = (len + 15) / 16 * 16;
  auto slot = [&](const uint16_t* cache, int64_t p) {
    return cache + table[p / block_size] * block_stride + (p % block_size) * slot_stride;
  };
  for (int h = 0; h < num_heads; ++h)
    for (int c = 0; c < Z; ++c) qz[h * Z + c] = (__m512bh)_mm512_loadu_si512(q + h * q_head_stride + c * 32);
  // Scores, 16 keys at a time; rows past len are zeros, their scores masked.
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    const __mmask16 keep = n == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
    const uint16_t* rows[16];
    for (int j = 0; j < n; ++j) rows[j] = slot(k_cache, p0 + j);
    for (int kh = 0; kh < num_kv_heads; ++kh) {
      __m512 part[kMaxGroup][16];
      for (int j = 0; j < 16; ++j) {
        __m512bh k[Z];
        for (int c = 0; c < Z; ++c)
          k[c] = j < n ? (__m512bh)_mm512_loadu_si512(rows[j] + kh * head_stride + c * 32)
                       : (__m512bh)_mm512_setzero_si512();
        for (int g = 0; g < G; ++g) {
          const __m512bh* qh = qz + (kh * G + g) * Z;
          __m512 sc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], k[0]);
          for (int c = 1; c < Z; ++c) sc = _mm512_dpbf16_ps(sc, qh[c], k[c]);
          part[g][j] = sc;
        }
      }
      for (int g = 0; g < G; ++g)
        _mm512_storeu_ps(scores + (kh * G + g) * padded + p0,
                         _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep,
                                            _mm512_mul_ps(reduce16(part[g]), _mm512_set1_ps(scale))));
    }
  }
  // Probabilities rounded to bf16 (zero past len), and their sum as rounded.
  float total[kMaxHeads];
  for (int h = 0; h < num_heads; ++h) {
    const float* sh = scores + h * padded;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t p0 = 0; p0 < padded; p0 += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + p0));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < padded; p0 += 16) {
      const __m256i pb = (__m256i)_mm512_cvtneps_pbh(exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + p0), m)));
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + h * padded + p0), pb);
    }
    total[h] = _mm512_reduce_add_ps(sum);
  }
  // Values, two keys at a time (exp(-inf) is 0 past len; the missing row of an odd len is zeros), 16 keys
  // per visit of each KV head's sums.
  for (int i = 0; i < num_heads * 2 * Z; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    const uint16_t* rows[16];
    for (int j = 0; j < n; ++j) rows[j] = slot(v_cache, p0 + j);
    for (int kh = 0; kh < num_kv_heads; ++kh) {
      __m512 a[kMaxGroup][2 * Z];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2 * Z; ++c) a[g][c] = acc[((kh * G + g) * 2 * Z) + c];
      for (int j = 0; j < n; j += 2) {
        __m512bh pairs[2 * Z];
        for (int c = 0; c < Z; ++c) {
          const __m512i x = _mm512_loadu_si512(rows[j] + kh * head_stride + c * 32);
          const __m512i y = j + 1 < n ? _mm512_loadu_si512(rows[j + 1] + kh * head_stride + c * 32)
                                      : _mm512_setzero_si512();
          pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
          pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < G; ++g) {
          uint32_t pp;  // (p_j, p_j+1); p_j+1 is 0 past len
          std::memcpy(&pp, probs + (kh * G + g) * padded + p0 + j, sizeof(pp));
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp));
          for (int c = 0; c < 2 * Z; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], w, pairs[c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2 * Z; ++c) acc[((kh * G + g) * 2 * Z) + c] = a[g][c];
    }
  }
  // acc[h][2c] holds outputs 32c + {8L..8L+3}, acc[h][2c+1] outputs 32c + {8L+4..8L+7}, lane quarter L.
  for (int h = 0; h < num_heads; ++h) {
    const float inv = 1.f / total[h];
    alignas(64) float lo[16], hi[16];
    alignas(64) float o[D];
    for (int c = 0; c < Z; ++c) {
      _mm512_store_ps(lo, acc[h * 2 * Z + 2 * c]);
      _mm512_store_ps(hi, acc[h * 2 * Z + 2 * c + 1]);
      for (int L = 0; L < 4; ++L)
        for (int e = 0; e < 4; ++e) {
          o[32 * c + 8 * L + e] = lo[4 * L + e] * inv;
          o[32 * c + 8 * L + 4 + e] = hi[4 * L + e] * inv;
        }
    }
    uint16_t* oh = out + h * out_head_stride;
    for (int c = 0; c < D; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(oh + c), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(o + c)));
  }
}

template <int D>
void run(at::TensorBase& out, const at::TensorBase& query, const at::TensorBase& kv_cache,
         const at::TensorBase& block_tables, const at::TensorBase& token_rows, const at::TensorBase& token_index,
         const at::TensorBase& token_lens, double scale) {
  const chunkwise_paged::Bf16Operands a(out, query, kv_cache, block_tables, token_rows, token_index, token_lens);
  const int64_t n = a.n, padded = a.padded;
  const int num_heads = a.heads, num_kv_heads = a.kv_heads;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> scores(new float[num_heads * padded]);
    std::unique_ptr<uint16_t[]> probs(new uint16_t[num_heads * padded + 2]);
    std::unique_ptr<__m512bh[]> qz(new __m512bh[num_heads * (D / 32)]);
    std::unique_ptr<__m512[]> acc(new __m512[num_heads * 2 * (D / 32)]);
    for (int64_t i = begin; i < end; ++i) {
      if (a.lens[i] <= 0) continue;
      const int64_t t = a.index[i];
      attend<D>(a.q + t * a.qs0, a.qs1, a.o + t * a.os0, a.os1, num_heads, num_kv_heads, a.k_cache, a.v_cache,
                a.block_stride, a.slot_stride, a.head_stride, a.tables + a.rows[i] * a.table_stride, a.block_size,
                a.lens[i], static_cast<float>(scale), scores.get(), probs.get(), qz.get(), acc.get());
    }
  });
}

}  // namespace

// cpu_ops.cpp's paged_attention calls this first for bf16; false: not this path's shape, run the generic one.
bool chunkwise_paged_attention_bf16(at::TensorBase& out, const at::TensorBase& query, const at::TensorBase& kv_cache,
                                    const at::TensorBase& block_tables, const at::TensorBase& token_rows,
                                    const at::TensorBase& token_index, const at::TensorBase& token_lens,
                                    double scale) {
  const int64_t heads = query.size(1), kv_heads = kv_cache.size(3);
  if (kv_heads <= 0 || heads > kMaxHeads || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup) return false;
  if (query.stride(2) != 1 || out.stride(2) != 1 || kv_cache.stride(4) != 1) return false;
  switch (query.size(2)) {
    case 32: run<32>(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale); return true;
    case 64: run<64>(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale); return true;
    case 96: run<96>(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale); return true;
    case 128: run<128>(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale); return true;
    case 256: run<256>(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale); return true;
  }
  return false;
}
#else
bool chunkwise_paged_attention_bf16(at::TensorBase&, const at::TensorBase&, const at::TensorBase&,
                                    const at::TensorBase&, const at::TensorBase&, const at::TensorBase&,
                                    const at::TensorBase&, double) {
  return false;
}
#endif
