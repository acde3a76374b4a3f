// Vector helpers of the AVX-512 kernels (prefill_attention.cpp, paged_attention_bf16.cpp): exp, and the
// prefill kernels' shared online-softmax step. Included inside
// their `#if defined(__AVX512F__)` (or `__AVX512BF16__`) blocks, after <immintrin.h>; AVX512F only.
#pragma once

#include <cmath>
#include <cstdint>

namespace chunkwise_avx512 {

// exp on 16 lanes: Cephes' polynomial after a range reduction by ln 2 (cpu_ops.cpp's vexp, in intrinsics).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// The online softmax's bookkeeping for row r of a prefill attention tile (TileT: last, m, l, acc, as both
// prefill kernels' tiles have them) against `ng` groups of 16 keys from group g0, whose scores are srow[0 ..
// ng*16): keep[j] masks the keys of group j the row sees (its causal limit, t.last[r]); the running maximum
// rises to theirs, the running sum and the value sums rescaled to match. False when the row sees none of
// them (its probabilities over these keys are all zero).
template <int D, typename TileT>
inline bool open_softmax_row(TileT& t, int r, const float* srow, int64_t g0, int ng, __mmask16* keep) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < ng; ++j) {
    const int64_t valid = t.last[r] - (g0 + j) * 16 + 1;  // keys of this group the row sees
    keep[j] = valid >= 16 ? static_cast<__mmask16>(0xffff)
              : valid <= 0 ? static_cast<__mmask16>(0)
                           : static_cast<__mmask16>((1u << valid) - 1);
    mx = _mm512_mask_max_ps(mx, keep[j], mx, _mm512_load_ps(srow + j * 16));
  }
  const float top = _mm512_reduce_max_ps(mx);
  if (top == -INFINITY) return false;
  if (top > t.m[r]) {
    const __m512 corr = _mm512_set1_ps(std::exp(t.m[r] - top));
    t.m[r] = top;
    t.l[r] = _mm512_mul_ps(t.l[r], corr);
    for (int c = 0; c < D; c += 16)
      _mm512_store_ps(&t.acc[r][c], _mm512_mul_ps(_mm512_load_ps(&t.acc[r][c]), corr));
  }
  return true;
}

}  // namespace chunkwise_avx512
