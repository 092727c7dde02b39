// bf16 GEMV/GEMM for linears on any number of input rows: y[R, N] = x[R, K] @ w[N, K]^T, fp32 accumulation, the
// result rounded once to bf16 (round to nearest even, like Tensor.to(torch.bfloat16)). 1-8 rows (decode steps,
// batched steps, speculative verification): gemv_rows, below. Up to ni_gemv::kGemmMaxRows (short prompts):
// gemm_rows, the same accumulators in blocks of rows inside each thread's column groups, so each group's weight rows
// are read from memory once and serve every block from L1. Past it, ATen's GEMM (ni_gemv::aten_mm), faster there;
// kGemmMaxRows is 64 with AVX512-BF16 only: below that level ATen's bf16 GEMM is slower than the blocks at any count.
//
// Called directly from AOTInductor-generated wrappers (a "C shim": aot_inductor.custom_ops_to_c_shims); see
// neuron_infer/backends/cpu/kernels.py for the op's definition, its PyTorch reference twin and how this file is built.
//
// Why: decode streams every weight once per step. Each weight row is loaded once for all R input rows, every row's
// accumulators stay in registers, and the threads split the output columns: one OpenMP loop per call, over the
// columns of every matrix passed (the linears sharing an input, e.g. q/k/v), each thread storing its results in
// runs of consecutive outputs (ni_gemv::for_column_groups).
// Two paths, picked by the compiler flags (cpu_gemv.py builds one per ISA level), one loop structure: several weight
// rows (C output columns) share each pass over the activations, so one activation load feeds C products; the C rows
// are read as C sequential streams, prefetched ahead; one accumulator per (column, row).
// * AVX512-BF16 (-mavx512bf16): one dot-product instruction (vdpbf16ps: 32 bf16 products summed pairwise into 16
//   fp32 lanes) per 64-byte weight load and row, on the activations as they are. vdpbf16ps flushes denormal
//   inputs/results to zero (irrelevant at these magnitudes; the tests compare with the reference). C by R as
//   measured fastest (kColsBf16).
// * AVX-512F without BF16, and AVX2 + FMA (any other level): 32 (AVX-512) or 16 (AVX2) weights per 64- or 32-byte
//   load are widened to fp32 by a 16-bit shift (even elements) and a mask (odd elements) - exact, no shuffles - and
//   fused-multiply-added with the activations, which are widened once per call into the same even/odd order
//   (zero-padded to whole blocks). With AVX2's 16 registers C is 4 up to 2 input rows, 2 up to 5, 1 beyond; with
//   AVX-512's 32, 4 up to 5 input rows and 3 up to 8. Products of two bf16 values are exact in fp32, so the result
//   differs from the reference only in the order of the fp32 sums.
// The K tail of a weight row (and, on the dot-product path, of each activation row) goes through a zero-padded copy,
// so no load reads past a row.
#include "cpu_gemv_common.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using ni_gemv::for_column_groups;
using ni_gemv::from_bf16;
using ni_gemv::Gemv;
using ni_gemv::gemv_operands;
using ni_gemv::to_bf16;

// The vector type of each path. V::kBlock bf16 weights per load; the AVX512-BF16 path takes them as they are, the
// widening paths widen them into two fp32 vectors of kBlock / 2 lanes (even, odd elements; a bf16 is the top half
// of an fp32).
#if defined(__AVX512F__)
struct V512 {
  using F = __m512;
  static constexpr int64_t kBlock = 32;  // 64-byte loads
  static F zero() { return _mm512_setzero_ps(); }
};
#endif

#ifdef __AVX512BF16__
// Weight rows (output columns) per pass over the activations, by R: the C timed fastest for each on a Zen 5 EPYC
// (C x R accumulators next to C weight vectors; docs/cpu-backend.md).
constexpr int kColsBf16[] = {0, 4, 3, 2, 5, 5, 4, 4, 3};
template <int R>
constexpr int kCols = kColsBf16[R];
struct V : V512 {
  using I = __m512bh;
  static I load_w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
};
#elif defined(__AVX512F__)
// Weight rows (output columns) per pass over the activations, with 32 registers: 4 for 1-5 rows, 3 for 6-8 (C x R
// accumulators next to C weight vectors).
template <int R>
constexpr int kCols = R <= 5 ? 4 : 3;
struct V : V512 {
  using I = __m512i;
  static I load_w(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static F lo(I v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static F hi(I v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
struct V {
  using F = __m256;
  using I = __m256i;
  static constexpr int64_t kBlock = 16;  // 32-byte loads
  static I load_w(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F lo(I v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static F hi(I v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F zero() { return _mm256_setzero_ps(); }
};
// Weight rows (output columns) per pass over the activations: every activation vector loaded is used by C rows, and
// the C rows are C sequential streams through memory (see gemv_rows). With 16 registers: 4 for 1-2 rows, 2 for 3-5
// rows; from 6 rows on C x R accumulators would not fit next to the weights.
template <int R>
constexpr int kCols = R <= 2 ? 4 : R <= 5 ? 2 : 1;
#endif
constexpr int64_t kBlock = V::kBlock;
constexpr int64_t kMaxRows = 8;  // input rows per call (kKernels)

// The dot-product path's loops over columns and rows fully unrolled (measured faster there at 6-8 rows; on the
// widening paths slower at 8 rows, so not there).
#ifdef __AVX512BF16__
#define NI_UNROLL _Pragma("GCC unroll 32")
#else
#define NI_UNROLL
#endif

template <int C>
inline void prefetch(const uint16_t* const (&wr)[C], int64_t wi) {
  if (wi % 32 == 0)  // once per 64-byte line of each stream
    ni_gemv::prefetch_ahead<C>(wr, wi);
}

// One accumulator per (weight row, activation row), block after block (within a block: AVX512-BF16, one vdpbf16ps;
// the widening paths, the even products, then the odd ones). Every row's sum is thus formed in one order whatever R
// and C are, so a row's result does not depend on the other rows of the call: a speculative verify over K+1 rows
// computes, bit for bit, what K+1 one-row decode steps compute (docs/cpu-backend.md, "Batch invariance"). The C x R
// independent chains still outrun the memory's read rate at R = 1 (C = 4 chains: measured, ibid.).
#ifdef __AVX512BF16__
// The activations as they are: R bf16 rows `xs` apart (the K tail: a zero-padded copy, see columns).
struct Act {
  const uint16_t* x;
  int64_t xs;
};

// One kBlock-weight block (wr[c] + wi) of C weight rows times the activations' block at xi into acc[c][r].
template <int R, int C>
inline void step(const uint16_t* const (&wr)[C], int64_t wi, const Act& a, int64_t xi, V::F (&acc)[C][R]) {
  V::I wv[C];
  prefetch<C>(wr, wi);
  NI_UNROLL
  for (int c = 0; c < C; c++) {
    wv[c] = V::load_w(wr[c] + wi);
    asm("" : "+v"(wv[c]));  // one load per weight vector (not one memory operand per product)
  }
  NI_UNROLL
  for (int r = 0; r < R; r++) {
    __m512bh x = (__m512bh)_mm512_loadu_si512(a.x + r * a.xs + xi);
    if (C > 1) asm("" : "+v"(x));  // one load for all C columns (not one memory operand per product)
    NI_UNROLL
    for (int c = 0; c < C; c++) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], wv[c], x);
  }
}

// The activations' K tail [i, k) of each row, zero-padded to one block.
struct ActTail {
  alignas(64) uint16_t x[kMaxRows][kBlock];
  Act at(const Act& a, int R, int64_t i, int64_t k) {
    std::memset(x, 0, sizeof(x));
    for (int r = 0; r < R; r++) std::memcpy(x[r], a.x + r * a.xs + i, static_cast<size_t>(k - i) * sizeof(uint16_t));
    return Act{&x[0][0], kBlock};
  }
  static int64_t offset(int64_t) { return 0; }  // the block's place in the copy
};
#else
// The activations widened (see widen_rows), zero-padded to whole blocks.
struct Act {
  const float* xf;
};

// One kBlock-weight block (wr[c] + wi) of C weight rows times the activations' block at xi into acc[c][r]: the even
// elements, then the odd ones.
template <int R, int C>
inline void step(const uint16_t* const (&wr)[C], int64_t wi, const Act& a, int64_t xi, V::F (&acc)[C][R]) {
  V::I wv[C];
  const float* xb = a.xf + xi * R;
  prefetch<C>(wr, wi);
  for (int c = 0; c < C; c++) wv[c] = V::load_w(wr[c] + wi);
  for (int r = 0; r < R; r++) {
    V::F x = V::load(xb + r * kBlock);
    if (C > 1) asm("" : "+v"(x));  // one load for all C columns (not one memory operand per FMA)
    for (int c = 0; c < C; c++) acc[c][r] = V::fma(V::lo(wv[c]), x, acc[c][r]);
  }
  for (int r = 0; r < R; r++) {
    V::F x = V::load(xb + r * kBlock + kBlock / 2);
    if (C > 1) asm("" : "+v"(x));
    for (int c = 0; c < C; c++) acc[c][r] = V::fma(V::hi(wv[c]), x, acc[c][r]);
  }
}

struct ActTail {  // widen_rows already zero-pads
  Act at(const Act& a, int, int64_t, int64_t) { return a; }
  static int64_t offset(int64_t i) { return i; }
};
#endif

// The accumulators of columns j, j + cs, ..., j + (C - 1) cs for R rows: the lanes of acc[c][r] sum to
// x[r] . w[j + c cs].
template <int R, int C>
inline void accumulate(const Act& a, const uint16_t* w, int64_t ws, int64_t k, int64_t j, int64_t cs,
                       V::F (&acc)[C][R]) {
  const int64_t kb = k / kBlock * kBlock;
  const uint16_t* wr[C];
  NI_UNROLL
  for (int c = 0; c < C; c++) wr[c] = w + (j + c * cs) * ws;
  NI_UNROLL
  for (int c = 0; c < C; c++)
    NI_UNROLL
    for (int r = 0; r < R; r++) acc[c][r] = V::zero();
  int64_t i = 0;
  for (; i < kb; i += kBlock) step<R, C>(wr, i, a, i, acc);
  if (i < k) {  // the K tail through zero-padded copies
    alignas(64) uint16_t tail[C][kBlock] = {};
    const uint16_t* tr[C];
    NI_UNROLL
    for (int c = 0; c < C; c++) {
      std::memcpy(tail[c], wr[c] + i, static_cast<size_t>(k - i) * sizeof(uint16_t));
      tr[c] = tail[c];
    }
    ActTail xt;
    step<R, C>(tr, 0, xt.at(a, R, i, k), ActTail::offset(i), acc);
  }
}

#if defined(__AVX512BW__)
// 16 fp32 -> 16 bf16, as ni_gemv::to_bf16 (round to nearest even; a NaN stays a quiet NaN).
inline __m256i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
  const __m512i even = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, even), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
}

// One group's results from its accumulators into out[r * rs + c * cs_out] (with AVX-512 its row of the stage, result
// s = r * C + c at out[s]: ni_gemv::for_column_groups).
template <int R, int C>
inline void finish(const V::F (&acc)[C][R], uint16_t* out, int64_t, int64_t) {
  constexpr int S = C * R;  // result s = r * C + c
  __m512 lo[16], hi[16];
  NI_UNROLL
  for (int s = 0; s < 16; s++) {
    lo[s] = s < S ? acc[s % C][s / C] : _mm512_setzero_ps();
    hi[s] = s + 16 < S ? acc[(s + 16) % C][(s + 16) / C] : _mm512_setzero_ps();
  }
  const __m256i l = to_bf16x16(ni_gemv::sums16(lo));
  const __m256i h = S > 16 ? to_bf16x16(ni_gemv::sums16(hi)) : _mm256_setzero_si256();
  _mm512_store_si512(out, _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1));
}
#else
// The 8 lanes of each of 4 vectors summed: {sum v0, sum v1, sum v2, sum v3}.
inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One group's results from its accumulators into out[r * rs + c * cs_out], 4 per horizontal reduction.
template <int R, int C>
inline void finish(const V::F (&acc)[C][R], uint16_t* out, int64_t rs, int64_t cs_out) {
  constexpr int S = C * R, S4 = (S + 3) / 4 * 4;
  __m256 v[S4];
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) v[r * C + c] = acc[c][r];
  for (int s = S; s < S4; s++) v[s] = _mm256_setzero_ps();
  alignas(16) float sums[S4];
  for (int s = 0; s < S4; s += 4) _mm_store_ps(sums + s, hsum4(v[s], v[s + 1], v[s + 2], v[s + 3]));
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) out[r * rs + c * cs_out] = to_bf16(sums[r * C + c]);
}
#endif

// Every matrix's columns in one parallel loop (ni_gemv::for_column_groups): a group's C columns are C runs of
// consecutive weight rows, C sequential streams for the hardware prefetchers (adjacent rows in one group would make
// C short interleaved streams per group: measured slower once the weights come from DRAM).
template <int R>
void gemv_rows(const Act& a, const Gemv& g) {
  for_column_groups<kCols<R>, R>(g, [&](int64_t m, auto width, int64_t j, int64_t cs, uint16_t* out, int64_t rs,
                                       int64_t cs_out) {
    constexpr int C = decltype(width)::value;
    V::F acc[C][R];
    accumulate<R, C>(a, static_cast<const uint16_t*>(g.w[m]), g.w_stride[m], g.k, j, cs, acc);
    finish<R, C>(acc, out, rs, cs_out);
  });
}

using Kernel = void (*)(const Act&, const Gemv&);
constexpr Kernel kKernels[] = {nullptr,       gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                               gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};

// The GEMM's register block: kBlockRows rows x kGemmCols weight rows of accumulators (AVX-512: 8 x 3 = 24 of 32
// vector registers; AVX2: 5 x 2 = 10 of 16).
#if defined(__AVX512F__)
constexpr int kBlockRows = 8;
#else
constexpr int kBlockRows = 5;
#endif
constexpr int kGemmCols = kCols<kBlockRows>;

// One group's results straight into y: out[r * rs + c * cs_out] (finish's AVX-512 form writes a stage row).
template <int R, int C>
inline void finish_to(const V::F (&acc)[C][R], uint16_t* out, int64_t rs, int64_t cs_out) {
#if defined(__AVX512BW__)
  alignas(64) uint16_t stage[32];
  finish<R, C>(acc, stage, 0, 0);
  for (int s = 0; s < C * R; s++) out[s / C * rs + s % C * cs_out] = stage[s];
#else
  finish<R, C>(acc, out, rs, cs_out);
#endif
}

// R rows (a block) times the C weight rows j, j + cs, ... of matrix m, into y at out (rows g.ntot apart).
template <int R, int C>
void block(const Act& a, const Gemv& g, int64_t m, int64_t j, int64_t cs, uint16_t* out) {
  V::F acc[C][R];
  accumulate<R, C>(a, static_cast<const uint16_t*>(g.w[m]), g.w_stride[m], g.k, j, cs, acc);
  finish_to<R, C>(acc, out, g.ntot, cs);
}

using Block = void (*)(const Act&, const Gemv&, int64_t, int64_t, int64_t, uint16_t*);
template <int C, int... R>
constexpr std::array<Block, sizeof...(R) + 1> blocks_of(std::integer_sequence<int, R...>) {
  return {nullptr, block<R + 1, C>...};
}
template <int C>
constexpr auto kBlocks = blocks_of<C>(std::make_integer_sequence<int, kBlockRows>{});

// kMaxRows < R <= ni_gemv::kGemmMaxRows rows, in blocks of at most kBlockRows rows per column group
// (ni_gemv::for_row_blocks). acts[b]: block b's activations.
void gemm_rows(const std::vector<Act>& acts, const Gemv& g) {
  constexpr int C = kGemmCols;
  ni_gemv::for_row_blocks<C, kBlockRows>(g, [&](int64_t m, bool wide, int64_t b, int64_t r0, int64_t rows, int64_t j,
                                                int64_t cs) {
    (wide ? kBlocks<C> : kBlocks<1>)[rows](acts[b], g, m, j, cs, g.y + r0 * g.ntot + g.off[m] + j);
  });
}

#ifdef __AVX512BF16__
void run(const Gemv& g) {
  if (g.r <= kMaxRows) return kKernels[g.r](Act{g.x, g.x_stride}, g);
  const int64_t n = ni_gemv::row_blocks(g.r, kBlockRows);
  std::vector<Act> acts;
  for (int64_t b = 0; b < n; b++)
    acts.push_back(Act{g.x + ni_gemv::row_block_start(g.r, n, b) * g.x_stride, g.x_stride});
  gemm_rows(acts, g);
}
#else
// x [R, K] bf16 rows `xs` apart -> fp32 blocks of kBlock, block-major: block b of row r at (b R + r) kBlock (one
// pointer and constant offsets reach every row's block), each as its even then its odd elements; zero beyond k up to
// whole blocks.
std::vector<float> widen_rows(const uint16_t* x, int64_t xs, int64_t r, int64_t k) {
  std::vector<float> xf(static_cast<size_t>(r * ((k + kBlock - 1) / kBlock * kBlock)), 0.0f);
  for (int64_t row = 0; row < r; row++)
    for (int64_t t = 0; t < k; t++)
      xf[(t / kBlock * r + row) * kBlock + (t % 2) * (kBlock / 2) + t % kBlock / 2] = from_bf16(x[row * xs + t]);
  return xf;
}

void run(const Gemv& g) {
  if (g.r <= kMaxRows) {
    const std::vector<float> xf = widen_rows(g.x, g.x_stride, g.r, g.k);  // R x K floats, a few KB, once per call
    return kKernels[g.r](Act{xf.data()}, g);
  }
  const int64_t n = ni_gemv::row_blocks(g.r, kBlockRows);  // each block widened on its own (block-major in it)
  std::vector<std::vector<float>> xf(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; b++) {
    const int64_t r0 = ni_gemv::row_block_start(g.r, n, b);
    xf[b] = widen_rows(g.x + r0 * g.x_stride, g.x_stride, ni_gemv::row_block_start(g.r, n, b + 1) - r0, g.k);
  }
  std::vector<Act> acts;
  for (const auto& v : xf) acts.push_back(Act{v.data()});
  gemm_rows(acts, g);
}
#endif

}  // namespace

extern "C" {

// x [R, K] bf16 (any R >= 1), ws[m] [N_m, K] bf16 (m < n_mats <= 4, the linears sharing x) -> *ret0 = new [R, N_0 + ...
// ] bf16 tensor, the matrices' results side by side. AOTI_TORCH_FAILURE on any other input (the generated wrapper turns
// that into a RuntimeError).
AOTITorchError aoti_torch_cpu_ni_gemv_bf16_v8(AtenTensorHandle x, const AtenTensorHandle* ws, int64_t n_mats,
                                              AtenTensorHandle* ret0) {
  Gemv g;
  const int32_t bf16 = aoti_torch_dtype_bfloat16();
  if (!gemv_operands(x, ws, n_mats, nullptr, 0, bf16, bf16, std::numeric_limits<int64_t>::max(), &g))
    return AOTI_TORCH_FAILURE;
  if (g.r <= ni_gemv::kGemmMaxRows) {
    run(g);
  } else if (!ni_gemv::aten_mm(x, ws, g)) {
    aoti_torch_delete_tensor_object(g.out);
    return AOTI_TORCH_FAILURE;
  }
  *ret0 = g.out;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
