// Prefill attention in bf16 on AMX tiles (Intel Xeon from Sapphire Rapids on): the operands and meaning of
// prefill_attention.cpp's kernel, a separate op so the engine chooses it only where the tiles exist.
//
// A chunk of n queries at the end of a context of ctx tokens: query i sits at position ctx - n + i and sees
// keys [0, ctx - n + i]. query [n, H, D], key and value [ctx, KV, D], out [n, H, D], all bf16.
//
// Why not torch's flash attention, which also runs on the tiles there: it computes the prefix and the chunk's
// triangle in two calls merged by log-sum-exp (SDPA's causal mask is top-left), and reaches 220-280 GFLOP/s
// on one core at head_dim 64 (bench/cpu/prefill_attention.py on the Xeon). Here, per KV head, the keys are
// packed once per call into the tiles' pair-interleaved layout (B operand of S = Q K^T) and the values into
// pairs of keys (B operand of O = P V); then each block of 16 query rows of one head:
// - S = Q K^T for every key the block sees, with the block's queries held in tiles and two 16-key groups
//   multiplied per step;
// - an exact softmax per row over those scores in fp32 (no online rescaling: the whole row is in memory,
//   16 rows x ctx floats), the probabilities rounded to bf16 and the normaliser summing the rounded values,
//   as the AVX-512 kernels do;
// - O = P V accumulated in fp32 tiles over all the keys, four 16-column tiles at a time.
//
// Using the tiles needs a CPU that has them and Linux's permission (amx.h): has_prefill_attention_amx() says both.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "amx.h"

#if CHUNKWISE_AMX_BUILT
#include <immintrin.h>

#include "avx512_math.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace {

constexpr int BR = 16;           // query rows of a block: one tile's rows
constexpr int kTileBytes = 1024;  // 16 rows x 64 bytes

using chunkwise_amx::TileConfig;

void load_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
  _tile_loadconfig(&cfg);
}

// Per (query head, 16-row block): tmm0..tmm3 hold the block's queries (32 dims a tile), tmm4/tmm5 two key
// groups' packed keys, tmm6/tmm7 their scores. For the values: tmm0 the probabilities of 32 keys, tmm1/tmm2
// packed values (alternating), tmm4..tmm7 four 16-column blocks of the output.
template <int D>
struct Kernel {
  static constexpr int DC = D / 32;  // 32-dim chunks of a query row (A tiles of Q K^T)
  static constexpr int DB = D / 16;  // 16-column blocks of an output row (C tiles of P V)

  // Kp[g16][c]: 16 rows (dim pairs of chunk c) x 16 keys x 2, from keys 16 g16 .. 16 g16 + 15.
  static void pack_keys(uint32_t* kp, const uint16_t* k, int64_t ks0, int64_t ctx, int64_t groups16) {
    for (int64_t g = 0; g < groups16; ++g)
      for (int c = 0; c < DC; ++c) {
        uint32_t* dst = kp + (g * DC + c) * (kTileBytes / 4);
        for (int j = 0; j < 16; ++j) {
          const int64_t t = g * 16 + j;
          const uint32_t* src = t < ctx ? reinterpret_cast<const uint32_t*>(k + t * ks0 + c * 32) : nullptr;
          for (int p = 0; p < 16; ++p) dst[p * 16 + j] = src ? src[p] : 0u;
        }
      }
  }

  // Vp[g32][cb]: 16 rows (pairs of keys 32 g32 + 2p, +1) x 16 columns of block cb x 2.
  static void pack_values(uint32_t* vp, const uint16_t* v, int64_t vs0, int64_t ctx, int64_t groups32) {
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups32; ++g)
      for (int p = 0; p < 16; ++p) {
        const int64_t t0 = g * 32 + 2 * p, t1 = t0 + 1;
        for (int cb = 0; cb < DB; ++cb) {
          const __m256i a = t0 < ctx ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t0 * vs0 + cb * 16)) : zero;
          const __m256i b = t1 < ctx ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t1 * vs0 + cb * 16)) : zero;
          const __m512i pair =
              _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
          _mm512_storeu_si512(vp + (g * DB + cb) * (kTileBytes / 4) + p * 16, pair);
        }
      }
  }

  // S[0..16)[0 .. groups16 * 16) = Q K^T over the first groups16 (even) key groups.
  static void scores(const uint16_t* qbuf, const uint32_t* kp, int64_t groups16, float* S, int64_t s_stride) {
    _tile_loadd(0, qbuf, D * 2);
    if constexpr (DC > 1) _tile_loadd(1, qbuf + 32, D * 2);
    if constexpr (DC > 2) _tile_loadd(2, qbuf + 64, D * 2);
    if constexpr (DC > 3) _tile_loadd(3, qbuf + 96, D * 2);
    for (int64_t g = 0; g < groups16; g += 2) {
      const uint32_t* k0 = kp + g * DC * (kTileBytes / 4);
      const uint32_t* k1 = k0 + DC * (kTileBytes / 4);
      _tile_zero(6);
      _tile_zero(7);
#define CHUNKWISE_QK(C)                                 \
  if constexpr (DC > C) {                               \
    _tile_loadd(4, k0 + C * (kTileBytes / 4), 64);      \
    _tile_dpbf16ps(6, C, 4);                            \
    _tile_loadd(5, k1 + C * (kTileBytes / 4), 64);      \
    _tile_dpbf16ps(7, C, 5);                            \
  }
      CHUNKWISE_QK(0)
      CHUNKWISE_QK(1)
      CHUNKWISE_QK(2)
      CHUNKWISE_QK(3)
#undef CHUNKWISE_QK
      _tile_stored(6, S + g * 16, s_stride * 4);
      _tile_stored(7, S + (g + 1) * 16, s_stride * 4);
    }
  }

  // O[0..16)[0..D) = P V over the first groups32 groups of 32 keys; P bf16 [16][p_stride].
  static void values(const uint16_t* P, int64_t p_stride, const uint32_t* vp, int64_t groups32, float* O) {
    for (int c0 = 0; c0 < DB; c0 += 4) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t g = 0; g < groups32; ++g) {
        const uint32_t* vb = vp + (g * DB + c0) * (kTileBytes / 4);
        _tile_loadd(0, P + g * 32, p_stride * 2);
        _tile_loadd(1, vb, 64);
        _tile_dpbf16ps(4, 0, 1);
        if (c0 + 1 < DB) {
          _tile_loadd(2, vb + kTileBytes / 4, 64);
          _tile_dpbf16ps(5, 0, 2);
        }
        if (c0 + 2 < DB) {
          _tile_loadd(1, vb + 2 * (kTileBytes / 4), 64);
          _tile_dpbf16ps(6, 0, 1);
        }
        if (c0 + 3 < DB) {
          _tile_loadd(2, vb + 3 * (kTileBytes / 4), 64);
          _tile_dpbf16ps(7, 0, 2);
        }
      }
      _tile_stored(4, O + c0 * 16, D * 4);
      if (c0 + 1 < DB) _tile_stored(5, O + (c0 + 1) * 16, D * 4);
      if (c0 + 2 < DB) _tile_stored(6, O + (c0 + 2) * 16, D * 4);
      if (c0 + 3 < DB) _tile_stored(7, O + (c0 + 3) * 16, D * 4);
    }
  }

  static void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  double scale_d) {
    const int64_t n = query.size(0), H = query.size(1), ctx = key.size(0), KV = key.size(1), G = H / KV;
    const int64_t prefix = ctx - n;
    const int64_t groups32 = (ctx + 31) / 32, groups16 = groups32 * 2, padded = groups32 * 32;
    const float scale = static_cast<float>(scale_d);
    const auto* qp = reinterpret_cast<const uint16_t*>(query.const_data_ptr<c10::BFloat16>());
    const auto* kp = reinterpret_cast<const uint16_t*>(key.const_data_ptr<c10::BFloat16>());
    const auto* vp = reinterpret_cast<const uint16_t*>(value.const_data_ptr<c10::BFloat16>());
    auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
    const int64_t qs0 = query.stride(0), qs1 = query.stride(1), ks0 = key.stride(0), ks1 = key.stride(1);
    const int64_t vs0 = value.stride(0), vs1 = value.stride(1), os0 = out.stride(0), os1 = out.stride(1);

    // Both packs: groups16 * DC + groups32 * DB tiles of 1 KB per KV head (equal counts: 4 ctx D bytes).
    const int64_t per_head = groups16 * DC * (kTileBytes / 4) + groups32 * DB * (kTileBytes / 4);
    std::unique_ptr<uint32_t, void (*)(void*)> pack(
        static_cast<uint32_t*>(std::aligned_alloc(64, KV * per_head * sizeof(uint32_t))), std::free);
    TORCH_CHECK(pack, "prefill_attention_amx: out of memory packing keys and values");
    at::parallel_for(0, 2 * KV, 1, [&](int64_t begin, int64_t end) {
      for (int64_t x = begin; x < end; ++x) {
        const int64_t kh = x / 2;
        uint32_t* base = pack.get() + kh * per_head;
        if (x % 2 == 0)
          pack_keys(base, kp + kh * ks1, ks0, ctx, groups16);
        else
          pack_values(base + groups16 * DC * (kTileBytes / 4), vp + kh * vs1, vs0, ctx, groups32);
      }
    });

    const int64_t blocks = (n + BR - 1) / BR;
    at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float, void (*)(void*)> S(
          static_cast<float*>(std::aligned_alloc(64, BR * padded * sizeof(float))), std::free);
      std::unique_ptr<uint16_t, void (*)(void*)> P(
          static_cast<uint16_t*>(std::aligned_alloc(64, BR * padded * sizeof(uint16_t))), std::free);
      TORCH_CHECK(S && P, "prefill_attention_amx: out of memory for the scores");
      alignas(64) uint16_t qbuf[BR * D];
      alignas(64) float O[BR * D];
      float total[BR];
      load_tiles();
      for (int64_t x = begin; x < end; ++x) {
        const int64_t h = x / blocks, i0 = (x % blocks) * BR, nr = std::min<int64_t>(BR, n - i0);
        const int64_t kh = h / G;
        for (int64_t r = 0; r < BR; ++r) {
          if (r < nr)
            std::memcpy(qbuf + r * D, qp + (i0 + r) * qs0 + h * qs1, D * sizeof(uint16_t));
          else
            std::memset(qbuf + r * D, 0, D * sizeof(uint16_t));
        }
        // The block's last row sees keys [0, prefix + i0 + nr - 1]: score whole 32-key groups up to it.
        const int64_t seen = prefix + i0 + nr, g32 = (seen + 31) / 32;
        const uint32_t* kpack = pack.get() + kh * per_head;
        scores(qbuf, kpack, 2 * g32, S.get(), padded);
        for (int64_t r = 0; r < BR; ++r) {
          float* srow = S.get() + r * padded;
          uint16_t* prow = P.get() + r * padded;
          if (r >= nr) {  // a padding row: zero probabilities (its output is not written)
            std::memset(prow, 0, g32 * 32 * sizeof(uint16_t));
            total[r] = 1.f;
            continue;
          }
          const int64_t visible = prefix + i0 + r + 1;
          const __m512 sc = _mm512_set1_ps(scale);
          __m512 mx = _mm512_set1_ps(-INFINITY);
          for (int64_t j = 0; j < g32 * 32; j += 16) {
            const int64_t valid = visible - j;
            const __mmask16 keep = valid >= 16 ? static_cast<__mmask16>(0xffff)
                                   : valid <= 0 ? static_cast<__mmask16>(0)
                                                : static_cast<__mmask16>((1u << valid) - 1);
            const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep,
                                                _mm512_mul_ps(_mm512_load_ps(srow + j), sc));
            _mm512_store_ps(srow + j, s);
            mx = _mm512_max_ps(mx, s);
          }
          const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
          __m512 sum = _mm512_setzero_ps();
          for (int64_t j = 0; j < g32 * 32; j += 16) {
            // exp16 clamps at -87, so a masked key would get e^-87, not 0: zero it by the mask again.
            const int64_t valid = visible - j;
            const __mmask16 keep = valid >= 16 ? static_cast<__mmask16>(0xffff)
                                   : valid <= 0 ? static_cast<__mmask16>(0)
                                                : static_cast<__mmask16>((1u << valid) - 1);
            const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(
                keep, chunkwise_avx512::exp16(_mm512_sub_ps(_mm512_load_ps(srow + j), m))));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(prow + j), pb);
          }
          total[r] = _mm512_reduce_add_ps(sum);
        }
        values(P.get(), padded, kpack + groups16 * DC * (kTileBytes / 4), g32, O);
        for (int64_t r = 0; r < nr; ++r) {
          const __m512 inv = _mm512_set1_ps(1.f / total[r]);
          uint16_t* orow = op + (i0 + r) * os0 + h * os1;
          for (int c = 0; c < D; c += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(O + r * D + c), inv)));
        }
      }
      _tile_release();
    });
  }
};

}  // namespace

#pragma GCC pop_options
#endif

namespace {

bool has_prefill_attention_amx() { return CHUNKWISE_AMX_BUILT && chunkwise_amx::usable(); }

void prefill_attention_amx(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           double scale) {
  TORCH_CHECK(has_prefill_attention_amx(),
              "chunkwise::prefill_attention_amx: no AMX tiles here (this CPU or kernel build lacks AMX-BF16, or "
              "Linux refused the tile state)");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.dim() == 3,
              "prefill_attention_amx: query/out [n, H, D], key/value [ctx, KV, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "prefill_attention_amx: bf16 tensors only");
    TORCH_CHECK(t->stride(2) == 1, "prefill_attention_amx: the head dimension must be contiguous");
  }
  TORCH_CHECK(key.sizes() == value.sizes(), "prefill_attention_amx: key and value differ in shape");
  TORCH_CHECK(out.sizes() == query.sizes(), "prefill_attention_amx: out and query differ in shape");
  const int64_t n = query.size(0), H = query.size(1), D = query.size(2), ctx = key.size(0), KV = key.size(1);
  TORCH_CHECK(key.size(2) == D, "prefill_attention_amx: head sizes differ");
  TORCH_CHECK(KV > 0 && H % KV == 0, "prefill_attention_amx: heads must be a multiple of KV heads");
  TORCH_CHECK(ctx >= n, "prefill_attention_amx: the context must include the chunk");
  if (n == 0) return;
#if CHUNKWISE_AMX_BUILT
  switch (D) {
    case 32: return Kernel<32>::run(out, query, key, value, scale);
    case 64: return Kernel<64>::run(out, query, key, value, scale);
    case 96: return Kernel<96>::run(out, query, key, value, scale);
    case 128: return Kernel<128>::run(out, query, key, value, scale);
  }
#endif
  TORCH_CHECK(false, "prefill_attention_amx: no kernel for head_dim ", D, " (32, 64, 96 or 128)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkwise, m) {
  m.def("prefill_attention_amx(Tensor(a!) out, Tensor query, Tensor key, Tensor value, float scale) -> ()");
  m.def("has_prefill_attention_amx() -> bool", &has_prefill_attention_amx);
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) { m.impl("prefill_attention_amx", TORCH_FN(prefill_attention_amx)); }
