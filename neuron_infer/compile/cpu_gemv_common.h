// Helpers shared by the CPU kernels (cpu_gemv.cpp, cpu_gemv_int8.cpp, cpu_gemv_w8a8.cpp, cpu_attention.cpp): bf16
// conversions, the operand checks and result allocation at the C-shim boundary, and the GEMVs' one parallel loop over
// the column groups of every matrix of a call.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace ni_gemv {

// How far ahead of its reads each GEMV weight stream is prefetched. With the hardware prefetcher alone a thread
// reading several weight streams stayed well below the memory's read rate (docs/cpu-backend.md, "Alternatives
// measured slower"); 1 KB ahead kept too few lines in flight for the multi-row steps (on an AVX512-BF16 EPYC the
// 8-layer bf16 7-token step took 1.2x the time, the int8 one-row step 1.1x; 1-4 KB timed, docs/performance.md).
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

// One OpenMP loop over the column groups of every matrix (one parallel region per call, whatever the matrix
// count): matrix m of n columns has h = n / C groups of C columns j, j + h, ..., j + (C - 1) h - a thread's share
// reads C runs of consecutive weight rows, C sequential streams - and its n % C last columns are groups of one.
// Calls f(m, j, cs, std::integral_constant<int, width>) for each group (width C, or 1 with cs = 0).
template <int C, class F>
void for_column_groups(const Gemv& g, F&& f) {
  int64_t first[kMaxMats + 1] = {0};
  for (int64_t m = 0; m < g.mats; m++) first[m + 1] = first[m] + g.n[m] / C + g.n[m] % C;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < first[g.mats]; t++) {
    int64_t m = 0;
    while (t >= first[m + 1]) m++;
    const int64_t i = t - first[m], h = g.n[m] / C;
    if (i < h)
      f(m, i, h, std::integral_constant<int, C>{});
    else
      f(m, C * h + (i - h), int64_t{0}, std::integral_constant<int, 1>{});
  }
}

}  // namespace ni_gemv
