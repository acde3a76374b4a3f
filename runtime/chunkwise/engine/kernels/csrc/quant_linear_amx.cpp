// quant_linear.cpp's product for bf16 inputs on AMX tiles: out [M, N] = x [M, K] . W [N, K]^T (+ bias), up to
// 16 input rows a pass.
//
// With AVX-512 the quantized kernel's fp32 products cost as much per input row as reading the weight saves:
// past four rows a bf16 model on oneDNN's AMX GEMM was faster. Here the product is transposed (paged_attention
// _amx.cpp's arrangement): Y^T = W X^T, the weight the tile multiply's A operand, 16 weight rows x 32 columns
// in its own row-major order, converted from its 8 or 4 bits into bf16 in a 1 KiB buffer (exact for int8 and
// fp8 codes, with one scale a row applied to the sums; block- or group-scaled weights are scaled before the
// rounding, as a bf16 model's weights are rounded), and the input rows packed once a call as the B operand.
// One tile multiply covers 16 x 32 weights for all the rows: the weight is read once and converted once a
// pass, whatever the number of rows.

#include <ATen/Parallel.h>
#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "amx.h"

#if CHUNKWISE_AMX_BUILT
#include <immintrin.h>

#include "quant_weights.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace {

using namespace chunkwise_quant;

constexpr int kRows = 16;  // weight rows a tile, and input rows a pass

// Tiles: 0/1 the weight chunks (alternating), 2/3 the packed input chunks, 4/5 the sums [16 weight rows x M]
// of the even and the odd chunks.
void load_tiles(int M) {
  chunkwise_amx::TileConfig cfg;
  cfg.set(0, 16, 64);
  cfg.set(1, 16, 64);
  cfg.set(2, 16, M * 4);
  cfg.set(3, 16, M * 4);
  cfg.set(4, 16, M * 4);
  cfg.set(5, 16, M * 4);
  _tile_loadconfig(&cfg);
}

// Weight rows [n, n + rows) x columns [c, c + 32) as bf16 into buf [16][32] (rows past `rows`: zero).
template <int KIND, bool PER_ROW>
inline void convert(const Weights& w, int64_t n, int rows, int64_t c, c10::BFloat16* buf) {
  const int64_t g = c / w.group_k;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = w.data + (n + r) * w.ld;
    vf lo = load_w<KIND>(row, c), hi = load_w<KIND>(row, c + 16);
    if constexpr (KIND == INT4) {
      const float z = w.zero[(n + r) * w.groups + g], s = w.scale[(n + r) * w.groups + g];
      lo = (lo - z) * s, hi = (hi - z) * s;
    } else if constexpr (!PER_ROW) {
      const float s = w.scale[(n + r) * w.groups + g];
      lo = lo * s, hi = hi * s;
    }
    _mm512_store_si512(buf + r * 32, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
  }
}

template <int KIND, bool PER_ROW>
void run(const c10::BFloat16* x, int64_t ldx, int64_t M, const Weights& w, int64_t N, int64_t K,
         const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  const int64_t chunks = K / 32;
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m0));
    // B operands: chunk k, row p holds columns 32k + 2p and + 1 of each input row (one 32-bit pair a row).
    std::vector<uint32_t> packed(chunks * 16 * mr);
    for (int i = 0; i < mr; ++i) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(x + (m0 + i) * ldx);
      for (int64_t k = 0; k < chunks; ++k)
        for (int p = 0; p < 16; ++p) packed[(k * 16 + p) * mr + i] = src[k * 16 + p];
    }
    const uint32_t* xp = packed.data();
    at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
      alignas(64) c10::BFloat16 buf[2][kRows * 32];
      alignas(64) float sums[2][kRows * kRows];
      std::memset(buf, 0, sizeof buf);
      load_tiles(mr);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * kRows;
        const int rows = static_cast<int>(std::min<int64_t>(kRows, N - n));
        if (rows < kRows) std::memset(buf, 0, sizeof buf);
        // Even chunks sum into tile 4, odd ones into 5: two chains of tile multiplies, each waiting only
        // for its own previous one.
        _tile_zero(4);
        _tile_zero(5);
        int64_t k = 0;
        for (; k + 2 <= chunks; k += 2) {
          convert<KIND, PER_ROW>(w, n, rows, k * 32, buf[0]);
          _tile_loadd(0, buf[0], 64);
          _tile_loadd(2, xp + k * 16 * mr, mr * 4);
          _tile_dpbf16ps(4, 0, 2);
          convert<KIND, PER_ROW>(w, n, rows, (k + 1) * 32, buf[1]);
          _tile_loadd(1, buf[1], 64);
          _tile_loadd(3, xp + (k + 1) * 16 * mr, mr * 4);
          _tile_dpbf16ps(5, 1, 3);
        }
        if (k < chunks) {
          convert<KIND, PER_ROW>(w, n, rows, k * 32, buf[0]);
          _tile_loadd(0, buf[0], 64);
          _tile_loadd(2, xp + k * 16 * mr, mr * 4);
          _tile_dpbf16ps(4, 0, 2);
        }
        _tile_stored(4, sums[0], mr * 4);
        _tile_stored(5, sums[1], mr * 4);
        for (int r = 0; r < rows; ++r) {
          const float s = PER_ROW ? w.scale[(n + r) * w.groups] : 1.0f;
          const float b = bias ? static_cast<float>(bias[n + r]) : 0.0f;
          for (int i = 0; i < mr; ++i) y[(m0 + i) * ldy + n + r] = static_cast<c10::BFloat16>((sums[0][r * mr + i] + sums[1][r * mr + i]) * s + b);
        }
      }
      _tile_release();
    });
  }
}

}  // namespace

#pragma GCC pop_options
#endif

namespace {

bool has_quant_linear_amx() { return CHUNKWISE_AMX_BUILT && chunkwise_amx::usable(); }

// As quant_linear (quant_linear.cpp), bf16 input and output only, K a multiple of 32, and groups of a
// multiple of 32 columns unless one a row. chunkwise/engine/quant/compute.py checks all of it.
void quant_linear_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                      const std::optional<at::Tensor>& zero, int64_t kind, int64_t group_k,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_quant_linear_amx(), "chunkwise::quant_linear_amx: no AMX tiles here");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "quant_linear_amx: bf16 input and output only");
  TORCH_CHECK(x.size(1) % 32 == 0, "quant_linear_amx: input features must be a multiple of 32");
#if CHUNKWISE_AMX_BUILT
  const int64_t M = x.size(0), N = data.size(0), K = x.size(1);
  if (M == 0 || N == 0) return;
  const Weights w = weights_of(data, scale, zero, group_k);
  const bool per_row = w.groups == 1;
  TORCH_CHECK(per_row || group_k % 32 == 0, "quant_linear_amx: groups of a multiple of 32 columns");
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* bp = bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), ldy = out.stride(0);
  if (kind == INT8 && per_row) return run<INT8, true>(xp, ldx, M, w, N, K, bp, yp, ldy);
  if (kind == INT8) return run<INT8, false>(xp, ldx, M, w, N, K, bp, yp, ldy);
  if (kind == FP8 && per_row) return run<FP8, true>(xp, ldx, M, w, N, K, bp, yp, ldy);
  if (kind == FP8) return run<FP8, false>(xp, ldx, M, w, N, K, bp, yp, ldy);
  return run<INT4, false>(xp, ldx, M, w, N, K, bp, yp, ldy);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkwise, m) {
  m.def(
      "quant_linear_amx(Tensor(a!) out, Tensor x, Tensor data, Tensor scale, Tensor? zero, int kind, int group_k, "
      "Tensor? bias) -> ()");
  m.def("has_quant_linear_amx() -> bool", &has_quant_linear_amx);
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) { m.impl("quant_linear_amx", TORCH_FN(quant_linear_amx)); }
