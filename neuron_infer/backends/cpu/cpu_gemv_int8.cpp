// int8-weight GEMV/GEMM for linears on any number of input rows: y[R, N] = (x[R, K] @ q[N, K]^T) * scale[N], x bf16, q
// int8, scale bf16 (per output channel), the result rounded once to bf16 (round to nearest even).
//
// Called directly from AOTInductor-generated wrappers (a C shim); see neuron_infer/backends/cpu/kernels.py for the op,
// its PyTorch reference twin and how this file is built.
//
// Integer dot products on 16-bit activations. Each activation row is put on a power-of-two grid once per call:
//   xi[r] = round_half_even(x[r] * 2^-e[r]),  e[r] the smallest exponent with max|x[r]| * 2^-e[r] <= 32767
// and every product q * xi is summed exactly (int32 lanes, int64 totals): y = bf16(fp32(sum) * 2^e[r] * scale).
// A bf16 activation has an 8-bit significand, so every element within 2^8 of its row's largest is on the grid
// exactly; smaller ones move by at most 2^(e-1). The weight-only scheme's numerics stay those of
// dequantize-then-matmul up to that (the reference's own fp32 sums round too; tests/compile/test_cpu_gemv_int8.py
// models the kernel bit for bit and checks it against the reference). A row holding Inf or NaN gives NaN in every
// output. e is at least -120 (2^-e a normal float): a row whose largest magnitude is below 2^-106 is on the grid
// 2^-120, coarser than its own, and elements below 2^-121 read as 0 (magnitudes activations do not reach).
// Why not fp32: widening each weight to fp32 (vpmovsxbd + vcvtdq2ps) and one FMA per 16 products per row made a
// 4-row step compute-bound and slower than the bf16 kernel's on AVX512-BF16 CPUs; here one widening (vpmovsxbw)
// serves all rows and each row costs one instruction per 32 (AVX-512) or two per 16 (AVX2) products.
// Not 8-bit activations (vpdpbusd): that is the w8a8 scheme (cpu_gemv_w8a8.cpp), an error of up to 1/254 of the
// row's largest per element.
// Rows: 1-8 (decode, batched decode, verification) in one pass over the weights (gemv_rows); 9 to kGemmMaxRows
// (prefill) in blocks of kBlockRows inside each thread's column groups (gemm_rows): a group's C weight rows are read
// from memory once and serve every block from L1, so a prompt computes int8 x int16 dot
// products at the instruction's rate instead of widening every weight to bf16 for a GEMM. Up to kGemmMaxRows each
// output is the same integer sum whatever the row count, so a row's result does not depend on the rows computed
// with it. Past it (long prompts; AVX512-BF16 builds only, see kGemmMaxRows), widened_mm: the weights widened once
// per call and ATen's GEMM, faster there.
//
// Dot products, by the instruction set the library is built for:
//   AVX512-VNNI  vpdpwssd: 32 int16 products summed pairwise into 16 int32 lanes per instruction.
//   AVX-512 BW   vpmaddwd + vpaddd, the same products in two instructions.
//   AVX-VNNI     vpdpwssd at 256 bits (VEX-encoded): 16 products per instruction, on CPUs without AVX-512.
//   AVX2         vpmaddwd + vpaddd at 256 bits: 16 products.
// No int32 lane overflows: a lane sums at most kChunk / kLanes = 512 products of |q| <= 128 and |xi| <= 32767
// before the lanes are added into int64 totals (once per row up to K = 8192 with AVX-512, 4096 with AVX2).
#include "cpu_gemv_common.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
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

#if defined(__AVX512BW__)
constexpr int64_t kStep = 32;   // weights per dot step
constexpr int64_t kLanes = 16;  // int32 accumulator lanes
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec wload(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline IVec wload_tail(const int8_t* p, int64_t n) {  // n < kStep weights, zeros beyond
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(static_cast<__mmask32>((1u << n) - 1), p));
}
inline IVec xload(const int16_t* p) { return _mm512_loadu_si512(p); }
#if defined(__AVX512VNNI__)
// The accumulator tied to the destination: with the intrinsic (_mm512_dpwssd_epi32) GCC 12 copies every accumulator
// each step and, at 7 rows x 3 columns, spills them to the stack.
inline IVec dot(IVec acc, IVec x, IVec w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
#else
inline IVec dot(IVec acc, IVec x, IVec w) { return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w)); }
#endif
inline int64_t ihsum(IVec v) {  // in int64: the lanes' total may exceed int32
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                   _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
#else
constexpr int64_t kStep = 16;
constexpr int64_t kLanes = 8;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec wload(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
inline IVec wload_tail(const int8_t* p, int64_t n) {
  alignas(16) int8_t block[kStep] = {};
  std::memcpy(block, p, static_cast<size_t>(n));
  return wload(block);
}
inline IVec xload(const int16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
#if defined(__AVXVNNI__)
// The VEX encoding (AVX-VNNI: Alder Lake, Zen 5): without {vex} the assembler picks the AVX512-VNNI (EVEX) form.
inline IVec dot(IVec acc, IVec x, IVec w) {
  asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w));
  return acc;
}
#else
inline IVec dot(IVec acc, IVec x, IVec w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
#endif
inline int64_t ihsum(IVec v) {  // in int64: the lanes' total may exceed int32
  alignas(32) int32_t lanes[kLanes];
  _mm256_store_si256((__m256i*)lanes, v);
  int64_t sum = 0;
  for (int32_t l : lanes) sum += l;
  return sum;
}
#endif

constexpr int32_t kGridMax = 32767;  // largest |xi|
constexpr int64_t kChunk = 512 * kLanes;  // weights per int32 accumulation: 512 * 128 * 32767 < 2^31

// Weight rows (output columns) per pass: each activation vector loaded feeds C dot products, and a thread reads C
// sequential weight streams. C x R accumulators next to C weight vectors within the vector registers (AVX-512: 32,
// AVX2: 16).
#if defined(__AVX512BW__)
template <int R>
constexpr int kCols = R <= 5 ? 4 : 3;
#else
template <int R>
constexpr int kCols = R <= 2 ? 4 : R <= 6 ? 2 : 1;
#endif

// One group, columns j, j + cs, ..., j + (C - 1) cs for R rows: out[r * rs + c * cs_out] = bf16(fp32(xi[r] .
// q[j + c cs]) * xs[r] * scale[j + c cs]) (see ni_gemv::for_column_groups). xi: R int16 rows of kp (a multiple of
// kStep; any values beyond k); xs: the rows' grid steps 2^e (NaN for a row holding Inf or NaN); q rows `qs` apart.
template <int R, int C>
void group(const int16_t* xi, int64_t kp, const float* xs, const int8_t* q, int64_t qs, const uint16_t* scale,
           int64_t k, int64_t j, int64_t cs, uint16_t* out, int64_t rs, int64_t cs_out) {
  const int8_t* qr[C];
  for (int c = 0; c < C; c++) qr[c] = q + (j + c * cs) * qs;
  int64_t total[C][R] = {};
  const int64_t kv = k / kStep * kStep;
  for (int64_t i0 = 0; i0 < k; i0 += kChunk) {  // runs of kChunk weights, each summed in int32 lanes
    IVec acc[C][R];
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) acc[c][r] = izero();
    auto step = [&](const IVec* w, int64_t i) {
      for (int r = 0; r < R; r++) {
        const IVec x = xload(xi + r * kp + i);
        for (int c = 0; c < C; c++) acc[c][r] = dot(acc[c][r], x, w[c]);
      }
    };
    const int64_t end = kv - i0 < kChunk ? kv : i0 + kChunk;
    int64_t i = i0;
    for (; i < end; i += kStep) {
      if (i % 64 == 0)  // once per 64-byte line of each stream
        ni_gemv::prefetch_ahead<C>(qr, i);
      IVec w[C];
      for (int c = 0; c < C; c++) w[c] = wload(qr[c] + i);
      step(w, i);
    }
    if (i == kv && kv < k && kv < i0 + kChunk) {  // the K tail: zero weights past k
      IVec w[C];
      for (int c = 0; c < C; c++) w[c] = wload_tail(qr[c] + i, k - i);
      step(w, i);
    }
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) total[c][r] += ihsum(acc[c][r]);
  }
  for (int c = 0; c < C; c++) {
    const float sc = from_bf16(scale[j + c * cs]);
    for (int r = 0; r < R; r++)
      out[r * rs + c * cs_out] = to_bf16(static_cast<float>(total[c][r]) * xs[r] * sc);
  }
}

// Every matrix's columns in one parallel loop (ni_gemv::for_column_groups). xi, kp, xs: as in `group`.
template <int R>
void gemv_rows(const int16_t* xi, int64_t kp, const float* xs, const Gemv& g) {
  for_column_groups<kCols<R>, R>(g, [&](int64_t m, auto width, int64_t j, int64_t cs, uint16_t* out, int64_t rs,
                                       int64_t cs_out) {
    group<R, decltype(width)::value>(xi, kp, xs, static_cast<const int8_t*>(g.w[m]), g.w_stride[m],
                                      static_cast<const uint16_t*>(g.scale[m]), g.k, j, cs, out, rs, cs_out);
  });
}

using Kernel = void (*)(const int16_t*, int64_t, const float*, const Gemv&);
constexpr Kernel kKernels[] = {nullptr,       gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                               gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};
constexpr int64_t kMaxRows = 8;  // rows gemv_rows takes; more go to gemm_rows

// The GEMM's register block: kBlockRows rows x kGemmCols columns of accumulators (AVX-512: 8 x 3 = 24 of 32 vector
// registers, AVX2: 6 x 2 = 12 of 16).
#if defined(__AVX512BW__)
constexpr int kBlockRows = 8;
#else
constexpr int kBlockRows = 6;
#endif
constexpr int kGemmCols = kCols<kBlockRows>;

using Block = void (*)(const int16_t*, int64_t, const float*, const int8_t*, int64_t, const uint16_t*, int64_t,
                       int64_t, int64_t, uint16_t*, int64_t, int64_t);
template <int C>
constexpr Block kBlocks[] = {nullptr, group<1, C>, group<2, C>, group<3, C>, group<4, C>,
                             group<5, C>, group<6, C>, group<7, C>, group<8, C>};

// kMaxRows < R <= ni_gemv::kGemmMaxRows rows, in blocks of at most kBlockRows rows per column group
// (ni_gemv::for_row_blocks; the rows' int16 grids, at most 64 x K x 2 bytes, stay in L2).
void gemm_rows(const int16_t* xi, int64_t kp, const float* xs, const Gemv& g) {
  constexpr int C = kGemmCols;
  ni_gemv::for_row_blocks<C, kBlockRows>(g, [&](int64_t m, bool wide, int64_t, int64_t r0, int64_t rows, int64_t j,
                                                int64_t cs) {
    (wide ? kBlocks<C> : kBlocks<1>)[rows](xi + r0 * kp, kp, xs + r0, static_cast<const int8_t*>(g.w[m]),
                                           g.w_stride[m], static_cast<const uint16_t*>(g.scale[m]), g.k, j, cs,
                                           g.y + r0 * g.ntot + g.off[m] + j, g.ntot, cs);
  });
}

// The grid step's exponent for a row of largest magnitude `peak` (finite): the smallest e >= -120 (2^-e stays a
// normal float) with peak * 2^-e <= kGridMax.
int grid_exponent(float peak) {
  int p = 0;
  std::frexp(peak, &p);  // peak < 2^p
  int e = p - 16 > -120 ? p - 16 : -120;
  while (std::ldexp(peak, -e) > static_cast<float>(kGridMax)) e++;
  return e;
}

#if defined(__AVX512F__)
float row_peak(const uint16_t* x, int64_t k) {  // max |x| (NaN if any is NaN)
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t t = 0; t < k; t += 16) {
    const __m512 v = ni_gemv::load_bf16x16(x + t, ni_gemv::first_lanes(k - t));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(vmax);
}

void to_grid(const uint16_t* x, int64_t k, float down, int16_t* out) {  // out = round_half_even(x * down)
  const __m512 vd = _mm512_set1_ps(down);
  for (int64_t t = 0; t < k; t += 16) {
    const __mmask16 m = ni_gemv::first_lanes(k - t);
    const __m512 v = _mm512_mul_ps(ni_gemv::load_bf16x16(x + t, m), vd);  // exact
    _mm512_mask_cvtepi32_storeu_epi16(out + t, m, _mm512_cvtps_epi32(v));     // MXCSR: nearest even
  }
}
#else
float row_peak(const uint16_t* x, int64_t k) {  // max |x| (NaN if any is NaN)
  const int64_t kv = k / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t t = 0; t < kv; t += 8) {
    const __m256 v = ni_gemv::load_bf16x8(x + t);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float peak = 0.0f;
  for (float l : lanes) peak = std::fmax(peak, l);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = kv; t < k; t++) {
    any_nan |= std::isnan(from_bf16(x[t]));
    peak = std::fmax(peak, std::fabs(from_bf16(x[t])));
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : peak;
}

void to_grid(const uint16_t* x, int64_t k, float down, int16_t* out) {  // out = round_half_even(x * down)
  const int64_t kv = k / 8 * 8;
  const __m256 vd = _mm256_set1_ps(down);
  for (int64_t t = 0; t < kv; t += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(ni_gemv::load_bf16x8(x + t), vd));  // MXCSR: nearest even
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storeu_si128((__m128i*)(out + t), packed);  // |values| <= 32767: no saturation
  }
  for (int64_t t = kv; t < k; t++) out[t] = static_cast<int16_t>(std::nearbyint(from_bf16(x[t]) * down));
}
#endif

// One row on its grid: out[t] = round_half_even(x[t] * 2^-e) for t < k -> the grid step 2^e, or NaN when the row
// holds Inf or NaN (out: zeros).
float quantize_row(const uint16_t* x, int64_t k, int16_t* out) {
  const float peak = row_peak(x, k);
  if (!std::isfinite(peak)) {
    std::memset(out, 0, static_cast<size_t>(k) * sizeof(int16_t));
    return std::numeric_limits<float>::quiet_NaN();
  }
  const int e = grid_exponent(peak);
  to_grid(x, k, std::ldexp(1.0f, -e), out);  // exact scaling: x * 2^-e rounds only below the grid
  return std::ldexp(1.0f, e);
}

// More than ni_gemv::kGemmMaxRows rows: each matrix widened to bf16 (exact: |q| <= 128) and multiplied by ATen's
// GEMM, then each output times its column's scale and rounded again: y = bf16(bf16(x @ q^T) * scale), the int8
// module's own forward (quant/int8.py), where the GEMM's packed bf16 weights beat gemm_rows.
bool widened_mm(AtenTensorHandle x, const Gemv& g) {
  AtenTensorHandle wide[ni_gemv::kMaxMats] = {};
  bool ok = true;
  for (int64_t m = 0; m < g.mats && ok; m++) {
    const int64_t sizes[2] = {g.n[m], g.k};
    void* data = nullptr;
    ok = ni_gemv::new_bf16_tensor(2, sizes, &wide[m], &data);
    if (!ok) break;
    const int8_t* q = static_cast<const int8_t*>(g.w[m]);
    uint16_t* w = static_cast<uint16_t*>(data);
#pragma omp parallel for
    for (int64_t n = 0; n < g.n[m]; n++)
      for (int64_t i = 0; i < g.k; i++) w[n * g.k + i] = to_bf16(static_cast<float>(q[n * g.w_stride[m] + i]));
  }
  ok = ok && ni_gemv::aten_mm(x, wide, g);
  for (AtenTensorHandle t : wide)
    if (t != nullptr) aoti_torch_delete_tensor_object(t);
  if (!ok) return false;
#pragma omp parallel for
  for (int64_t r = 0; r < g.r; r++)
    for (int64_t m = 0; m < g.mats; m++) {
      const uint16_t* sc = static_cast<const uint16_t*>(g.scale[m]);
      uint16_t* y = g.y + r * g.ntot + g.off[m];
      for (int64_t n = 0; n < g.n[m]; n++) y[n] = to_bf16(from_bf16(y[n]) * from_bf16(sc[n]));
    }
  return true;
}

}  // namespace

extern "C" {

// x [R, K] bf16 (any R >= 1), qs[m] [N_m, K] int8, scales[m] [N_m] bf16 (m < n_mats <= 4, the linears sharing x) ->
// *ret0 = new [R, N_0 + ... ] bf16 tensor, the matrices' results side by side. AOTI_TORCH_FAILURE on any other input
// (the generated wrapper turns that into a RuntimeError).
AOTITorchError aoti_torch_cpu_ni_gemv_int8_v6(AtenTensorHandle x, const AtenTensorHandle* qs, int64_t n_mats,
                                              const AtenTensorHandle* scales, int64_t n_scales,
                                              AtenTensorHandle* ret0) {
  Gemv g;
  if (!gemv_operands(x, qs, n_mats, scales, n_scales, aoti_torch_dtype_int8(), aoti_torch_dtype_bfloat16(),
                     std::numeric_limits<int64_t>::max(), &g))
    return AOTI_TORCH_FAILURE;
  if (g.r > ni_gemv::kGemmMaxRows) {
    if (widened_mm(x, g)) {
      *ret0 = g.out;
      return AOTI_TORCH_SUCCESS;
    }
    aoti_torch_delete_tensor_object(g.out);
    return AOTI_TORCH_FAILURE;
  }
  // The activations on their grids once per call, for every matrix (R x K int16s), in rows of whole steps: the
  // values past K only meet the K tail's zero weights.
  const int64_t kp = (g.k + kStep - 1) / kStep * kStep;
  int16_t* xi = ni_gemv::scratch<int16_t>(static_cast<size_t>(g.r * kp));
  float* xs = ni_gemv::scratch<float, 3>(static_cast<size_t>(g.r));
#pragma omp parallel for if (g.r > kMaxRows)
  for (int64_t i = 0; i < g.r; i++) xs[i] = quantize_row(g.x + i * g.x_stride, g.k, xi + i * kp);
  if (g.r <= kMaxRows)
    kKernels[g.r](xi, kp, xs, g);
  else
    gemm_rows(xi, kp, xs, g);
  *ret0 = g.out;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
