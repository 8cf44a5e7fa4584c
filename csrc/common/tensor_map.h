// TMA tensor maps of row-major bf16 and fp32 matrices (host side), shared by the layer
// launchers.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace mok {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }
  return fn;
}

// Row-major [rows, cols] of elem_bytes elements in boxes of box_rows x box_cols, box_cols x
// elem_bytes = the swizzle's span (128 bytes unless given), zeros past the last row on loads,
// nothing written past it on stores.
inline bool encode_map(CUtensorMap* map, CUtensorMapDataType type, int64_t elem_bytes,
                       const void* base, int64_t rows, int64_t cols, int box_rows, int box_cols,
                       CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  const auto fn = tensor_map_encoder();
  if (fn == nullptr || base == nullptr || rows <= 0) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = fn(map, type, 2, const_cast<void*>(base), dims,
                        strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}
inline bool encode_bf16_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                            int box_rows, int box_cols,
                            CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows, cols, box_rows,
                    box_cols, swizzle);
}
// Row-major fp32, boxes of box_cols x 4 bytes (32 columns: the 128-byte swizzle span).
inline bool encode_f32_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                           int box_rows, int box_cols) {
  return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, rows, cols, box_rows,
                    box_cols);
}

}  // namespace mok
