// int8-weight GEMV for linears with 1-8 input rows: y[R, N] = (x[R, K] @ q[N, K]^T) * scale[N], x bf16, q int8,
// scale bf16 (per output channel), fp32 accumulation, the result rounded once to bf16 (round to nearest even).
//
// Called directly from AOTInductor-generated wrappers (a C shim); see neuron_infer/compile/cpu_gemv.py for the op,
// its PyTorch reference twin and how this file is built.
//
// Numerics: weight-only. Each int8 weight is widened to fp32 in registers (vpmovsxbd + vcvtdq2ps, exact) and
// multiplied by the activation widened from bf16 (exact: an 8-bit by 8-bit significand product fits fp32's 24 bits),
// so the only difference from the reference (fp32 matmul of the same values, times the scale) is the order of the
// fp32 sums. The activations are not quantized.
//
// Not VNNI (vpdpbusd, 64 int8 products per instruction): it needs the activations quantized to 8 bits per row, an
// extra error of about 1/254 of each row's absmax per element; this weight-only kernel keeps the numerics of the
// eager int8 model. VNNI serves the w8a8 scheme, whose activations are int8 by definition (cpu_gemv_w8a8.cpp).
//
// Built for AVX-512 (-mavx512f -mavx512bw -mavx512vl: 16 weights per vector, masked K tails) or, on CPUs without
// it, AVX2 + FMA (8 weights per vector, scalar K tail); the compiler flags pick the path.
#include "cpu_gemv_common.h"

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using ni_gemv::for_column_groups;
using ni_gemv::from_bf16;
using ni_gemv::Gemv;
using ni_gemv::gemv_operands;
using ni_gemv::to_bf16;

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec widen(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec widen(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline float hsum(Vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// Weight rows (output columns) per pass over the activations: every activation vector loaded is used by C rows,
// read as C sequential streams (see gemv_rows). With AVX2's 16 registers: 4 for 1-2 rows, 2 for 3-6; from 7 rows on
// C x R accumulators would not fit next to the weights. With AVX-512's 32: 4 for 1-5 rows, 3 for 6-8.
// One accumulator per (weight row, activation row), the vectors added in order: every row's sum is formed in one
// order whatever R and C are, so a row's result does not depend on the other rows of the call (a speculative verify
// computes what one-row decode steps compute; docs/cpu-backend.md, "Batch invariance").
#ifdef __AVX512F__
template <int R>
constexpr int kCols = R <= 5 ? 4 : 3;
#else
template <int R>
constexpr int kCols = R <= 2 ? 4 : R <= 6 ? 2 : 1;
#endif

// Keeps a loaded activation vector in a register for all C columns (not one memory operand per FMA).
inline void keep(Vec& x) {
#ifdef __AVX512F__
  asm("" : "+v"(x));
#else
  asm("" : "+x"(x));
#endif
}

// Columns j, j + cs, ..., j + (C - 1) cs for R rows: y[r * n + j + c cs] = (x[r] . q[j + c cs]) * scale[j + c cs].
// xf: R fp32 rows of kp >= k floats (zero beyond k); q rows `qs` apart; y rows `n` apart.
template <int R, int C>
void columns(const float* xf, int64_t kp, const int8_t* q, int64_t qs, const uint16_t* scale, uint16_t* y,
             int64_t n, int64_t k, int64_t j, int64_t cs) {
  const int64_t kv = k / kLanes * kLanes;
  const int8_t* qr[C];
  for (int c = 0; c < C; c++) qr[c] = q + (j + c * cs) * qs;
  Vec acc[C][R];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) acc[c][r] = zero();
  // One vector of weights of each column at qr[c] + i into acc.
  auto step = [&](int64_t i) {
    Vec w[C];
    for (int c = 0; c < C; c++) w[c] = widen(qr[c] + i);
    for (int r = 0; r < R; r++) {
      Vec x = load(xf + r * kp + i);
      if (C > 1) keep(x);
      for (int c = 0; c < C; c++) acc[c][r] = fma(w[c], x, acc[c][r]);
    }
  };
  int64_t i = 0;
  for (; i < kv; i += kLanes) {
    if (i % 64 == 0)  // once per 64-byte line of each stream
      ni_gemv::prefetch_ahead<C>(qr, i);
    step(i);
  }
  float sum[C][R];
#ifdef __AVX512F__
  if (i < k) {  // masked tail: lanes beyond k load 0 (and xf is 0 there)
    const __mmask16 m = static_cast<__mmask16>((1u << (k - i)) - 1);
    for (int c = 0; c < C; c++) {
      const Vec w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, qr[c] + i)));
      for (int r = 0; r < R; r++) acc[c][r] = fma(w, load(xf + r * kp + i), acc[c][r]);
    }
  }
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) sum[c][r] = hsum(acc[c][r]);
#else
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) {
      sum[c][r] = hsum(acc[c][r]);
      for (int64_t t = i; t < k; t++) sum[c][r] += static_cast<float>(qr[c][t]) * xf[r * kp + t];
    }
#endif
  for (int c = 0; c < C; c++) {
    const float sc = from_bf16(scale[j + c * cs]);
    for (int r = 0; r < R; r++) y[r * n + j + c * cs] = to_bf16(sum[c][r] * sc);
  }
}

// Every matrix's columns in one parallel loop (ni_gemv::for_column_groups). xf, kp: as in `columns`.
template <int R>
void gemv_rows(const float* xf, int64_t kp, const Gemv& g) {
  for_column_groups<kCols<R>>(g, [&](int64_t m, int64_t j, int64_t cs, auto width) {
    columns<R, decltype(width)::value>(xf, kp, static_cast<const int8_t*>(g.w[m]), g.w_stride[m],
                                       static_cast<const uint16_t*>(g.scale[m]), g.y + g.off[m], g.ntot, g.k, j, cs);
  });
}

using Kernel = void (*)(const float*, int64_t, const Gemv&);
constexpr Kernel kKernels[] = {nullptr,       gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                               gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};
constexpr int64_t kMaxRows = 8;

}  // namespace

extern "C" {

// x [R, K] bf16, qs[m] [N_m, K] int8, scales[m] [N_m] bf16 (m < n_mats <= 4, the linears sharing x) -> *ret0 = new
// [R, N_0 + ... ] bf16 tensor, the matrices' results side by side. AOTI_TORCH_FAILURE on any other input (the
// generated wrapper turns that into a RuntimeError).
AOTITorchError aoti_torch_cpu_ni_gemv_int8_v4(AtenTensorHandle x, const AtenTensorHandle* qs, int64_t n_mats,
                                              const AtenTensorHandle* scales, int64_t n_scales,
                                              AtenTensorHandle* ret0) {
  Gemv g;
  if (!gemv_operands(x, qs, n_mats, scales, n_scales, aoti_torch_dtype_int8(), aoti_torch_dtype_bfloat16(), kMaxRows,
                     &g))
    return AOTI_TORCH_FAILURE;
  // The activations widened to fp32 once (R x K, a few KB), zero-padded to whole vectors.
  const int64_t kp = (g.k + kLanes - 1) / kLanes * kLanes;
  std::vector<float> xf(static_cast<size_t>(g.r * kp), 0.0f);
  for (int64_t i = 0; i < g.r; i++)
    for (int64_t t = 0; t < g.k; t++) xf[i * kp + t] = from_bf16(g.x[i * g.x_stride + t]);
  kKernels[g.r](xf.data(), kp, g);
  *ret0 = g.out;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
