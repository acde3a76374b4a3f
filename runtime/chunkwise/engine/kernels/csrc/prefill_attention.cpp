// Prefill attention in bf16 on AVX512-BF16 (an AVX-512 CPU without AMX, e.g. AMD Zen 4), and in fp32 on
// AVX-512 FMA (the f32 namespace below, the same structure).
//
// A chunk of n queries at the end of a context of ctx tokens: query i sits at position ctx - n + i and sees
// keys [0, ctx - n + i]. query [n, H, D], key and value [ctx, KV, D] (the chunk's context gathered from the
// paged cache), all bf16; out [n, H, D] bf16. One call covers both the context before the chunk and the
// chunk's own causal triangle, and the query heads that share a KV head read it together.
//
// Why not torch's flash attention: on such a CPU it computes bf16 through oneDNN GEMMs of one 32-256-row
// block at a time with the softmax between them, about 45-60 GFLOP/s on one Zen 4 core at head_dim 64-128,
// and half again for a chunk after context (two calls and a merge; SDPA's causal mask is top-left). Here both
// products run on VDPBF16PS (32 bf16 multiply-adds an instruction, fp32 sums) from registers: 85-150
// GFLOP/s on the same core, 1.4-2x torch's (bench/cpu/prefill_attention.py). On AMX machines torch's flash
// attention runs on the tiles and is kept (chunkwise.engine.attention.cpu_backend decides).
//
// Arithmetic: scores and softmax in fp32 (flash attention's online softmax over blocks of 128 keys);
// probabilities rounded to bf16 before the value product, as torch's flash attention does for bf16, and
// the normaliser sums the rounded values, so the weights the values are summed with add up to one.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

using chunkwise_avx512::exp16;
constexpr bool kBuilt = true;
constexpr int R = 4;                // rows of a tile: (query, head) pairs that share a KV head
constexpr int SB = 128;             // keys per softmax block
constexpr int NG = SB / 16;         // 16-key groups per block
constexpr int TG = 4;               // tiles that walk the keys together (each block read once per TG tiles)

template <int D>
struct Tile {
  const uint32_t* qrow[R];  // the row's query as bf16 pairs along D
  int64_t last[R];          // the last key position the row sees
  int64_t orow[R];          // offset of its output row; -1 for a padding row
  float m[R];               // running maximum score
  __m512 l[R];              // running sum of probabilities, lane-wise
  alignas(64) float acc[R][D];
};

// acc[r][c0*16 .. (c0+C)*16) += sum_j P[r][j] V[j]: C vectors of 16 values per row, R*C sums in registers.
template <int D, int C>
inline void add_values(Tile<D>& t, const uint32_t (*P)[SB / 2], const uint32_t* vb, int pairs, int c0) {
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_load_ps(&t.acc[r][(c0 + c) * 16]);
  for (int j = 0; j < pairs; ++j) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vb + j * D + (c0 + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(P[r][j]));
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], p, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(&t.acc[r][(c0 + c) * 16], o[r][c]);
}

// S[r][h0*16 .. (h0+NH)*16) = scale * q_r . k for NH (<= 4) groups of 16 keys: R*NH sums in registers.
template <int D, int NH>
inline void scores(const Tile<D>& t, const uint32_t* kb, float scale, float (*S)[SB], int h0) {
  constexpr int DP = D / 2;
  __m512 s[R][NH];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NH; ++j) s[r][j] = _mm512_setzero_ps();
  for (int dp = 0; dp < DP; ++dp) {
    __m512bh k[NH];
    for (int j = 0; j < NH; ++j) k[j] = (__m512bh)_mm512_loadu_si512(kb + (j * DP + dp) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(t.qrow[r][dp]));
      for (int j = 0; j < NH; ++j) s[r][j] = _mm512_dpbf16_ps(s[r][j], q, k[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NH; ++j) _mm512_store_ps(&S[r][(h0 + j) * 16], _mm512_mul_ps(s[r][j], _mm512_set1_ps(scale)));
}

template <int D>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         double scale_d) {
  constexpr int DP = D / 2, DG = D / 16;
  const int64_t n = query.size(0), H = query.size(1), ctx = key.size(0), KV = key.size(1);
  const int64_t G = H / KV, prefix = ctx - n;
  const int64_t groups16 = (ctx + SB - 1) / SB * NG, pairs = groups16 * 8;
  const float scale = static_cast<float>(scale_d);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(query.const_data_ptr<c10::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(key.const_data_ptr<c10::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(value.const_data_ptr<c10::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);

  // Keys as [KV][group of 16][D/2][16] (pairs along D: one load feeds 16 keys' dot products), values as
  // [KV][pair of keys][D] (pairs of keys: one load feeds 16 output lanes); zero past ctx. Packed once per
  // call, then read by every query row of the KV head's group.
  std::unique_ptr<uint32_t[]> kpack(new uint32_t[KV * groups16 * DP * 16]);
  std::unique_ptr<uint32_t[]> vpack(new uint32_t[KV * pairs * D]);
  at::parallel_for(0, KV * groups16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t kh = x / groups16, g = x % groups16;
      uint32_t* kd = kpack.get() + x * DP * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = g * 16 + j;
        const uint32_t* src = t < ctx ? reinterpret_cast<const uint32_t*>(kp + t * ks0 + kh * ks1) : nullptr;
        for (int64_t dp = 0; dp < DP; ++dp) kd[dp * 16 + j] = src ? src[dp] : 0u;
      }
      for (int64_t pr = g * 8; pr < g * 8 + 8; ++pr) {
        const int64_t t0 = 2 * pr, t1 = t0 + 1;
        uint32_t* vd = vpack.get() + (kh * pairs + pr) * D;
        const uint16_t* v0 = t0 < ctx ? vp + t0 * vs0 + kh * vs1 : nullptr;
        const uint16_t* v1 = t1 < ctx ? vp + t1 * vs0 + kh * vs1 : nullptr;
        for (int64_t d = 0; d < D; ++d)
          vd[d] = static_cast<uint32_t>(v0 ? v0[d] : 0) | (static_cast<uint32_t>(v1 ? v1[d] : 0) << 16);
      }
    }
  });

  const int64_t rows = n * G, tiles = (rows + R - 1) / R, tile_groups = (tiles + TG - 1) / TG;
  at::parallel_for(0, KV * tile_groups, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<Tile<D>[]> tl(new Tile<D>[TG]);
    alignas(64) float S[R][SB];
    alignas(64) uint32_t P[R][SB / 2];
    for (int64_t x = begin; x < end; ++x) {
      const int64_t kh = x / tile_groups, t0 = (x % tile_groups) * TG, nt = std::min<int64_t>(TG, tiles - t0);
      int64_t reach = 0;  // the last key any row of these tiles sees
      for (int64_t ti = 0; ti < nt; ++ti) {
        Tile<D>& t = tl[ti];
        const int64_t r0 = (t0 + ti) * R, nr = std::min<int64_t>(R, rows - r0);
        for (int r = 0; r < R; ++r) {
          const int64_t rr = r0 + std::min<int64_t>(r, nr - 1);  // padding rows repeat the last real one
          const int64_t i = rr / G, h = kh * G + rr % G;
          t.qrow[r] = reinterpret_cast<const uint32_t*>(qp + i * qs0 + h * qs1);
          t.orow[r] = r < nr ? i * os0 + h * os1 : -1;
          t.last[r] = prefix + i;
          t.m[r] = -INFINITY;
          t.l[r] = _mm512_setzero_ps();
          std::fill(t.acc[r], t.acc[r] + D, 0.f);
          reach = std::max(reach, t.last[r]);
        }
      }
      const uint32_t* kbase = kpack.get() + kh * groups16 * DP * 16;
      const uint32_t* vbase = vpack.get() + kh * pairs * D;
      for (int64_t g0 = 0; g0 <= reach / 16; g0 += NG) {
        for (int64_t ti = 0; ti < nt; ++ti) {
          Tile<D>& t = tl[ti];
          const int64_t seen = *std::max_element(t.last, t.last + R) / 16 + 1;  // groups this tile sees
          if (g0 >= seen) continue;
          const int ng = static_cast<int>(std::min<int64_t>(NG, seen - g0));
          const uint32_t* kb = kbase + g0 * DP * 16;
          int h0 = 0;
          for (; h0 + 4 <= ng; h0 += 4) scores<D, 4>(t, kb + h0 * DP * 16, scale, S, h0);
          switch (ng - h0) {
            case 3: scores<D, 3>(t, kb + h0 * DP * 16, scale, S, h0); break;
            case 2: scores<D, 2>(t, kb + h0 * DP * 16, scale, S, h0); break;
            case 1: scores<D, 1>(t, kb + h0 * DP * 16, scale, S, h0); break;
          }
          for (int r = 0; r < R; ++r) {
            __mmask16 keep[NG];
            if (!chunkwise_avx512::open_softmax_row<D>(t, r, S[r], g0, ng, keep)) {
              std::memset(P[r], 0, sizeof(P[r]));  // a later query's keys only: nothing here for this row
              continue;
            }
            const __m512 m = _mm512_set1_ps(t.m[r]);
            for (int j = 0; j < ng; ++j) {
              const __m512 p = _mm512_maskz_mov_ps(keep[j], exp16(_mm512_sub_ps(_mm512_load_ps(&S[r][j * 16]), m)));
              const __m256i pb = (__m256i)_mm512_cvtneps_pbh(p);
              t.l[r] = _mm512_add_ps(t.l[r], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
              _mm256_store_si256(reinterpret_cast<__m256i*>(&P[r][j * 8]), pb);
            }
          }
          const uint32_t* vb = vbase + g0 * 8 * D;
          int c0 = 0;
          for (; c0 + 4 <= DG; c0 += 4) add_values<D, 4>(t, P, vb, ng * 8, c0);
          if constexpr (DG % 4 == 3) add_values<D, 3>(t, P, vb, ng * 8, c0);
          if constexpr (DG % 4 == 2) add_values<D, 2>(t, P, vb, ng * 8, c0);
          if constexpr (DG % 4 == 1) add_values<D, 1>(t, P, vb, ng * 8, c0);
        }
      }
      for (int64_t ti = 0; ti < nt; ++ti) {
        const Tile<D>& t = tl[ti];
        for (int r = 0; r < R; ++r) {
          if (t.orow[r] < 0) continue;
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(t.l[r]));
          for (int c = 0; c < D; c += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + t.orow[r] + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&t.acc[r][c]), inv)));
        }
      }
    }
  });
}

}  // namespace
#else
namespace {
constexpr bool kBuilt = false;
}  // namespace
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#include "avx512_math.h"

// The fp32 case, on AVX-512 FMA (any AVX-512 CPU). Same structure as the bf16 kernel above: tiles of R
// (query, head) rows of one KV head walking the keys together, the prefix and the chunk's causal triangle in
// one pass, online softmax over blocks of keys; scores, probabilities and sums all in fp32, nothing rounded.
// Why not torch's flash attention here: for fp32 it runs one sgemm per (query block, key block) with the
// softmax and a rescale of the output block through memory between them, and after a prefix two calls and a
// merge; here both products run from registers (R x 4 vectors of sums) over keys packed once per call.
namespace {
namespace f32 {

using chunkwise_avx512::exp16;
constexpr bool kBuilt = true;
constexpr int R = 4;        // rows of a tile
constexpr int SB = 64;      // keys per softmax block: 16 KiB of fp32 keys at D = 64, L1 with the values
constexpr int NG = SB / 16;
constexpr int TG = 4;

template <int D>
struct Tile {
  const float* qrow[R];
  int64_t last[R];
  int64_t orow[R];
  float m[R];
  __m512 l[R];
  alignas(64) float acc[R][D];
};

// S[r][h0*16 .. (h0+NH)*16) = scale * q_r . k for NH groups of 16 keys (kb: [group][D][16]).
template <int D, int NH>
inline void scores(const Tile<D>& t, const float* kb, float scale, float (*S)[SB], int h0) {
  __m512 s[R][NH];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NH; ++j) s[r][j] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 k[NH];
    for (int j = 0; j < NH; ++j) k[j] = _mm512_load_ps(kb + (j * D + d) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 q = _mm512_set1_ps(t.qrow[r][d]);
      for (int j = 0; j < NH; ++j) s[r][j] = _mm512_fmadd_ps(q, k[j], s[r][j]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NH; ++j) _mm512_store_ps(&S[r][(h0 + j) * 16], _mm512_mul_ps(s[r][j], sc));
}

// acc[r][c0*16 .. (c0+C)*16) += sum_j P[r][j] V[j] over `keys` keys, V read in place (row stride vs).
template <int D, int C>
inline void add_values(Tile<D>& t, const float (*P)[SB], const float* vb, int64_t vs, int keys, int c0) {
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_load_ps(&t.acc[r][(c0 + c) * 16]);
  for (int j = 0; j < keys; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vb + j * vs + (c0 + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(P[r][j]);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(p, v[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(&t.acc[r][(c0 + c) * 16], o[r][c]);
}

template <int D>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         double scale_d) {
  constexpr int DG = D / 16;
  const int64_t n = query.size(0), H = query.size(1), ctx = key.size(0), KV = key.size(1);
  const int64_t G = H / KV, prefix = ctx - n;
  const int64_t groups16 = (ctx + SB - 1) / SB * NG;
  const float scale = static_cast<float>(scale_d);
  const float* qp = query.const_data_ptr<float>();
  const float* kp = key.const_data_ptr<float>();
  const float* vp = value.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);

  // Keys as [KV][group of 16][D][16] (one load feeds 16 keys' products with one query element), zero past
  // ctx; packed once per call. Values are read where they are, a row per key (no row past ctx is read).
  // 64-byte aligned (the loads are aligned); freed by free(), as aligned_alloc's memory must be.
  std::unique_ptr<float, void (*)(void*)> kpack(
      static_cast<float*>(std::aligned_alloc(64, KV * groups16 * D * 16 * sizeof(float))), std::free);
  TORCH_CHECK(kpack, "prefill_attention: out of memory packing the keys");
  at::parallel_for(0, KV * groups16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t kh = x / groups16, g = x % groups16;
      float* kd = kpack.get() + x * D * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = g * 16 + j;
        const float* src = t < ctx ? kp + t * ks0 + kh * ks1 : nullptr;
        for (int64_t d = 0; d < D; ++d) kd[d * 16 + j] = src ? src[d] : 0.f;
      }
    }
  });

  const int64_t rows = n * G, tiles = (rows + R - 1) / R, tile_groups = (tiles + TG - 1) / TG;
  at::parallel_for(0, KV * tile_groups, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<Tile<D>[]> tl(new Tile<D>[TG]);
    alignas(64) float S[R][SB];
    alignas(64) float P[R][SB];
    for (int64_t x = begin; x < end; ++x) {
      const int64_t kh = x / tile_groups, t0 = (x % tile_groups) * TG, nt = std::min<int64_t>(TG, tiles - t0);
      int64_t reach = 0;
      for (int64_t ti = 0; ti < nt; ++ti) {
        Tile<D>& t = tl[ti];
        const int64_t r0 = (t0 + ti) * R, nr = std::min<int64_t>(R, rows - r0);
        for (int r = 0; r < R; ++r) {
          const int64_t rr = r0 + std::min<int64_t>(r, nr - 1);
          const int64_t i = rr / G, h = kh * G + rr % G;
          t.qrow[r] = qp + i * qs0 + h * qs1;
          t.orow[r] = r < nr ? i * os0 + h * os1 : -1;
          t.last[r] = prefix + i;
          t.m[r] = -INFINITY;
          t.l[r] = _mm512_setzero_ps();
          std::fill(t.acc[r], t.acc[r] + D, 0.f);
          reach = std::max(reach, t.last[r]);
        }
      }
      const float* kbase = kpack.get() + kh * groups16 * D * 16;
      const float* vbase = vp + kh * vs1;
      for (int64_t g0 = 0; g0 <= reach / 16; g0 += NG) {
        for (int64_t ti = 0; ti < nt; ++ti) {
          Tile<D>& t = tl[ti];
          const int64_t seen = *std::max_element(t.last, t.last + R) / 16 + 1;
          if (g0 >= seen) continue;
          const int ng = static_cast<int>(std::min<int64_t>(NG, seen - g0));
          const float* kb = kbase + g0 * D * 16;
          int h0 = 0;
          for (; h0 + 4 <= ng; h0 += 4) scores<D, 4>(t, kb + h0 * D * 16, scale, S, h0);
          switch (ng - h0) {
            case 3: scores<D, 3>(t, kb + h0 * D * 16, scale, S, h0); break;
            case 2: scores<D, 2>(t, kb + h0 * D * 16, scale, S, h0); break;
            case 1: scores<D, 1>(t, kb + h0 * D * 16, scale, S, h0); break;
          }
          for (int r = 0; r < R; ++r) {
            __mmask16 keep[NG];
            if (!chunkwise_avx512::open_softmax_row<D>(t, r, S[r], g0, ng, keep)) {
              std::memset(P[r], 0, sizeof(P[r]));  // a later query's keys only: nothing here for this row
              continue;
            }
            const __m512 m = _mm512_set1_ps(t.m[r]);
            for (int j = 0; j < ng; ++j) {
              const __m512 p = _mm512_maskz_mov_ps(keep[j], exp16(_mm512_sub_ps(_mm512_load_ps(&S[r][j * 16]), m)));
              t.l[r] = _mm512_add_ps(t.l[r], p);
              _mm512_store_ps(&P[r][j * 16], p);
            }
          }
          // Keys past the context are seen by no row (their P is 0): stop at ctx rather than read past it.
          const int keys = static_cast<int>(std::min<int64_t>(ng * 16, ctx - g0 * 16));
          const float* vb = vbase + g0 * 16 * vs0;
          int c0 = 0;
          for (; c0 + 4 <= DG; c0 += 4) add_values<D, 4>(t, P, vb, vs0, keys, c0);
          if constexpr (DG % 4 == 3) add_values<D, 3>(t, P, vb, vs0, keys, c0);
          if constexpr (DG % 4 == 2) add_values<D, 2>(t, P, vb, vs0, keys, c0);
          if constexpr (DG % 4 == 1) add_values<D, 1>(t, P, vb, vs0, keys, c0);
        }
      }
      for (int64_t ti = 0; ti < nt; ++ti) {
        const Tile<D>& t = tl[ti];
        for (int r = 0; r < R; ++r) {
          if (t.orow[r] < 0) continue;
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(t.l[r]));
          for (int c = 0; c < D; c += 16)
            _mm512_storeu_ps(op + t.orow[r] + c, _mm512_mul_ps(_mm512_load_ps(&t.acc[r][c]), inv));
        }
      }
    }
  });
}

}  // namespace f32
}  // namespace
#else
namespace {
namespace f32 {
constexpr bool kBuilt = false;
}  // namespace f32
}  // namespace
#endif

namespace {

void prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 3,
              "prefill_attention: query/out [n, H, D], key/value [ctx, KV, D]");
  const bool fp32 = query.scalar_type() == at::kFloat;
  TORCH_CHECK(fp32 ? f32::kBuilt : kBuilt, "chunkwise::prefill_attention: this build of the kernels has no ",
              fp32 ? "AVX-512" : "AVX512-BF16");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == query.scalar_type() && (fp32 || t->scalar_type() == at::kBFloat16),
                "prefill_attention: bf16 or fp32 tensors, all of one dtype");
    TORCH_CHECK(t->stride(2) == 1, "prefill_attention: the head dimension must be contiguous");
  }
  TORCH_CHECK(key.sizes() == value.sizes(), "prefill_attention: key and value differ in shape");
  TORCH_CHECK(out.sizes() == query.sizes(), "prefill_attention: out and query differ in shape");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2), ctx = key.size(0), KV = key.size(1);
  TORCH_CHECK(key.size(2) == D, "prefill_attention: head sizes differ");
  TORCH_CHECK(KV > 0 && H % KV == 0, "prefill_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(ctx >= n, "prefill_attention: the context must include the chunk");
  if (n == 0) return;
#if defined(__AVX512F__)
  if (fp32) {
    switch (D) {
      case 16: return f32::run<16>(out, query, key, value, scale);
      case 32: return f32::run<32>(out, query, key, value, scale);
      case 64: return f32::run<64>(out, query, key, value, scale);
      case 80: return f32::run<80>(out, query, key, value, scale);
      case 96: return f32::run<96>(out, query, key, value, scale);
      case 128: return f32::run<128>(out, query, key, value, scale);
      case 256: return f32::run<256>(out, query, key, value, scale);
    }
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (!fp32) switch (D) {
    case 16: return run<16>(out, query, key, value, scale);
    case 32: return run<32>(out, query, key, value, scale);
    case 64: return run<64>(out, query, key, value, scale);
    case 80: return run<80>(out, query, key, value, scale);
    case 96: return run<96>(out, query, key, value, scale);
    case 128: return run<128>(out, query, key, value, scale);
    case 256: return run<256>(out, query, key, value, scale);
  }
#endif
  TORCH_CHECK(false, "prefill_attention: no kernel for head_dim ", D);
}

bool has_prefill_attention() { return kBuilt; }
bool has_prefill_attention_fp32() { return f32::kBuilt; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkwise, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale) -> ()");
  m.def("has_prefill_attention() -> bool", &has_prefill_attention);
  m.def("has_prefill_attention_fp32() -> bool", &has_prefill_attention_fp32);
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) { m.impl("prefill_attention", TORCH_FN(prefill_attention)); }
