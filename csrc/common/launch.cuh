// Host-side launch helpers shared by the launchers (cooperative launch, launch result).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace mok {

template <typename Kernel>
inline cudaError_t launch_cooperative(Kernel kernel, const Params& params, int grid, int threads,
                                      size_t smem, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  // NOTE: a cooperative launch guarantees that all blocks are co-resident, which the grid
  // barriers and the cross-block spin-waits rely on (a plain launch could deadlock until the
  // timeout when other work occupies the SMs).
  void* args[] = {const_cast<Params*>(&params)};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(grid),
                                     dim3(threads), args, smem, stream);
}

// The launch's result. NOTE: a refused launch also leaves its error as the thread's last CUDA
// error; it is cleared here, or the next kernel launch check (torch's) would report it as its own.
inline int finish_launch(cudaError_t e) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

// 0 on an sm_90 device (the current one), else cudaErrorNoKernelImageForDevice: the Hopper
// kernels (the fused layer, the experts' backward) are compiled into every build, with empty
// bodies on other targets, so their launchers refuse instead of launching them.
inline int require_sm90() {
  int dev = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) return finish_launch(e);
  return major == 9 && minor == 0 ? 0 : static_cast<int>(cudaErrorNoKernelImageForDevice);
}

// A plain launch of `kernel(args)` with `smem` bytes of dynamic shared memory (its limit raised
// first); the launch's result as finish_launch gives it.
template <typename Args>
inline int launch_with_smem(void (*kernel)(Args), const Args& args, int grid, int threads,
                            int smem, cudaStream_t stream) {
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return finish_launch(e);
  kernel<<<grid, threads, smem, stream>>>(args);
  return finish_launch(cudaGetLastError());
}

}  // namespace mok
