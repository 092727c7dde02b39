// bf16 GEMV for linears with 1-8 input rows (decode steps, batched steps, speculative verification):
// y[R, N] = x[R, K] @ w[N, K]^T, fp32 accumulation, the result rounded once to bf16 (round to nearest even, like
// Tensor.to(torch.bfloat16)).
//
// Called directly from AOTInductor-generated wrappers (a "C shim": aot_inductor.custom_ops_to_c_shims); see
// neuron_infer/compile/cpu_gemv.py for the op's definition, its PyTorch reference twin and how this file is built.
//
// Why: decode streams every weight once per step. Each weight row is loaded once for all R input rows, every row's
// accumulators stay in registers, and the threads split the output columns (one OpenMP loop per matrix).
// Two paths, picked by the compiler flags (cpu_gemv.py builds one per ISA level):
// * AVX512-BF16 (-mavx512bf16): one dot-product instruction (vdpbf16ps: 32 bf16 products summed pairwise into 16
//   fp32 lanes) per 64-byte weight load, two independent accumulators per row. vdpbf16ps flushes denormal
//   inputs/results to zero (irrelevant at these magnitudes; the tests compare with the reference).
// * AVX2 + FMA (any other level): 16 weights per 32-byte load are widened to fp32 by a 16-bit shift (even elements)
//   and a mask (odd elements) - exact, no shuffles - and fused-multiply-added with the activations, which are
//   widened once per call into the same even/odd order (zero-padded to whole 16-element blocks). The K tail of a
//   weight row goes through a zero-padded copy, so no load reads past a row. Products of two bf16 values are exact
//   in fp32, so the result differs from the reference only in the order of the fp32 sums.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#ifdef __AVX512BF16__
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh_tail(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// x rows are `xs` elements apart, y rows `n`; weights rows `ws` apart. R input rows share each weight load.
template <int R>
void gemv_rows(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, uint16_t* y, int64_t n, int64_t k) {
  const int64_t k64 = k / 64 * 64, k32 = k / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (k - k32)) - 1);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; j++) {
    const uint16_t* wr = w + j * ws;
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < k64; i += 64) {
      const __m512bh w0 = load_bh(wr + i), w1 = load_bh(wr + i + 32);
      for (int r = 0; r < R; r++) {
        a0[r] = _mm512_dpbf16_ps(a0[r], w0, load_bh(x + r * xs + i));
        a1[r] = _mm512_dpbf16_ps(a1[r], w1, load_bh(x + r * xs + i + 32));
      }
    }
    if (i < k32) {
      const __m512bh w0 = load_bh(wr + i);
      for (int r = 0; r < R; r++) a0[r] = _mm512_dpbf16_ps(a0[r], w0, load_bh(x + r * xs + i));
      i += 32;
    }
    if (tail) {
      const __m512bh w0 = load_bh_tail(wr + i, tail);
      for (int r = 0; r < R; r++) a1[r] = _mm512_dpbf16_ps(a1[r], w0, load_bh_tail(x + r * xs + i, tail));
    }
    for (int r = 0; r < R; r++) y[r * n + j] = to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])));
  }
}

using Kernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
constexpr Kernel kKernels[] = {nullptr,       gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                               gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};

void run(int64_t r, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, uint16_t* y, int64_t n, int64_t k) {
  kKernels[r](x, xs, w, ws, y, n, k);
}

#else
inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

constexpr int64_t kBlock = 16;  // bf16 weights per 32-byte load: two fp32 vectors (even, odd elements)

// 16 bf16 values -> their even (lo) and odd (hi) elements as fp32: a bf16 is the top half of an fp32.
inline void widen(__m256i v, __m256* lo, __m256* hi) {
  *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Accumulators per row: enough independent FMA chains for the FMA latency, few enough for 16 ymm registers.
template <int R>
constexpr int kAcc = R <= 2 ? 4 : R <= 6 ? 2 : 1;

// One 16-weight block into row r's accumulators: the even elements into acc[a0], the odd ones into acc[a1].
template <int R>
inline void step(__m256i wv, const float* xf, int64_t kp, int64_t i, __m256 (*acc)[kAcc<R>], int a0, int a1) {
  __m256 lo, hi;
  widen(wv, &lo, &hi);
  for (int r = 0; r < R; r++) {
    acc[r][a0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xf + r * kp + i), acc[r][a0]);
    acc[r][a1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xf + r * kp + i + 8), acc[r][a1]);
  }
}

// xf: R rows of kp floats (the widened activations in even/odd order per block, kp = k rounded up to whole blocks,
// zero beyond k); weight rows `ws` apart; y rows `n` apart.
template <int R>
void gemv_rows(const float* xf, int64_t kp, const uint16_t* w, int64_t ws, uint16_t* y, int64_t n, int64_t k) {
  constexpr int A = kAcc<R>;
  const int64_t kb = k / kBlock * kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; j++) {
    const uint16_t* wr = w + j * ws;
    __m256 acc[R][A];
    for (int r = 0; r < R; r++)
      for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
    int64_t i = 0;
    if constexpr (A == 4) {
      for (; i + 2 * kBlock <= kb; i += 2 * kBlock) {
        step<R>(_mm256_loadu_si256((const __m256i*)(wr + i)), xf, kp, i, acc, 0, 1);
        step<R>(_mm256_loadu_si256((const __m256i*)(wr + i + kBlock)), xf, kp, i + kBlock, acc, 2, 3);
      }
    }
    for (; i < kb; i += kBlock) step<R>(_mm256_loadu_si256((const __m256i*)(wr + i)), xf, kp, i, acc, 0, A - 1);
    if (i < k) {  // the K tail through a zero-padded copy (xf is zero there too)
      alignas(32) uint16_t tail[kBlock] = {};
      std::memcpy(tail, wr + i, static_cast<size_t>(k - i) * sizeof(uint16_t));
      step<R>(_mm256_load_si256((const __m256i*)tail), xf, kp, i, acc, 0, A - 1);
    }
    for (int r = 0; r < R; r++) {
      __m256 s = acc[r][0];
      for (int a = 1; a < A; a++) s = _mm256_add_ps(s, acc[r][a]);
      y[r * n + j] = to_bf16(hsum(s));
    }
  }
}

using Kernel = void (*)(const float*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);

// x [R, K] bf16 rows `xs` apart -> R rows of kp floats, each 16-element block as its even then its odd elements.
std::vector<float> widen_rows(const uint16_t* x, int64_t xs, int64_t r, int64_t k, int64_t kp) {
  std::vector<float> xf(static_cast<size_t>(r * kp), 0.0f);
  for (int64_t row = 0; row < r; row++)
    for (int64_t t = 0; t < k; t++)
      xf[row * kp + t / kBlock * kBlock + (t % 2) * 8 + t % kBlock / 2] = from_bf16(x[row * xs + t]);
  return xf;
}

constexpr Kernel kKernels[] = {nullptr,       gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>,
                               gemv_rows<5>, gemv_rows<6>, gemv_rows<7>, gemv_rows<8>};

void run(int64_t r, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, uint16_t* y, int64_t n, int64_t k) {
  const int64_t kp = (k + kBlock - 1) / kBlock * kBlock;
  const std::vector<float> xf = widen_rows(x, xs, r, k, kp);  // R x kp floats, a few KB, once per call
  kKernels[r](xf.data(), kp, w, ws, y, n, k);
}
#endif

constexpr int64_t kMaxRows = 8;

// A 2-d bf16 CPU tensor with unit stride in its last dim -> sizes, row stride and data.
bool matrix(AtenTensorHandle t, int64_t* rows, int64_t* cols, int64_t* row_stride, void** data) {
  int64_t dim = 0, *sizes = nullptr, *strides = nullptr;
  int32_t dtype = 0, device = 0;
  if (aoti_torch_get_dim(t, &dim) || dim != 2 || aoti_torch_get_dtype(t, &dtype) ||
      dtype != aoti_torch_dtype_bfloat16() || aoti_torch_get_device_type(t, &device) ||
      device != aoti_torch_device_type_cpu() || aoti_torch_get_sizes(t, &sizes) ||
      aoti_torch_get_strides(t, &strides) || aoti_torch_get_data_ptr(t, data))
    return false;
  *rows = sizes[0], *cols = sizes[1], *row_stride = strides[0];
  return strides[1] == 1 || sizes[1] == 1;
}

}  // namespace

extern "C" {

// x [R, K] bf16, w [N, K] bf16 -> *ret0 = new [R, N] bf16 tensor. AOTI_TORCH_FAILURE on any other input
// (the generated wrapper turns that into a RuntimeError).
AOTITorchError aoti_torch_cpu_ni_gemv_bf16_v2(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  int64_t r = 0, k = 0, xs = 0, n = 0, kw = 0, ws = 0;
  void *xd = nullptr, *wd = nullptr, *yd = nullptr;
  if (!matrix(x, &r, &k, &xs, &xd) || !matrix(w, &n, &kw, &ws, &wd) || kw != k || r < 1 || r > kMaxRows)
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {r, n}, strides[2] = {n, 1};
  AtenTensorHandle y = nullptr;
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_bfloat16(), aoti_torch_device_type_cpu(), 0, &y))
    return AOTI_TORCH_FAILURE;
  if (aoti_torch_get_data_ptr(y, &yd)) {
    aoti_torch_delete_tensor_object(y);
    return AOTI_TORCH_FAILURE;
  }
  run(r, static_cast<const uint16_t*>(xd), xs, static_cast<const uint16_t*>(wd), ws, static_cast<uint16_t*>(yd), n, k);
  *ret0 = y;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
