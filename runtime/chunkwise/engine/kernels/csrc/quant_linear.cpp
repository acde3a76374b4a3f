// A linear layer over quantized weights at decode's few rows: out [M, N] = x [M, K] . W [N, K]^T (+ bias),
// W dequantized in registers from 8 or 4 bits a weight (chunkwise/engine/quant/weights.py says the formats).
//
// Decode on a CPU is a stream over the weights; reading one byte (int8, fp8) or half a byte (int4) a weight
// where bf16 reads two is the speed-up. Each tile of NR weight rows is converted once per tile of MR input
// rows, to fp32, scaled by its group's scale (minus its zero point for int4), and dotted against those input
// rows with fp32 accumulation: the products are those of the dequantized weight (weights.dequantize), so a
// float32 model gives the full-precision model's numbers up to summation order. Input and output are fp32 or
// bf16 (widened on load, rounded once on store).
//
// Written with GCC vector extensions over 16 lanes (AVX-512) or 8 (AVX2), so one source builds for both.

#include <ATen/Parallel.h>
#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "quant_weights.h"

namespace {

using namespace chunkwise_quant;

template <typename T>
inline void store(T* p, float v) {
  *p = static_cast<T>(v);
}

// MR input rows against NR weight rows. One scale a row (PER_ROW: int8 or fp8 with group_k >= K) is applied
// to the sums; otherwise each vector of weights is scaled by its group's before the products.
template <int KIND, bool PER_ROW, typename T, int MR, int NR>
inline void tile(const T* x, int64_t ldx, const Weights& w, int64_t n, int64_t K, const T* bias, T* y,
                 int64_t ldy) {
  vf acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vf{};
  const int64_t kv = K - K % VW;
  for (int64_t c = 0; c < kv; c += VW) {
    vf wv[NR];
    const int64_t g = c / w.group_k;
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = w.data + (n + j) * w.ld;
      wv[j] = load_w<KIND>(row, c);
      if constexpr (KIND == INT4) {
        const float* sc = w.scale + (n + j) * w.groups + g;
        wv[j] = (wv[j] - w.zero[(n + j) * w.groups + g]) * *sc;
      } else if constexpr (!PER_ROW) {
        wv[j] = wv[j] * w.scale[(n + j) * w.groups + g];
      }
      if ((c & 63) == 0) __builtin_prefetch(row + NR * w.ld + (KIND == INT4 ? c / 2 : c), 0, 3);
    }
    for (int i = 0; i < MR; ++i) {
      const vf xv = load_x(x + i * ldx + c);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = w.data + (n + j) * w.ld;
      float v = hsum(acc[i][j]);
      for (int64_t c = kv; c < K; ++c) {  // int8 and fp8 only: int4 rows are whole blocks
        const float wc = scalar_w<KIND>(row, c);
        v += scalar_x(x + i * ldx + c) * (PER_ROW ? wc : wc * w.scale[(n + j) * w.groups + c / w.group_k]);
      }
      if constexpr (PER_ROW) v *= w.scale[(n + j) * w.groups];
      if (bias) v += static_cast<float>(bias[n + j]);
      store(y + i * ldy + n + j, v);
    }
}

// Tile widths by input rows: accumulators as many as the registers hold beside the weights and an input.
template <int MR>
constexpr int tile_width() {
#if defined(__AVX512F__)
  return MR == 1 ? 8 : MR == 2 ? 6 : 4;
#else
  return MR == 1 ? 6 : MR == 2 ? 4 : MR == 3 ? 3 : 2;
#endif
}

// Weight rows [n0, n1) against MR input rows, NR at a time, the rest one row at a time.
template <int KIND, bool PER_ROW, typename T, int MR>
void rows(const T* x, int64_t ldx, const Weights& w, int64_t n0, int64_t n1, int64_t K, const T* bias, T* y,
          int64_t ldy) {
  constexpr int NR = tile_width<MR>();
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<KIND, PER_ROW, T, MR, NR>(x, ldx, w, n, K, bias, y, ldy);
  for (; n < n1; ++n) tile<KIND, PER_ROW, T, MR, 1>(x, ldx, w, n, K, bias, y, ldy);
}

template <int KIND, bool PER_ROW, typename T>
void run(const T* x, int64_t ldx, int64_t M, const Weights& w, int64_t N, int64_t K, const T* bias, T* y,
         int64_t ldy) {
  // Blocks of weight rows are what threads divide; within one, every four input rows go over the block's
  // weights while they are in cache (read from memory once a call whatever the number of rows).
  const int64_t block = 48;
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * block, n1 = std::min(N, n0 + block);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows<KIND, PER_ROW, T, 4>(x + m * ldx, ldx, w, n0, n1, K, bias, y + m * ldy, ldy);
      switch (M - m) {
        case 3:
          rows<KIND, PER_ROW, T, 3>(x + m * ldx, ldx, w, n0, n1, K, bias, y + m * ldy, ldy);
          break;
        case 2:
          rows<KIND, PER_ROW, T, 2>(x + m * ldx, ldx, w, n0, n1, K, bias, y + m * ldy, ldy);
          break;
        case 1:
          rows<KIND, PER_ROW, T, 1>(x + m * ldx, ldx, w, n0, n1, K, bias, y + m * ldy, ldy);
          break;
        default:
          break;
      }
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& out, const at::Tensor& x, const Weights& w, int64_t kind, int64_t N,
              const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* yp = out.mutable_data_ptr<T>();
  const int64_t ldx = x.stride(0), ldy = out.stride(0);
  const bool per_row = w.groups == 1;
  if (kind == INT8 && per_row) return run<INT8, true, T>(xp, ldx, M, w, N, K, bp, yp, ldy);
  if (kind == INT8) return run<INT8, false, T>(xp, ldx, M, w, N, K, bp, yp, ldy);
  if (kind == FP8 && per_row) return run<FP8, true, T>(xp, ldx, M, w, N, K, bp, yp, ldy);
  if (kind == FP8) return run<FP8, false, T>(xp, ldx, M, w, N, K, bp, yp, ldy);
  return run<INT4, false, T>(xp, ldx, M, w, N, K, bp, yp, ldy);
}

// out [M, N] and x [M, K] fp32 or bf16 (rows strided, columns contiguous); data [N, K] int8 or fp8, or
// [N, K / 2] uint8 (int4); scale (and zero, int4) float32 [N, groups] contiguous; group_k a multiple of VW
// unless groups == 1. chunkwise/engine/quant/compute.py checks all of it before calling.
void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                  const std::optional<at::Tensor>& zero, int64_t kind, int64_t group_k,
                  const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = data.size(0);
  if (M == 0 || N == 0) return;
  const Weights w = weights_of(data, scale, zero, group_k);
  if (x.scalar_type() == at::kFloat) return dispatch<float>(out, x, w, kind, N, bias);
  return dispatch<c10::BFloat16>(out, x, w, kind, N, bias);
}

// Rows [n0, n0 + rows) of the dequantized weight into out [rows, K] (fp32 or bf16): what a prefill chunk's
// many rows multiply through the CPU's matmul library, a block of rows at a time.
template <int KIND, typename T>
void dequantize_rows(T* out, int64_t ldo, const Weights& w, int64_t n0, int64_t rows_out, int64_t K) {
  at::parallel_for(0, rows_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = n0 + r;
      const uint8_t* row = w.data + n * w.ld;
      const float* sc = w.scale + n * w.groups;
      T* o = out + r * ldo;
      const int64_t kv = K - K % VW;
      for (int64_t c = 0; c < kv; c += VW) {
        const int64_t g = c / w.group_k;
        vf v = load_w<KIND>(row, c);
        if constexpr (KIND == INT4) v = v - w.zero[n * w.groups + g];
        v = v * sc[g];
        if constexpr (std::is_same_v<T, float>) {
          std::memcpy(o + c, &v, sizeof v);
        } else {
#if defined(__AVX512BF16__)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
          for (int i = 0; i < VW; ++i) o[c + i] = static_cast<T>(v[i]);
#endif
        }
      }
      for (int64_t c = kv; c < K; ++c) o[c] = static_cast<T>(scalar_w<KIND>(row, c) * sc[c / w.group_k]);
    }
  });
}

void quant_dequantize(at::Tensor out, const at::Tensor& data, const at::Tensor& scale,
                      const std::optional<at::Tensor>& zero, int64_t kind, int64_t group_k, int64_t n0) {
  const int64_t rows_out = out.size(0), K = out.size(1);
  const Weights w = weights_of(data, scale, zero, group_k);
  const int64_t ldo = out.stride(0);
  if (out.scalar_type() == at::kFloat) {
    float* o = out.mutable_data_ptr<float>();
    if (kind == INT8) return dequantize_rows<INT8>(o, ldo, w, n0, rows_out, K);
    if (kind == FP8) return dequantize_rows<FP8>(o, ldo, w, n0, rows_out, K);
    return dequantize_rows<INT4>(o, ldo, w, n0, rows_out, K);
  }
  c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>();
  if (kind == INT8) return dequantize_rows<INT8>(o, ldo, w, n0, rows_out, K);
  if (kind == FP8) return dequantize_rows<FP8>(o, ldo, w, n0, rows_out, K);
  return dequantize_rows<INT4>(o, ldo, w, n0, rows_out, K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkwise, m) {
  m.def(
      "quant_linear(Tensor(a!) out, Tensor x, Tensor data, Tensor scale, Tensor? zero, int kind, int group_k, "
      "Tensor? bias) -> ()");
  m.def(
      "quant_dequantize(Tensor(a!) out, Tensor data, Tensor scale, Tensor? zero, int kind, int group_k, int n0) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(chunkwise, CPU, m) {
  m.impl("quant_linear", TORCH_FN(quant_linear));
  m.impl("quant_dequantize", TORCH_FN(quant_dequantize));
}
