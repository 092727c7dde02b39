// Helpers shared by the CPU GEMV kernels (cpu_gemv.cpp, cpu_gemv_int8.cpp, cpu_gemv_w8a8.cpp): bf16 conversions and
// the checks and allocation at the C-shim boundary.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>
#include <cstring>

namespace ni_gemv {

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

// A CPU tensor of `dims` dims and dtype `dtype`, unit stride in its last dim -> sizes, leading stride and data.
inline bool view(AtenTensorHandle t, int64_t dims, int32_t dtype, int64_t** sizes, int64_t* lead_stride,
                 void** data) {
  int64_t dim = 0, *strides = nullptr;
  int32_t dt = 0, device = 0;
  if (aoti_torch_get_dim(t, &dim) || dim != dims || aoti_torch_get_dtype(t, &dt) || dt != dtype ||
      aoti_torch_get_device_type(t, &device) || device != aoti_torch_device_type_cpu() ||
      aoti_torch_get_sizes(t, sizes) || aoti_torch_get_strides(t, &strides) || aoti_torch_get_data_ptr(t, data))
    return false;
  *lead_stride = strides[0];
  return strides[dims - 1] == 1 || (*sizes)[dims - 1] == 1;
}

// A new contiguous [rows, cols] bf16 CPU tensor -> *out and its data; false (nothing left allocated) on failure.
inline bool new_bf16_matrix(int64_t rows, int64_t cols, AtenTensorHandle* out, void** data) {
  const int64_t sizes[2] = {rows, cols}, strides[2] = {cols, 1};
  if (aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_bfloat16(), aoti_torch_device_type_cpu(), 0, out))
    return false;
  if (aoti_torch_get_data_ptr(*out, data)) {
    aoti_torch_delete_tensor_object(*out);
    return false;
  }
  return true;
}

// The operands of a quantized GEMV: x [R, K] bf16 (1 <= R <= max_rows), q [N, K] int8, scale [N] of `scale_dtype`,
// each with unit stride in its last dim, plus a new [R, N] bf16 result. false (nothing allocated) on any other input.
struct QuantGemv {
  int64_t r = 0, k = 0, n = 0, x_stride = 0, q_stride = 0;
  const uint16_t* x = nullptr;
  const int8_t* q = nullptr;
  const void* scale = nullptr;
  uint16_t* y = nullptr;
  AtenTensorHandle out = nullptr;
};

inline bool quant_gemv_operands(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle scale, int32_t scale_dtype,
                                int64_t max_rows, QuantGemv* g) {
  int64_t *xsz = nullptr, *qsz = nullptr, *ssz = nullptr, ss = 0;
  void *xd = nullptr, *qd = nullptr, *sd = nullptr, *yd = nullptr;
  if (!view(x, 2, aoti_torch_dtype_bfloat16(), &xsz, &g->x_stride, &xd) ||
      !view(q, 2, aoti_torch_dtype_int8(), &qsz, &g->q_stride, &qd) || !view(scale, 1, scale_dtype, &ssz, &ss, &sd))
    return false;
  g->r = xsz[0], g->k = xsz[1], g->n = qsz[0];
  if (qsz[1] != g->k || ssz[0] != g->n || g->r < 1 || g->r > max_rows || g->k < 1) return false;
  if (!new_bf16_matrix(g->r, g->n, &g->out, &yd)) return false;
  g->x = static_cast<const uint16_t*>(xd), g->q = static_cast<const int8_t*>(qd), g->scale = sd;
  g->y = static_cast<uint16_t*>(yd);
  return true;
}

}  // namespace ni_gemv
