// Dispatch: token rows to the expert-contiguous receive buffer of the rank owning each expert.
//
//   pull:       the destination loads each receive row from the source's symmetric x buffer;
//   dedup_pull: the destination loads one row per (source rank, token) over NVLink and writes
//               it to every receive row of that token (local fan-out);
//   push:       the source stores each (token, k) row into the destination's receive buffer.
//
// Receive rows are written in minibatch order (pull) and each block raises the per-minibatch
// ready counter once its share of a minibatch landed (target: gridDim.x * epoch), the hook the
// fused GEMMs will wait on. Padding rows are left untouched.
#pragma once

#include <cstdint>

#include "params.h"
#include "rows.cuh"
#include "sync.cuh"

namespace mok {

constexpr int kCommThreads = 512;
constexpr int kCommWarps = kCommThreads / 32;

// Publishes this rank's x buffer for this epoch: optionally stage in0 into it first, after
// every peer finished reading the previous epoch's rows.
__device__ __forceinline__ bool publish_x(const Ctx& c) {
  const Params& p = c.p;
  if (p.flags & kFlagStage) {
    if (!block_wait_all(c, kSigXConsumed, static_cast<uint64_t>(p.epoch - 1) * gridDim.x))
      return false;
    grid_copy(c.sym(p.rank, p.off_x), p.in0, p.row_bytes * p.num_tokens);
    if (!grid_sync(c)) return false;
  }
  if (blockIdx.x == 0) block_signal_all(c, kSigXReady);
  return block_wait_all(c, kSigXReady, static_cast<uint64_t>(p.epoch));
}

__device__ __forceinline__ void raise_ready(const Ctx& c, int mb) {
  __syncthreads();
  if (threadIdx.x == 0)
    red_add_release_gpu(reinterpret_cast<uint32_t*>(c.p.sched + c.p.o_ready) + mb, 1u);
}

// out0: receive buffer [capacity, row_bytes]; in0: x [num_tokens, row_bytes] (staged if
// kFlagStage, else x already lives in the symmetric x buffer).
__global__ void __launch_bounds__(kCommThreads) dispatch_pull_kernel(const Params p) {
  const Ctx c(p);
  if (c.aborted()) return;
  if (!publish_x(c)) return;
  const int32_t* src_rank = p.sched + p.o_src_rank;
  const int32_t* src_index = p.sched + p.o_src_index;
  const int num_rows = p.sched[p.o_meta + kMetaNumRows];
  const int n16 = static_cast<int>(p.row_bytes / 16);
  const int lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int nwarps = gridDim.x * kCommWarps;
  uint8_t* recv = static_cast<uint8_t*>(p.out0);
  for (int mb = 0; mb < p.num_minibatches; ++mb) {
    const int r0 = mb * p.minibatch_rows, r1 = min(num_rows, r0 + p.minibatch_rows);
    for (int row = r0 + gwarp; row < r1; row += nwarps) {
      const int src = src_rank[row];
      if (src < 0) continue;
      const int token = src_index[row] / p.num_topk;
      const int4* from = reinterpret_cast<const int4*>(c.sym(src, p.off_x) + token * p.row_bytes);
      warp_copy_row(reinterpret_cast<int4*>(recv + row * p.row_bytes), from, n16, lane);
    }
    raise_ready(c, mb);
  }
  block_signal_all(c, kSigXConsumed);
}

// Same operands as dispatch_pull_kernel.
__global__ void __launch_bounds__(kCommThreads) dispatch_dedup_pull_kernel(const Params p) {
  const Ctx c(p);
  if (c.aborted()) return;
  if (!publish_x(c)) return;
  const int32_t* d_src_rank = p.sched + p.o_dedup_src_rank;
  const int32_t* d_src_token = p.sched + p.o_dedup_src_token;
  const int32_t* fan_rows = p.sched + p.o_fan_rows;
  const int num_dedup = p.sched[p.o_meta + kMetaNumDedup];
  const int n16 = static_cast<int>(p.row_bytes / 16);
  const int K = p.num_topk;
  const int lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int nwarps = gridDim.x * kCommWarps;
  uint8_t* recv = static_cast<uint8_t*>(p.out0);
  for (int row = gwarp; row < num_dedup; row += nwarps) {
    const int src = d_src_rank[row];
    const int token = d_src_token[row];
    const int fr = lane < K ? fan_rows[row * K + lane] : -1;
    // NOTE: the list is -1 terminated (or full); entries past the terminator are stale.
    const int n = warp_list_length(fr);
    const uint64_t dst = reinterpret_cast<uint64_t>(recv + (fr < 0 ? 0 : fr) * p.row_bytes);
    const int4* from = reinterpret_cast<const int4*>(c.sym(src, p.off_x) + token * p.row_bytes);
    warp_fan_row(dst, n, from, n16, lane);
  }
  // Receive rows of a token span all expert regions: every minibatch is complete only now.
  for (int mb = 0; mb < p.num_minibatches; ++mb) raise_ready(c, mb);
  block_signal_all(c, kSigXConsumed);
}

// in0: x [num_tokens, row_bytes] (local); the receive buffers are the symmetric ones of every
// rank (off_recv). Source side: each token row is read once and stored to its k receive rows.
__global__ void __launch_bounds__(kCommThreads) dispatch_push_kernel(const Params p) {
  const Ctx c(p);
  if (c.aborted()) return;
  // NOTE: my receive buffer is free once this kernel runs: its previous readers are earlier
  // kernels on this stream.
  if (blockIdx.x == 0) block_signal_all(c, kSigRecvFree);
  if (!block_wait_all(c, kSigRecvFree, static_cast<uint64_t>(p.epoch))) return;
  const int32_t* dst_rank = p.sched + p.o_dst_rank;
  const int32_t* dst_index = p.sched + p.o_dst_index;
  const int n16 = static_cast<int>(p.row_bytes / 16);
  const int K = p.num_topk;
  const int lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int nwarps = gridDim.x * kCommWarps;
  const uint8_t* x = static_cast<const uint8_t*>(p.in0);
  for (int t = gwarp; t < p.num_tokens; t += nwarps) {
    const int d = lane < K ? dst_rank[t * K + lane] : 0;
    const int pos = lane < K ? dst_index[t * K + lane] : 0;
    const uint64_t dst = reinterpret_cast<uint64_t>(c.sym(d, p.off_recv) + pos * p.row_bytes);
    warp_fan_row(dst, K, reinterpret_cast<const int4*>(x + t * p.row_bytes), n16, lane);
  }
  block_signal_all(c, kSigRecvFilled);
  if (!block_wait_all(c, kSigRecvFilled, static_cast<uint64_t>(p.epoch) * gridDim.x)) return;
  for (int mb = 0; mb < p.num_minibatches; ++mb) raise_ready(c, mb);
}

}  // namespace mok
