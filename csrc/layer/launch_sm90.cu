// Host launcher of the fused layer for Hopper (sm_90a): TMA tensor maps of the operands, counter
// reset, one cooperative launch. Includes only CUDA and csrc/ headers, so it compiles without
// torch (CI compile-checks it for sm_90a and sm_100a).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "api.h"
#include "common/launch.cuh"
#include "common/tensor_map.h"
#include "layer/sm90_fwd.cuh"
#include "params.h"

namespace mok {

namespace {

bool encode_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, int box_rows) {
  return encode_bf16_map(map, base, rows, cols, box_rows, kTileK);
}

}  // namespace

int layer_smem_bytes() { return kLayerSmem; }

int layer_counters(const Params& p) { return Counters(p).total; }

int launch_layer(const Params& p, const LayerArgs& a, int grid, void* stream_ptr) {
  if (const int arch = require_sm90()) return arch;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  LayerKernelArgs k{};
  k.p = p;
  k.a = a;
  const int64_t H = p.hidden, I = a.inter, Is = a.shared_inter;
  const int64_t L = p.num_local_experts;
  const int64_t recv_rows = a.ring_rows < p.capacity ? a.ring_rows : p.capacity;
  if (a.gate_up_stride < I) return static_cast<int>(cudaErrorInvalidValue);
  // The gate (up) rows of every expert as one map: the last expert's I rows end the span.
  const int64_t gu_rows = (L - 1) * a.gate_up_stride + I;
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
            encode_map(&k.maps[kMapGate], a.w_gate, gu_rows, H, 128) &&
            encode_map(&k.maps[kMapUp], a.w_up, gu_rows, H, 128) &&
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
