// Decode attention in bf16 with the scores on AMX tiles: cpu_ops.cpp's paged_attention (same operands, same
// meaning) for head sizes 32-128 in steps of 32, at most 16 query heads per KV head, blocks of a multiple of
// 16 tokens. A separate op, so the engine chooses it only where the tiles exist.
//
// paged_attention_bf16.cpp computes a score as 16 lane sums of VDPBF16PS and reduces 16 keys' sums with a
// transposing tree: as many shuffles as multiply-adds, on one port. Here the 16 keys of a block's group are
// one tile read straight from the cache (rows a slot apart) and the G queries of a KV head the other operand
// (packed once per row), so S^T = K Q^T [16 keys x G] comes out of one tile multiply per 32 dims with no
// reduction. Keys are rows and queries lanes, so the softmax over keys is lane-wise (a vertical max and sum
// over 16-float rows) and leaves each pair of keys' probabilities as the (p_j, p_j+1) pairs the value
// product wants; the values stay on VDPBF16PS as in paged_attention_bf16.cpp (two keys' rows interleaved,
// the outputs permuted within 128-bit lanes and put back at the end).
//
// Arithmetic as paged_attention_bf16.cpp: scores, softmax and sums fp32; probabilities rounded to bf16 for
// the value product, the normaliser summing the rounded values.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "amx.h"

#if CHUNKWISE_AMX_BUILT
#include <immintrin.h>

#include "avx512_math.h"
#include "paged_operands.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace {

constexpr int kMaxGroup = 16;  // query heads per KV head: the lanes of a score row

// Tiles: 0/1 keys (32 dims, alternating), 2/3 scores (two groups in flight), 4..7 the packed queries of
// each 32-dim chunk.
void load_tiles(int G) {
  chunkwise_amx::TileConfig cfg;
  cfg.set(0, 16, 64);
  cfg.set(1, 16, 64);
  cfg.set(2, 16, G * 4);
  cfg.set(3, 16, G * 4);
  for (int t = 4; t < 8; ++t) cfg.set(t, 16, G * 4);
  _tile_loadconfig(&cfg);
}

template <int D>
struct Decode {
  static constexpr int Z = D / 32;  // 32-dim chunks: zmm registers of bf16 per row, tiles per score

  // S^T[j][g] (16 floats a row, lanes past G unused) for the 16 keys of one group, unscaled, through score
  // tile CT (2 or 3: two groups in flight; a literal, as the tile instructions name registers), the key
  // chunks alternating between tiles 0 and 1.
#define CHUNKWISE_GROUP_SCORES(NAME, CT)                                       \
  static void NAME(const uint16_t* keys, int64_t row_bytes, float* st) {      \
    _tile_zero(CT);                                                           \
    _tile_loadd(0, keys, row_bytes);                                          \
    _tile_dpbf16ps(CT, 0, 4);                                                 \
    if constexpr (Z > 1) {                                                    \
      _tile_loadd(1, keys + 32, row_bytes);                                   \
      _tile_dpbf16ps(CT, 1, 5);                                               \
    }                                                                         \
    if constexpr (Z > 2) {                                                    \
      _tile_loadd(0, keys + 64, row_bytes);                                   \
      _tile_dpbf16ps(CT, 0, 6);                                               \
    }                                                                         \
    if constexpr (Z > 3) {                                                    \
      _tile_loadd(1, keys + 96, row_bytes);                                   \
      _tile_dpbf16ps(CT, 1, 7);                                               \
    }                                                                         \
    _tile_stored(CT, st, 64);                                                 \
  }
  CHUNKWISE_GROUP_SCORES(scores_a, 2)
  CHUNKWISE_GROUP_SCORES(scores_b, 3)
#undef CHUNKWISE_GROUP_SCORES

  // GG: the query heads per KV head when known at compile time (1, 2, 4 or 8: the loops over them unroll and
  // the value sums stay in registers), 0 for any other count.
  template <int GG>
  static void attend(const uint16_t* q, int64_t q_head_stride, uint16_t* out, int64_t out_head_stride, int H,
                     int KV, const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_stride,
                     int64_t slot_stride, int64_t head_stride, const int64_t* table, int64_t block_size, int64_t len,
                     float scale, float* st, uint32_t* pp, uint32_t* qt) {
    const int G = GG ? GG : H / KV;
    const int64_t padded = (len + 15) / 16 * 16;
    auto slot = [&](const uint16_t* cache, int64_t p) {
      return cache + table[p / block_size] * block_stride + (p % block_size) * slot_stride;
    };
    for (int kh = 0; kh < KV; ++kh) {
      // Q^T as the tiles take it: for chunk c, row p holds dims (32c + 2p, +1) of each of the G queries.
      for (int g = 0; g < G; ++g) {
        const uint32_t* qg = reinterpret_cast<const uint32_t*>(q + (kh * G + g) * q_head_stride);
        for (int c = 0; c < Z; ++c)
          for (int p = 0; p < 16; ++p) qt[(c * 16 + p) * G + g] = qg[c * 16 + p];
      }
      _tile_loadd(4, qt, G * 4);
      if constexpr (Z > 1) _tile_loadd(5, qt + 16 * G, G * 4);
      if constexpr (Z > 2) _tile_loadd(6, qt + 32 * G, G * 4);
      if constexpr (Z > 3) _tile_loadd(7, qt + 48 * G, G * 4);
      // Scores of every group (rows past len read the block's unused slots; they are masked below).
      for (int64_t p0 = 0; p0 < len; p0 += 32) {
        scores_a(slot(k_cache, p0) + kh * head_stride, slot_stride * 2, st + p0 * 16);
        if (p0 + 16 < len)
          scores_b(slot(k_cache, p0 + 16) + kh * head_stride, slot_stride * 2, st + (p0 + 16) * 16);
      }
      // Softmax over keys, lane g for query g: the maximum, then (p_j, p_j+1) pairs rounded to bf16.
      const __m512 sc = _mm512_set1_ps(scale);
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < len; ++j) mx = _mm512_max_ps(mx, _mm512_load_ps(st + j * 16));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < padded; j += 2) {
        const __m512 e0 = chunkwise_avx512::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(st + j * 16), mx), sc));
        const __m512 e1 = j + 1 < len ? chunkwise_avx512::exp16(
                                            _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(st + (j + 1) * 16), mx), sc))
                                      : _mm512_setzero_ps();
        const __m512i b0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(j < len ? e0 : _mm512_setzero_ps()));
        const __m512i b1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(b0, 16)));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16)));
        _mm512_store_si512(pp + (j / 2) * 16, _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
      }
      alignas(64) float total[16];
      _mm512_store_ps(total, sum);
      // Values, two keys at a time, each query's pair of probabilities broadcast.
      __m512 a[GG ? GG : kMaxGroup][2 * Z];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2 * Z; ++c) a[g][c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < len; j += 2) {
        const uint16_t* x0 = slot(v_cache, j) + kh * head_stride;
        const uint16_t* x1 = j + 1 < len ? slot(v_cache, j + 1) + kh * head_stride : nullptr;
        __m512bh pairs[2 * Z];
        for (int c = 0; c < Z; ++c) {
          const __m512i x = _mm512_loadu_si512(x0 + c * 32);
          const __m512i y = x1 ? _mm512_loadu_si512(x1 + c * 32) : _mm512_setzero_si512();
          pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
          pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        const uint32_t* pj = pp + (j / 2) * 16;
        for (int g = 0; g < G; ++g) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pj[g]));
          for (int c = 0; c < 2 * Z; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], w, pairs[c]);
        }
      }
      // a[g][2c] holds outputs 32c + {8L..8L+3}, a[g][2c+1] outputs 32c + {8L+4..8L+7}, lane quarter L.
      for (int g = 0; g < G; ++g) {
        const float inv = 1.f / total[g];
        alignas(64) float lo[16], hi[16];
        alignas(64) float o[D];
        for (int c = 0; c < Z; ++c) {
          _mm512_store_ps(lo, a[g][2 * c]);
          _mm512_store_ps(hi, a[g][2 * c + 1]);
          for (int L = 0; L < 4; ++L)
            for (int e = 0; e < 4; ++e) {
              o[32 * c + 8 * L + e] = lo[4 * L + e] * inv;
              o[32 * c + 8 * L + 4 + e] = hi[4 * L + e] * inv;
            }
        }
        uint16_t* oh = out + (kh * G + g) * out_head_stride;
        for (int c = 0; c < D; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(oh + c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(o + c)));
      }
    }
  }

  static void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& token_rows, const at::Tensor& token_index,
                  const at::Tensor& token_lens, double scale) {
    const chunkwise_paged::Bf16Operands a(out, query, kv_cache, block_tables, token_rows, token_index, token_lens);
    const int64_t padded = a.padded;
    const int H = a.heads, KV = a.kv_heads;
    at::parallel_for(0, a.n, 1, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float, void (*)(void*)> st(
          static_cast<float*>(std::aligned_alloc(64, padded * 16 * sizeof(float))), std::free);
      std::unique_ptr<uint32_t, void (*)(void*)> pp(
          static_cast<uint32_t*>(std::aligned_alloc(64, (padded / 2 + 1) * 16 * sizeof(uint32_t))), std::free);
      TORCH_CHECK(st && pp, "paged_attention_amx: out of memory for the scores");
      // The tiles write G lanes of each score row; the rest are computed on and ignored, and must not be
      // whatever the allocator left (denormals there cost a microcode assist per operation: 30x slower).
      std::memset(st.get(), 0, padded * 16 * sizeof(float));
      alignas(64) uint32_t qt[4 * 16 * kMaxGroup];
      load_tiles(H / KV);
      auto* one = &attend<0>;
      switch (H / KV) {
        case 1: one = &attend<1>; break;
        case 2: one = &attend<2>; break;
        case 4: one = &attend<4>; break;
        case 8: one = &attend<8>; break;
      }
      for (int64_t i = begin; i < end; ++i) {
        if (a.lens[i] <= 0) continue;
        const int64_t t = a.index[i];
        one(a.q + t * a.qs0, a.qs1, a.o + t * a.os0, a.os1, H, KV, a.k_cache, a.v_cache, a.block_stride,
            a.slot_stride, a.head_stride, a.tables + a.rows[i] * a.table_stride, a.block_size, a.lens[i],
            static_cast<float>(scale), st.get(), pp.get(), qt);
      }
      _tile_release();
    });
  }
};

}  // namespace

#pragma GCC pop_options
#endif

namespace {

bool has_paged_attention_amx() { return CHUNKWISE_AMX_BUILT && chunkwise_amx::usable(); }

void paged_attention_amx(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& token_rows, const at::Tensor& token_index,
                         const at::Tensor& token_lens, double scale) {
  TORCH_CHECK(has_paged_attention_amx(),
              "chunkwise::paged_attention_amx: no AMX tiles here (this CPU or kernel build lacks AMX-BF16, or "
              "Linux refused the tile state)");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_attention_amx: query/out [tokens, H, D], kv_cache [2, blocks, block_size, KV, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &kv_cache})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "paged_attention_amx: bf16 query, output and cache only");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.is_contiguous(),
              "paged_attention_amx: contiguous heads and a contiguous cache");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&block_tables, &token_rows, &token_index,
                                                                      &token_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->stride(-1) == 1,
                "paged_attention_amx: int64 tables, rows, indices and lengths");
  const int64_t H = query.size(1), KV = kv_cache.size(3), D = query.size(2), block_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == D, "paged_attention_amx: head sizes differ");
  TORCH_CHECK(KV > 0 && H % KV == 0 && H / KV <= 16,
              "paged_attention_amx: heads must be a multiple of KV heads, at most 16 per KV head");
  TORCH_CHECK(block_size % 16 == 0, "paged_attention_amx: blocks of a multiple of 16 tokens, got ", block_size);
#if CHUNKWISE_AMX_BUILT
  switch (D) {
    case 32: return Decode<32>::run(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale);
    case 64: return Decode<64>::run(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale);
    case 96: return Decode<96>::run(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale);
    case 128: return Decode<128>::run(out, query, kv_cache, block_tables, token_rows, token_index, token_lens, scale);
  }
#endif
  TORCH_CHECK(false, "paged_attention_amx: no kernel for head_dim ", D, " (32, 64, 96 or 128)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkwise, m) {
  m.def(
      "paged_attention_amx(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor token_rows, "
      "Tensor token_index, Tensor token_lens, float scale) -> ()");
  m.def("has_paged_attention_amx() -> bool", &has_paged_attention_amx);
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) { m.impl("paged_attention_amx", TORCH_FN(paged_attention_amx)); }
