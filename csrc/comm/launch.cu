// Host launchers of the communication kernels (schedule, dispatch, combine, dedup reduce) and
// the small host queries of api.h. Includes only CUDA and csrc/ headers, so it compiles
// without torch (CI compile-checks it for sm_90a and sm_100a).
#include <cuda_runtime.h>

#include <cstdint>

#include "api.h"
#include "comm/combine_kernels.cuh"
#include "comm/dispatch_kernels.cuh"
#include "common/launch.cuh"
#include "common/schedule_kernel.cuh"
#include "params.h"

namespace mok {

namespace {

// Dynamic shared memory of the bulk-copy row pipelines (0 on the vector path).
size_t copy_smem(const Params& p) {
  const int stages = copy_stages(p.row_bytes);
  if ((p.flags & kFlagVector) || stages < kMinStages) return 0;
  return static_cast<size_t>(stages * align128(p.row_bytes));
}

}  // namespace

int launch(int kind, const Params& params, int grid, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaError_t e = cudaErrorInvalidValue;
  switch (kind) {
    case kKernelSchedule:
      e = launch_cooperative(schedule_kernel, params, grid, kScheduleThreads,
                             schedule_smem_bytes(params.num_experts), stream);
      break;
    case kKernelDispatchPull:
      e = launch_cooperative(dispatch_pull_kernel, params, grid, kCommThreads, copy_smem(params),
                             stream);
      break;
    case kKernelDispatchDedupPull:
      e = launch_cooperative(dispatch_dedup_pull_kernel, params, grid, kCommThreads,
                             copy_smem(params), stream);
      break;
    case kKernelFanout:
      e = launch_cooperative(fanout_kernel, params, grid, kCommThreads, copy_smem(params), stream);
      break;
    case kKernelDedupPartials: {
      const int64_t rb = static_cast<int64_t>(params.hidden) * 2;
      const int slots = partials_slots(params.num_topk);
      e = launch_cooperative(dedup_partials_kernel, params, grid, kCommThreads,
                             reduce_stages(rb, slots) * reduce_stage_bytes(rb, slots), stream);
      break;
    }
    case kKernelWaitXFree:
      e = launch_cooperative(wait_x_free_kernel, params, 1, 32, 0, stream);
      break;
    case kKernelZeroPadding:
      e = launch_cooperative(zero_padding_kernel, params, grid, kCommThreads, 0, stream);
      break;
    case kKernelDedupSum: {
      const int64_t rb = static_cast<int64_t>(params.hidden) * 2;
      const bool has = (params.flags & kFlagHasShared) != 0;
      const int R = params.num_ranks, K = params.num_topk;
      const int slots = reduce_slots(max_owner_terms(R, K), has);
      const int gslots =
          gather_slots(max_owner_terms(R, K), has, (params.flags & kFlagSharedFp32) != 0);
      size_t smem = reduce_stages(rb, slots) * reduce_stage_bytes(rb, slots);
      if (sum_stages(rb, R, K) >= kMinStages)
        smem = sum_stages(rb, R, K) * sum_stage_bytes(rb, R, K);
      if (params.flags & kFlagVector) smem = 0;
      if (params.flags & kFlagGather) smem = gather_units(gslots) > 0 ? gather_smem(gslots) : 0;
      e = launch_cooperative(dedup_sum_kernel, params, grid, kCommThreads, smem, stream);
      break;
    }
    case kKernelDispatchPush:
      e = launch_cooperative(dispatch_push_kernel, params, grid, kCommThreads, 0, stream);
      break;
    case kKernelCombinePush:
      e = launch_cooperative(combine_push_kernel<false>, params, grid, kCommThreads, 0, stream);
      break;
    case kKernelCombineDedupPush:
      e = launch_cooperative(combine_push_kernel<true>, params, grid, kCommThreads, 0, stream);
      break;
    case kKernelCombinePull:
      e = launch_cooperative(combine_pull_kernel, params, grid, kCommThreads, 0, stream);
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  return finish_launch(e);
}

uint64_t host_device_pointer(void* host_ptr, int* err) {
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, host_ptr, 0);
  *err = static_cast<int>(e);
  return reinterpret_cast<uint64_t>(dev);
}

const char* error_string(int err) {
  if (err == cudaErrorNoKernelImageForDevice)
    return "the kernel has a Hopper (sm_90a) body only and this GPU is not sm_90 "
           "(mok.spec.arch: which of mok's paths run on which GPU)";
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // namespace mok
