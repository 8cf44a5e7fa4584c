// Host launchers of the communication kernels and of the fused layer (TMA tensor maps, counter
// reset). Includes only CUDA and csrc/ headers, so it compiles without torch (CI
// compile-checks it for sm_90a and sm_100a).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "api.h"
#include "combine.cuh"
#include "dispatch.cuh"
#include "layer.cuh"
#include "params.h"
#include "schedule.cuh"

namespace mok {

namespace {

template <typename Kernel>
cudaError_t launch_cooperative(Kernel kernel, const Params& params, int grid, int threads,
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
int finish_launch(cudaError_t e) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

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
                             sizeof(int32_t) * kScheduleWarps * params.num_experts, stream);
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
    case kKernelDedupSum: {
      const int64_t rb = static_cast<int64_t>(params.hidden) * 2;
      const bool has = (params.flags & kFlagHasShared) != 0;
      const int slots = reduce_slots(params.num_ranks, has);
      const int gslots =
          gather_slots(params.num_ranks, has, (params.flags & kFlagSharedFp32) != 0);
      size_t smem = reduce_stages(rb, slots) * reduce_stage_bytes(rb, slots);
      if (sum_stages(rb, params.num_ranks) >= kMinStages)
        smem = sum_stages(rb, params.num_ranks) * sum_stage_bytes(rb, params.num_ranks);
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

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

// ---- fused layer ----------------------------------------------------------------------------

namespace {


PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
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

// Row-major bf16 [rows, cols] read in boxes of box_rows x 64 columns, 128-byte swizzle.
bool encode_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, int box_rows) {
  const auto fn = encode_fn();
  if (fn == nullptr || base == nullptr || rows <= 0) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * 2)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kTileK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
                        strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace

int layer_smem_bytes() { return kLayerSmem; }

int layer_counters(const Params& p) { return Counters(p).total; }

int launch_layer(const Params& p, const LayerArgs& a, int grid, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  LayerKernelArgs k{};
  k.p = p;
  k.a = a;
  const int64_t H = p.hidden, I = a.inter, Is = a.shared_inter;
  const int64_t L = p.num_local_experts;
  const int64_t recv_rows = a.ring_rows < p.capacity ? a.ring_rows : p.capacity;
  const uint8_t* sym = reinterpret_cast<const uint8_t*>(p.sym_base[p.rank]);
  // NOTE: a tensor map needs at least one row. Without tokens (or with more than the workspace
  // holds, when the kernel exits at once) the x map points at the symmetric x buffer, which
  // no tile then reads.
  const bool has_x = p.num_tokens > 0 && p.num_tokens <= p.max_tokens;
  const int64_t N = has_x ? p.num_tokens : 1;
  const void* x = has_x ? p.in0 : static_cast<const void*>(sym + p.off_x);
  bool ok = encode_map(&k.maps[kMapX], x, N, H, kTileM) &&
            encode_map(&k.maps[kMapRecv], sym + p.off_recv, recv_rows, H, kTileM) &&
            encode_map(&k.maps[kMapH], a.h, a.ring_rows, I, kTileM) &&
            encode_map(&k.maps[kMapGate], a.w_gate, L * I, H, 128) &&
            encode_map(&k.maps[kMapUp], a.w_up, L * I, H, 128) &&
            encode_map(&k.maps[kMapDown], a.w_down, L * H, I, kTileN);
  if (ok && Is > 0) {
    ok = encode_map(&k.maps[kMapSharedH], a.shared_h, N, Is, kTileM) &&
         encode_map(&k.maps[kMapSharedGate], a.shared_w_gate, Is, H, 128) &&
         encode_map(&k.maps[kMapSharedUp], a.shared_w_up, Is, H, 128) &&
         encode_map(&k.maps[kMapSharedDown], a.shared_w_down, H, Is, kTileN);
  }
  if (!ok) return static_cast<int>(cudaErrorInvalidValue);
  cudaError_t e = cudaMemsetAsync(a.counters, 0, sizeof(uint32_t) * Counters(p).total, stream);
  if (e != cudaSuccess) return finish_launch(e);
  e = cudaFuncSetAttribute(layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLayerSmem);
  if (e != cudaSuccess) return finish_launch(e);
  // NOTE: cooperative, so every block is co-resident (the roles spin on each other's counters).
  void* args[] = {&k};
  e = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(layer_kernel), dim3(grid),
                                  dim3(kLayerThreads), args, kLayerSmem, stream);
  return finish_launch(e);
}

}  // namespace mok
