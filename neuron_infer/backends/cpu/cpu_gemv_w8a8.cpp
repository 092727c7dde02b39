// W8A8 GEMV/GEMM for linears on any number of input rows (quant.smoothquant: int8 weights, int8 activations per
// token):
//   xq[r], s[r] = the row's int8 quantization (s = max|x_r| / 127, q = round_half_even(x / s), clamped to +-127)
//   y[r, n]     = bf16((float(xq[r] . q[n]) * s[r]) * scale[n])        x bf16 [R, K], q int8 [N, K], scale fp32 [N]
// The dot products are exact int32 sums and every float step is the reference's own (same operations, same
// order), so the result is bit-identical to quant.smoothquant.w8a8_matmul.
//
// Called directly from AOTInductor-generated wrappers (a C shim); see neuron_infer/backends/cpu/kernels.py for the op,
// its PyTorch twin and how this file is built.
//
// Dot products, by the instruction set the library is built for:
//   AVX512-VNNI  vpdpbusd: 64 int8 products per instruction. It multiplies unsigned by signed bytes, so the
//                activations are stored as xq + 128 (0..254) and 128 * sum(q[n]) is subtracted at the end; that
//                sum comes from the same pass (one more vpdpbusd per 64 weights, shared by all rows).
//   AVX-512 BW   weights widened to int16 (vpmovsxbw), vpmaddwd with int16 activations: 32 products per step.
//   AVX-VNNI     vpdpbusd at 256 bits (VEX-encoded, CPUs without AVX-512): 32 products per instruction, the same
//                bias compensation.
//   AVX2         weights widened to int16, vpmaddwd at 256 bits: 16 products per step.
// No sum can overflow int32 (|q|, |xq| <= 127; K < 2^17 even for the largest 4-product sums).
// Rows: 1-8 (decode, batched decode, verification) in one pass over the weights (gemv_rows); more (prefill) in blocks
// of kBlockRows inside each thread's column groups (gemm_rows), a group's weight rows read from memory once and
// serving every block from L1. The sums are exact, so every row's result is the reference's whatever the row count.
#include "cpu_gemv_common.h"

#include <immintrin.h>
#include <omp.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

using ni_gemv::for_column_groups;
using ni_gemv::from_bf16;
using ni_gemv::Gemv;
using ni_gemv::gemv_operands;
using ni_gemv::to_bf16;

// Vector width: 512 bits with AVX-512 BW, else 256.
#if defined(__AVX512BW__)
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec vload(const void* p) { return _mm512_loadu_si512(p); }
inline int32_t ihsum(IVec v) { return _mm512_reduce_add_epi32(v); }
#else
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec vload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline int32_t ihsum(IVec v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}
#endif

// The dot step. With VNNI (vpdpbusd) x holds the unsigned bytes xq + 128, w the signed ones, and the accumulator is
// tied to the destination through inline asm: with the intrinsic (_mm512_dpbusd_epi32) GCC 12 copies every
// accumulator each step and spills them at 6-8 rows. Without VNNI, weights widened to int16 and vpmaddwd.
#if defined(__AVX512VNNI__)
constexpr int64_t kStep = 64;  // weights per dot instruction
using Act = uint8_t;           // xq + 128
constexpr int32_t kActBias = 128;
inline IVec wload(const int8_t* p) { return vload(p); }
inline IVec act_bias() { return _mm512_set1_epi8(static_cast<char>(kActBias)); }
inline IVec dot(IVec acc, IVec x, IVec w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
#elif defined(__AVX512BW__)
constexpr int64_t kStep = 32;
using Act = int16_t;
constexpr int32_t kActBias = 0;
inline IVec wload(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline IVec dot(IVec acc, IVec x, IVec w) { return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w)); }
#elif defined(__AVXVNNI__)
constexpr int64_t kStep = 32;
using Act = uint8_t;  // xq + 128, as with AVX512-VNNI
constexpr int32_t kActBias = 128;
inline IVec wload(const int8_t* p) { return vload(p); }
inline IVec act_bias() { return _mm256_set1_epi8(static_cast<char>(kActBias)); }
// The VEX encoding: without {vex} the assembler picks the AVX512-VNNI (EVEX) form.
inline IVec dot(IVec acc, IVec x, IVec w) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w));
  return acc;
}
#else
constexpr int64_t kStep = 16;
using Act = int16_t;
constexpr int32_t kActBias = 0;
inline IVec wload(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
inline IVec dot(IVec acc, IVec x, IVec w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
#endif
inline IVec xload(const Act* p) { return vload(p); }

// Weight rows (output columns) per pass: each activation vector loaded feeds C dot products, and a thread reads C
// sequential weight streams. One accumulator per (column, row), plus the VNNI compensation per column, within the
// vector registers (AVX-512: 32, AVX2: 16).
#if defined(__AVX512F__)
template <int R>
constexpr int kCols = R <= 5 ? 4 : 2;
#elif defined(__AVXVNNI__)
template <int R>
constexpr int kCols = R <= 1 ? 4 : R <= 2 ? 3 : R <= 4 ? 2 : 1;
#else
template <int R>
constexpr int kCols = R <= 2 ? 4 : R <= 5 ? 2 : 1;
#endif

// One group: out[r * rs + c * cs_out] = y[r, j + c cs] for columns j, j + cs, ..., j + (C - 1) cs (see
// ni_gemv::for_column_groups). xa: R activation rows of kp Acts (kp a multiple of kStep; any values beyond k); xs:
// the rows' scales; q rows `qs` apart.
template <int R, int C>
void group(const Act* xa, int64_t kp, const float* xs, const int8_t* q, int64_t qs, const float* scale, int64_t k,
           int64_t j, int64_t cs, uint16_t* out, int64_t rs, int64_t cs_out) {
  const int8_t* qr[C];
  for (int c = 0; c < C; c++) qr[c] = q + (j + c * cs) * qs;
  IVec acc[C][R], comp[C];
  for (int c = 0; c < C; c++) {
    comp[c] = izero();
    for (int r = 0; r < R; r++) acc[c][r] = izero();
  }
  auto step = [&](const IVec* w, int64_t i) {
    for (int r = 0; r < R; r++) {
      const IVec x = xload(xa + r * kp + i);
      for (int c = 0; c < C; c++) acc[c][r] = dot(acc[c][r], x, w[c]);
    }
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    const IVec bias = act_bias();
    for (int c = 0; c < C; c++) comp[c] = dot(comp[c], bias, w[c]);
#endif
  };
  const int64_t kv = k / kStep * kStep;
  int64_t i = 0;
  for (; i < kv; i += kStep) {
    ni_gemv::prefetch_ahead<C>(qr, i);
    IVec w[C];
    for (int c = 0; c < C; c++) w[c] = wload(qr[c] + i);
    step(w, i);
  }
  if (i < k) {  // the K tail: weights copied into a zeroed block
    alignas(64) int8_t tail[C][kStep];
    IVec w[C];
    for (int c = 0; c < C; c++) {
      std::memset(tail[c], 0, kStep);
      std::memcpy(tail[c], qr[c] + i, static_cast<size_t>(k - i));
      w[c] = wload(tail[c]);
    }
    step(w, i);
  }
  for (int c = 0; c < C; c++) {
    const int32_t off = ihsum(comp[c]);
    const float sc = scale[j + c * cs];
    for (int r = 0; r < R; r++) {
      const float v = static_cast<float>(ihsum(acc[c][r]) - off) * xs[r];
      out[r * rs + c * cs_out] = to_bf16(v * sc);
    }
  }
}

// Every matrix's columns in one parallel loop (ni_gemv::for_column_groups). xa, kp, xs: as in `group`.
template <int R>
void gemv_rows(const Act* xa, int64_t kp, const float* xs, const Gemv& g) {
  for_column_groups<kCols<R>, R>(g, [&](int64_t m, auto width, int64_t j, int64_t cs, uint16_t* out, int64_t rs,
                                       int64_t cs_out) {
    group<R, decltype(width)::value>(xa, kp, xs, static_cast<const int8_t*>(g.w[m]), g.w_stride[m],
                                      static_cast<const float*>(g.scale[m]), g.k, j, cs, out, rs, cs_out);
  });
}

using Kernel = void (*)(const Act*, int64_t, const float*, const Gemv&);
constexpr Kernel kKernels[] = {nullptr,       gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                               gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};
constexpr int64_t kMaxRows = 8;  // rows gemv_rows takes; more go to gemm_rows

// The GEMM's register block: kBlockRows rows x kGemmCols weight rows (kCols at that row count).
#if defined(__AVX512F__)
constexpr int kBlockRows = 8;
#elif defined(__AVXVNNI__)
constexpr int kBlockRows = 4;
#else
constexpr int kBlockRows = 5;
#endif
constexpr int kGemmCols = kCols<kBlockRows>;

using Block = void (*)(const Act*, int64_t, const float*, const int8_t*, int64_t, const float*, int64_t, int64_t,
                       int64_t, uint16_t*, int64_t, int64_t);
template <int C>
constexpr Block kBlocks[] = {nullptr, group<1, C>, group<2, C>, group<3, C>, group<4, C>,
                             group<5, C>, group<6, C>, group<7, C>, group<8, C>};

// R > kMaxRows rows, in blocks of at most kBlockRows rows per column group (ni_gemv::for_row_blocks).
void gemm_rows(const Act* xa, int64_t kp, const float* xs, const Gemv& g) {
  constexpr int C = kGemmCols;
  ni_gemv::for_row_blocks<C, kBlockRows>(g, [&](int64_t m, bool wide, int64_t, int64_t r0, int64_t rows, int64_t j,
                                                int64_t cs) {
    (wide ? kBlocks<C> : kBlocks<1>)[rows](xa + r0 * kp, kp, xs + r0, static_cast<const int8_t*>(g.w[m]),
                                           g.w_stride[m], static_cast<const float*>(g.scale[m]), g.k, j, cs,
                                           g.y + r0 * g.ntot + g.off[m] + j, g.ntot, cs);
  });
}

// One row's per-token quantization, the reference's operations in fp32: s = max(max|x| / 127, FLT_MIN),
// q = clamp(round_half_even(x / s), -127, 127) (IEEE division, as torch's), stored as q + kActBias.
#if defined(__AVX512F__)
float quantize_row(const uint16_t* x, int64_t k, Act* out) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t t = 0; t < k; t += 16) {
    const __mmask16 m = ni_gemv::first_lanes(k - t);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(ni_gemv::load_bf16x16(x + t, m)));
  }
  const float s = std::fmax(_mm512_reduce_max_ps(vmax) / 127.0f, FLT_MIN);
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i bias = _mm512_set1_epi32(kActBias);
  for (int64_t t = 0; t < k; t += 16) {
    const __mmask16 m = ni_gemv::first_lanes(k - t);
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(ni_gemv::load_bf16x16(x + t, m), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi)), bias);
    if constexpr (sizeof(Act) == 1)
      _mm512_mask_cvtepi32_storeu_epi8(out + t, m, v);
    else
      _mm512_mask_cvtepi32_storeu_epi16(out + t, m, v);
  }
  return s;
}
#else
float quantize_row(const uint16_t* x, int64_t k, Act* out) {
  const int64_t kv = k / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t t = 0; t < kv; t += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, ni_gemv::load_bf16x8(x + t)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (int i = 0; i < 8; i++) amax = std::fmax(amax, lanes[i]);
  for (int64_t t = kv; t < k; t++) amax = std::fmax(amax, std::fabs(from_bf16(x[t])));
  const float s = std::fmax(amax / 127.0f, FLT_MIN);
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  alignas(32) int32_t q[8];
  for (int64_t t = 0; t < kv; t += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(ni_gemv::load_bf16x8(x + t), vs),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256((__m256i*)q, _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)));
    for (int i = 0; i < 8; i++) out[t + i] = static_cast<Act>(q[i] + kActBias);
  }
  for (int64_t t = kv; t < k; t++) {
    const float v = std::fmin(std::fmax(std::nearbyint(from_bf16(x[t]) / s), -127.0f), 127.0f);
    out[t] = static_cast<Act>(static_cast<int32_t>(v) + kActBias);
  }
  return s;
}
#endif

}  // namespace

extern "C" {

// x [R, K] bf16 (any R >= 1), qs[m] [N_m, K] int8, scales[m] [N_m] fp32 (m < n_mats <= 4, the linears sharing x) ->
// *ret0 = new [R, N_0 + ... ] bf16 tensor, the matrices' results side by side. AOTI_TORCH_FAILURE on any other input
// (the generated wrapper turns that into a RuntimeError).
AOTITorchError aoti_torch_cpu_ni_gemv_w8a8_v3(AtenTensorHandle x, const AtenTensorHandle* qs, int64_t n_mats,
                                              const AtenTensorHandle* scales, int64_t n_scales,
                                              AtenTensorHandle* ret0) {
  Gemv g;
  if (!gemv_operands(x, qs, n_mats, scales, n_scales, aoti_torch_dtype_int8(), aoti_torch_dtype_float32(),
                     std::numeric_limits<int64_t>::max(), &g))
    return AOTI_TORCH_FAILURE;
  // The activations quantized once per call, for every matrix (R x K bytes or int16s), in rows of whole steps: the
  // values past K only meet the K tail's zero weights (in the sums and in the VNNI compensation).
  const int64_t kp = (g.k + kStep - 1) / kStep * kStep;
  Act* xa = ni_gemv::scratch<Act>(static_cast<size_t>(g.r * kp));
  float* xs = ni_gemv::scratch<float, 3>(static_cast<size_t>(g.r));
#pragma omp parallel for if (g.r > kMaxRows)
  for (int64_t i = 0; i < g.r; i++) xs[i] = quantize_row(g.x + i * g.x_stride, g.k, xa + i * kp);
  if (g.r <= kMaxRows)
    kKernels[g.r](xa, kp, xs, g);
  else
    gemm_rows(xa, kp, xs, g);
  *ret0 = g.out;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
