// Helpers shared by the CPU kernels (cpu_gemv.cpp, cpu_gemv_int8.cpp, cpu_gemv_w8a8.cpp, cpu_attention.cpp): bf16
// conversions, the operand checks and result allocation at the C-shim boundary, and the GEMVs' one parallel loop over
// the column groups of every matrix of a call.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace ni_gemv {

// How far ahead of its reads each GEMV weight stream is prefetched. With the hardware prefetcher alone a thread
// reading several weight streams stayed well below the memory's read rate (docs/cpu-backend.md, "Alternatives
// measured slower"); 1 KB ahead kept too few lines in flight for the multi-row steps, which stalled on their weight
// loads, and farther ahead than 2 KB was no faster.
constexpr int64_t kPrefetchBytes = 2048;

// Each of C weight streams prefetched kPrefetchBytes past its element i (call once per 64-byte line of the streams).
template <int C, typename T>
inline void prefetch_ahead(const T* const (&streams)[C], int64_t i) {
  for (int c = 0; c < C; c++)
    _mm_prefetch(reinterpret_cast<const char*>(streams[c] + i) + kPrefetchBytes, _MM_HINT_T0);
}

// Scratch memory of at least n Ts owned by the calling thread and kept across calls (contents undefined): a decode
// step calls the kernels ~150 times, and a fresh zero-filled std::vector per call (malloc, memset, free) was a
// visible share of its serial time. Tag tells apart buffers of one type a thread holds at once.
template <typename T, int Tag = 0>
inline std::vector<T>& scratch_vector() {
  thread_local std::vector<T> buf;
  return buf;
}

template <typename T, int Tag = 0>
inline T* scratch(size_t n) {
  std::vector<T>& buf = scratch_vector<T, Tag>();
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// bf16 -> fp32 vector loads (exact: a bf16 is the top half of an fp32), for the kernels that quantize activations.
#if defined(__AVX512F__)
inline __mmask16 first_lanes(int64_t n) {  // lanes 0..n-1 of 16 (all for n >= 16)
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {  // lanes outside m: 0 (not read)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// Lane i of the result: the sum of the lanes of a[i], in the order of a one-vector reduction to 8 lanes (lane e
// plus lane e + 8) and then adjacent pairs, pairs of pairs and the two halves (a transpose-and-add tree: 15 adds
// for 16 sums). Every sum is thus formed in one order, whatever a[i]'s neighbours are. The GEMV kernel's results and
// the attention kernel's scores (16 keys' dot products at once).
inline __m512 sums16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; i++)  // b[i]: lanes 0-7 a[2i]'s lane e + lane e + 8, lanes 8-15 the same of a[2i + 1]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
  for (int i = 0; i < 4; i++)  // adjacent pairs
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; i++)  // pairs of pairs
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xdd));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), e);
}
#elif defined(__AVX2__)
inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// fp32 -> bf16, round to nearest even (Tensor.to(torch.bfloat16)); NaN stays a quiet NaN.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A CPU tensor of `dims` dims and dtype `dtype`, unit stride in its last dim -> sizes, strides and data.
inline bool view_nd(AtenTensorHandle t, int64_t dims, int32_t dtype, int64_t** sizes, int64_t** strides,
                    void** data) {
  int64_t dim = 0;
  int32_t dt = 0, device = 0;
  if (aoti_torch_get_dim(t, &dim) || dim != dims || aoti_torch_get_dtype(t, &dt) || dt != dtype ||
      aoti_torch_get_device_type(t, &device) || device != aoti_torch_device_type_cpu() ||
      aoti_torch_get_sizes(t, sizes) || aoti_torch_get_strides(t, strides) || aoti_torch_get_data_ptr(t, data))
    return false;
  return (*strides)[dims - 1] == 1 || (*sizes)[dims - 1] == 1;
}

// The same, with only the leading dim's stride.
inline bool view(AtenTensorHandle t, int64_t dims, int32_t dtype, int64_t** sizes, int64_t* lead_stride,
                 void** data) {
  int64_t* strides = nullptr;
  if (!view_nd(t, dims, dtype, sizes, &strides, data)) return false;
  *lead_stride = strides[0];
  return true;
}

// A new contiguous bf16 CPU tensor of `dims` dims -> *out and its data; false (nothing left allocated) on failure.
inline bool new_bf16_tensor(int64_t dims, const int64_t* sizes, AtenTensorHandle* out, void** data) {
  int64_t strides[8];
  if (dims < 1 || dims > 8) return false;
  strides[dims - 1] = 1;
  for (int64_t i = dims - 1; i > 0; i--) strides[i - 1] = strides[i] * sizes[i];
  if (aoti_torch_empty_strided(dims, sizes, strides, aoti_torch_dtype_bfloat16(), aoti_torch_device_type_cpu(), 0,
                               out))
    return false;
  if (aoti_torch_get_data_ptr(*out, data)) {
    aoti_torch_delete_tensor_object(*out);
    return false;
  }
  return true;
}

// A new contiguous [rows, cols] bf16 CPU tensor -> *out and its data; false (nothing left allocated) on failure.
inline bool new_bf16_matrix(int64_t rows, int64_t cols, AtenTensorHandle* out, void** data) {
  const int64_t sizes[2] = {rows, cols};
  return new_bf16_tensor(2, sizes, out, data);
}

// The operands of a GEMV of several weight matrices sharing one input (q/k/v, gate/up): x [R, K] bf16
// (1 <= R <= max_rows), ws[m] [N_m, K] of `w_dtype` and, for quantized kernels, scales[m] [N_m] of `scale_dtype`,
// each with unit stride in its last dim, plus a new [R, N_0 + ... + N_{M-1}] bf16 result (matrix m's columns from
// off[m]). Up to kMaxMats matrices.
constexpr int64_t kMaxMats = 4;

struct Gemv {
  int64_t r = 0, k = 0, x_stride = 0, mats = 0, ntot = 0;
  const uint16_t* x = nullptr;
  const void* w[kMaxMats] = {};
  const void* scale[kMaxMats] = {};
  int64_t w_stride[kMaxMats] = {}, n[kMaxMats] = {}, off[kMaxMats] = {};
  uint16_t* y = nullptr;
  AtenTensorHandle out = nullptr;
};

// false (nothing allocated) on any other input. scales: nullptr for an unscaled (bf16) GEMV.
inline bool gemv_operands(AtenTensorHandle x, const AtenTensorHandle* ws, int64_t mats, const AtenTensorHandle* scales,
                          int64_t scale_count, int32_t w_dtype, int32_t scale_dtype, int64_t max_rows, Gemv* g) {
  int64_t* xsz = nullptr;
  void* xd = nullptr;
  if (mats < 1 || mats > kMaxMats || (scales != nullptr && scale_count != mats) ||
      !view(x, 2, aoti_torch_dtype_bfloat16(), &xsz, &g->x_stride, &xd))
    return false;
  g->r = xsz[0], g->k = xsz[1], g->mats = mats, g->x = static_cast<const uint16_t*>(xd);
  if (g->r < 1 || g->r > max_rows || g->k < 1) return false;
  for (int64_t m = 0; m < mats; m++) {
    int64_t *wsz = nullptr, *ssz = nullptr, ss = 0;
    void *wd = nullptr, *sd = nullptr;
    if (!view(ws[m], 2, w_dtype, &wsz, &g->w_stride[m], &wd) || wsz[1] != g->k) return false;
    if (scales != nullptr && (!view(scales[m], 1, scale_dtype, &ssz, &ss, &sd) || ssz[0] != wsz[0])) return false;
    g->w[m] = wd, g->scale[m] = sd, g->n[m] = wsz[0], g->off[m] = g->ntot;
    g->ntot += wsz[0];
  }
  void* yd = nullptr;
  if (!new_bf16_matrix(g->r, g->ntot, &g->out, &yd)) return false;
  g->y = static_cast<uint16_t*>(yd);
  return true;
}

// Rows past which ATen's GEMM (oneDNN, packed bf16 weights) beats the kernels' own blocks (gemm_rows): measured with
// the SmolLM2 prefill graph at one and two threads (docs/cpu-backend.md, "Prefill linears"). Only on CPUs with
// AVX512-BF16 is ATen's bf16 GEMM that fast; below that level (oneDNN widening bf16 to fp32 with AVX-512, ATen's own
// dot-product loops with AVX2) it is several times slower than the blocks, so they take every row count.
#ifdef __AVX512BF16__
constexpr int64_t kGemmMaxRows = 64;
#else
constexpr int64_t kGemmMaxRows = std::numeric_limits<int64_t>::max();
#endif

// y[:, off_m : off_m + N_m] = x @ ws[m]^T for every matrix of g, through ATen's mm_out on views: ws[m] [N_m, K] bf16
// with unit stride in K, read as w^T by swapping its strides (_reinterpret_tensor adds its offset argument to the
// tensor's own storage offset: the looped layer stack's weights are views of stacked ones).
inline bool aten_mm(AtenTensorHandle x, const AtenTensorHandle* ws, const Gemv& g) {
  for (int64_t m = 0; m < g.mats; m++) {
    const int64_t wsz[2] = {g.k, g.n[m]}, wst[2] = {1, g.w_stride[m]};
    const int64_t ysz[2] = {g.r, g.n[m]}, yst[2] = {g.ntot, 1};
    AtenTensorHandle wt = nullptr, ym = nullptr;
    const bool ok = !aoti_torch__reinterpret_tensor(ws[m], 2, wsz, wst, 0, &wt) &&
                    !aoti_torch__reinterpret_tensor(g.out, 2, ysz, yst, g.off[m], &ym) &&
                    !aoti_torch_cpu_mm_out(ym, x, wt);
    if (wt != nullptr) aoti_torch_delete_tensor_object(wt);
    if (ym != nullptr) aoti_torch_delete_tensor_object(ym);
    if (!ok) return false;
  }
  return true;
}

#if defined(__AVX512BW__)
// The results of a run of `count` <= 16 consecutive column groups j0, j0 + 1, ... (see for_column_groups) written to
// y: stage[b][s] is group b's result s = r * C + c (row r, the group's column c; s < S <= 32), bound for
// y[r * n + j0 + b + c * cs]. Per pair of results, one gather across the groups and two masked stores of `count`
// consecutive outputs.
template <int C>
inline void store_runs(const uint16_t (&stage)[16][32], int S, uint16_t* y, int64_t n, int64_t j0, int64_t cs,
                       int64_t count) {
  const __m512i rows = _mm512_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960);
  // words 0, 2, ..., 30 then 1, 3, ..., 31: a gathered pair's first results, then its second
  const __m512i apart = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000a0008, 0x000e000c, 0x00120010, 0x00160014,
                                          0x001a0018, 0x001e001c, 0x00030001, 0x00070005, 0x000b0009, 0x000f000d,
                                          0x00130011, 0x00170015, 0x001b0019, 0x001f001d);
  const __mmask16 run = static_cast<__mmask16>((1u << count) - 1);
  for (int s = 0; s < S; s += 2) {
    const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), run, rows, &stage[0][s], 1);
    const __m512i split = _mm512_permutexvar_epi16(apart, pairs);
    _mm256_mask_storeu_epi16(y + s / C * n + j0 + s % C * cs, run, _mm512_castsi512_si256(split));
    if (s + 1 < S)
      _mm256_mask_storeu_epi16(y + (s + 1) / C * n + j0 + (s + 1) % C * cs, run, _mm512_extracti64x4_epi64(split, 1));
  }
}
constexpr int kGroupRun = 16;  // consecutive column groups whose results are stored together (for_column_groups)
#else
constexpr int kGroupRun = 1;
#endif

// One OpenMP parallel region over the column groups of every matrix (one per call, whatever the matrix count):
// matrix m of n columns has h = n / C groups of C columns j, j + h, ..., j + (C - 1) h - a thread's share reads C
// runs of consecutive weight rows, C sequential streams - and its n % C last columns are groups of one. Each thread
// takes a contiguous share of the groups (the split of schedule(static)) and calls
//     group(m, width, j, cs, out, rs, cs_out)
// per group: width C (a std::integral_constant) with cs = h, or 1 (a last column) with cs = 0; the group writes its
// result for row r (of R) and its column c to out[r * rs + c * cs_out]. With AVX-512 the groups of a run of up to
// kGroupRun consecutive ones write into a stage, one 32-word row each (out = the row, rs = width, cs_out = 1), and
// store_runs moves the run's results to y, consecutive groups' results being consecutive outputs, instead of each
// group writing C x R two-byte stores to as many cache lines of y (rows apart, and h columns apart), which made a
// step of several rows cost far more than a one-row step streaming the same weights (docs/cpu-backend.md, "Results
// stored in runs"). Without AVX-512 the groups write into y directly (out = y + j, rs = its row stride, cs_out = cs).
template <int C, int R, class F>
void for_column_groups(const Gemv& g, F&& group) {
  int64_t first[kMaxMats + 1] = {0};
  for (int64_t m = 0; m < g.mats; m++) first[m + 1] = first[m] + g.n[m] / C + g.n[m] % C;
  const int64_t total = first[g.mats];
  auto run = [&](int64_t m, auto width, int64_t j0, int64_t cs, int64_t count) {
    constexpr int W = decltype(width)::value;
    uint16_t* y = g.y + g.off[m];
#if defined(__AVX512BW__)
    static_assert(W * R <= 32, "a group's results fit one row of the stage");
    alignas(64) uint16_t stage[kGroupRun][32];
    for (int64_t b = 0; b < count; b++) group(m, width, j0 + b, cs, stage[b], int64_t{W}, int64_t{1});
    store_runs<W>(stage, W * R, y, g.ntot, j0, cs, count);
#else
    for (int64_t b = 0; b < count; b++) group(m, width, j0 + b, cs, y + j0 + b, g.ntot, cs);
#endif
  };
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t end = total * (tid + 1) / nt;
    for (int64_t t = total * tid / nt; t < end;) {
      int64_t m = 0;
      while (t >= first[m + 1]) m++;
      const int64_t i = t - first[m], h = g.n[m] / C;
      if (i < h) {
        const int64_t count = std::min<int64_t>(kGroupRun, std::min(h - i, end - t));
        run(m, std::integral_constant<int, C>{}, i, h, count);
        t += count;
      } else {
        run(m, std::integral_constant<int, 1>{}, C * h + (i - h), int64_t{0}, int64_t{1});
        t++;
      }
    }
  }
}

// The kernels' GEMM loop (more than 8 rows), for blocks of at most B rows: r rows make row_blocks(r, B) blocks, block
// b being rows [row_block_start(r, n, b), row_block_start(r, n, b + 1)) (sizes differing by at most one).
inline int64_t row_blocks(int64_t r, int64_t b) { return (r + b - 1) / b; }
inline int64_t row_block_start(int64_t r, int64_t n, int64_t b) { return r * b / n; }

// The groups of every matrix (C columns j, j + h, ..., j + (C - 1) h, and the n % C last columns alone, as in
// for_column_groups) split evenly between the threads; each thread runs its groups in order and, per group, every
// block of rows, calling
//     block(m, wide, b, r0, rows, j, cs)      wide: a group of C columns (cs = h), else one column (cs = 0)
// so a group's weight rows are read from memory once and serve every block of rows from L1. The block writes its
// results to y directly (rows g.ntot apart).
template <int C, int B, class F>
void for_row_blocks(const Gemv& g, F&& block) {
  int64_t first[kMaxMats + 1] = {0};
  for (int64_t m = 0; m < g.mats; m++) first[m + 1] = first[m] + g.n[m] / C + g.n[m] % C;
  const int64_t total = first[g.mats], blocks = row_blocks(g.r, B);
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t end = total * (tid + 1) / nt;
    for (int64_t t = total * tid / nt; t < end; t++) {
      int64_t m = 0;
      while (t >= first[m + 1]) m++;
      const int64_t i = t - first[m], h = g.n[m] / C;
      const bool wide = i < h;
      const int64_t j = wide ? i : C * h + (i - h), cs = wide ? h : 0;
      for (int64_t b = 0; b < blocks; b++) {
        const int64_t r0 = row_block_start(g.r, blocks, b);
        block(m, wide, b, r0, row_block_start(g.r, blocks, b + 1) - r0, j, cs);
      }
    }
  }
}

}  // namespace ni_gemv
