// bf16 GEMV for linears with 1-5 input rows (decode steps): y[R, N] = x[R, K] @ w[N, K]^T, fp32 accumulation,
// the result rounded once to bf16 (round to nearest even, like Tensor.to(torch.bfloat16)).
//
// Called directly from AOTInductor-generated wrappers (a "C shim": aot_inductor.custom_ops_to_c_shims); see
// neuron_infer/compile/cpu_gemv.py for the op's definition, its PyTorch reference twin and how this file is built.
//
// Why: batch-1 decode streams every weight once per token. The inner loop here is one AVX512-BF16 dot-product
// instruction (vdpbf16ps: 32 bf16 products summed pairwise into 16 fp32 lanes) per 64-byte weight load, two
// independent accumulators per row, so a core keeps more weight loads in flight than Inductor's generated loop
// (bf16 -> fp32 convert + FMA per 16 weights). Products of two bf16 values are exact in fp32; vdpbf16ps flushes
// denormal inputs/results to zero (irrelevant at these magnitudes; the tests compare with the reference).
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

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
constexpr Kernel kKernels[] = {nullptr, gemv_rows<1>, gemv_rows<2>, gemv_rows<3>, gemv_rows<4>, gemv_rows<5>};
constexpr int64_t kMaxRows = 5;

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
AOTITorchError aoti_torch_cpu_ni_gemv_bf16_v1(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
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
  kKernels[r](static_cast<const uint16_t*>(xd), xs, static_cast<const uint16_t*>(wd), ws, static_cast<uint16_t*>(yd),
              n, k);
  *ret0 = y;
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
