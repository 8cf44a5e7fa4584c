// Host launcher of the experts' backward kernels for Hopper (sm_90a): TMA tensor maps of the
// operands and one launch. Includes only CUDA and csrc/ headers, so it compiles without torch.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "api.h"
#include "common/launch.cuh"
#include "common/tensor_map.h"
#include "layer/sm90_bwd.cuh"

namespace mok {

int launch_swiglu_bwd(const SwigluBwdLaunch& l, int grid, void* stream_ptr) {
  const int64_t H = l.hidden, I = l.inter, L = l.num_experts;
  if (l.rows <= 0 || H <= 0 || H % OperandBf16::kTileK != 0 || I <= 0 || I % 128 != 0 ||
      L < 1 || L > kBwdMaxExperts || grid < 1 || l.rows > INT32_MAX / 2 ||
      L * 2 * I > INT32_MAX || L * H > INT32_MAX)
    return static_cast<int>(cudaErrorInvalidValue);
  SwigluBwdKernelArgs k{};
  constexpr int kK = OperandBf16::kTileK;
  if (!encode_bf16_map(&k.map_a, l.a, l.rows, H, kTileM, kK) ||
      !encode_bf16_map(&k.map_dy, l.dy, l.rows, H, kTileM, kK) ||
      !encode_bf16_map(&k.map_w, l.w_gate_up, L * 2 * I, H, 128, kK) ||
      !encode_bf16_map(&k.map_wd, l.w_down, L * H, I, kK, 64))
    return static_cast<int>(cudaErrorInvalidValue);
  k.ends = l.ends;
  k.row_w = l.row_w;
  k.hw = static_cast<uint16_t*>(l.hw);
  k.dgu = static_cast<uint16_t*>(l.dgu);
  k.part = l.part;
  k.rows = static_cast<int>(l.rows);
  k.hidden = static_cast<int>(H);
  k.inter = static_cast<int>(I);
  k.num_experts = static_cast<int>(L);
  cudaError_t e =
      cudaFuncSetAttribute(swiglu_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBwdSmem);
  if (e != cudaSuccess) return finish_launch(e);
  swiglu_bwd_kernel<<<grid, kLayerThreads, kBwdSmem, static_cast<cudaStream_t>(stream_ptr)>>>(k);
  return finish_launch(cudaGetLastError());
}

}  // namespace mok
