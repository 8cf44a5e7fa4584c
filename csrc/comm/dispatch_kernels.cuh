// The dispatch kernels (pull, dedup pull, fan-out, push, and the x-buffer wait), built on the
// routines of comm/dispatch.cuh. Included by the communication launcher only.
#pragma once

#include <cstdint>

#include "comm/dispatch.cuh"
#include "params.h"

namespace mok {

// One block: returns once every peer finished reading my x buffer in the pull dispatch of
// epoch p.epoch (its last block stores the epoch). Launched before the caller writes the next
// tokens into the x buffer itself (no staging copy), so the write cannot overtake a peer still
// pulling the previous ones.
__global__ void __launch_bounds__(32) wait_x_free_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  block_wait_all(c, kSigXConsumed, static_cast<uint64_t>(p.epoch));
}

// out0: a receive buffer [capacity, row_bytes]: zeros into its padding rows (rows before
// num_rows that hold no token), the rows a dispatch leaves as they were; the other rows are not
// touched. So a dispatch into an uninitialised buffer plus this gives what a dispatch into a
// zeroed one gives, for a fraction of the writes (the padding is a few % of the rows).
__global__ void __launch_bounds__(kCommThreads) zero_padding_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  const int32_t* src_rank = p.sched + p.o_src_rank;
  const int num_rows = p.sched[p.o_meta + kMetaNumRows];
  const int n16 = static_cast<int>(p.row_bytes / 16);
  const int lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int nwarps = gridDim.x * kCommWarps;
  uint8_t* buf = static_cast<uint8_t*>(p.out0);
  // a warp takes 32 rows at a time: each lane reads one row's source, a ballot names the
  // padding rows, and the warp zeroes them one after another (one row's source per warp and
  // step was a chain of dependent loads: ~250 of them per warp at 262144 rows)
  for (int row0 = gwarp * 32; row0 < num_rows; row0 += nwarps * 32) {
    const int row = row0 + lane;
    unsigned pad = __ballot_sync(0xffffffffu, row < num_rows && src_rank[row] < 0);
    while (pad != 0) {
      const int j = __ffs(pad) - 1;
      pad &= pad - 1;
      int4* to = reinterpret_cast<int4*>(buf + static_cast<int64_t>(row0 + j) * p.row_bytes);
      for (int i = lane; i < n16; i += 32) to[i] = make_int4(0, 0, 0, 0);
    }
  }
}

// out0: receive buffer [capacity, row_bytes]; in0: x [num_tokens, row_bytes] (staged if
// kFlagStage, else x already lives in the symmetric x buffer).
__global__ void __launch_bounds__(kCommThreads) dispatch_pull_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  if (!publish_x(c)) return;
  const int32_t* src_rank = p.sched + p.o_src_rank;
  const int32_t* src_index = p.sched + p.o_src_index;
  const int num_rows = p.sched[p.o_meta + kMetaNumRows];
  const int n16 = static_cast<int>(p.row_bytes / 16);
  const int lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + threadIdx.x / 32;
  const int nwarps = gridDim.x * kCommWarps;
  uint8_t* recv = static_cast<uint8_t*>(p.out0);
  if (use_tma_rows(p)) {
    __shared__ CopyRing ring;
    const int stages = copy_stages(p.row_bytes);
    copy_ring_init(ring, stages);
    int done = 0;
    for (int mb = 0; mb < p.num_minibatches; ++mb) {
      const int r0 = mb * p.minibatch_rows, r1 = min(num_rows, r0 + p.minibatch_rows);
      done = tma_copy_rows(ring, done, PullMeta{&c, r0, recv}, max(0, r1 - r0), p.row_bytes,
                           stages, dyn_smem);
      raise_ready(c, mb);
    }
    grid_signal_all(c, kSigXConsumed);
    return;
  }
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
  grid_signal_all(c, kSigXConsumed);
}

// Same operands as dispatch_pull_kernel.
__global__ void __launch_bounds__(kCommThreads) dispatch_dedup_pull_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  stamp(p, 0);
  if (block_aborted(c)) return;
  if (!publish_x(c)) return;
  stamp(p, 1);
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
  const bool fan = (p.flags & kFlagNoFanout) == 0;
  const bool remote_only = !fan && (p.flags & kFlagSkipLocal) != 0;
  __shared__ CopyRing ring;
  if (remote_only && use_tma_rows(p)) {
    const int stages = copy_stages(p.row_bytes);
    copy_ring_init(ring, stages);
    tma_copy_rows(ring, 0, RemoteDedupMeta{&c, recv}, num_remote_dedup(p), p.row_bytes, stages,
                  dyn_smem);
  } else if (remote_only) {
    const int num_remote = num_remote_dedup(p);
    for (int i = gwarp; i < num_remote; i += nwarps) {
      const int row = remote_dedup_row(p, i);
      const int4* from = reinterpret_cast<const int4*>(c.sym(d_src_rank[row], p.off_x) +
                                                       d_src_token[row] * p.row_bytes);
      warp_copy_row(reinterpret_cast<int4*>(recv + row * p.row_bytes), from, n16, lane);
    }
  } else if (use_tma_rows(p)) {
    const int stages = copy_stages(p.row_bytes);
    copy_ring_init(ring, stages);
    tma_copy_rows(ring, 0, DedupMeta{&c, recv, fan}, num_dedup, p.row_bytes, stages, dyn_smem);
  } else if (!fan) {
    for (int row = gwarp; row < num_dedup; row += nwarps) {
      const int4* from = reinterpret_cast<const int4*>(c.sym(d_src_rank[row], p.off_x) +
                                                       d_src_token[row] * p.row_bytes);
      warp_copy_row(reinterpret_cast<int4*>(recv + row * p.row_bytes), from, n16, lane);
    }
  }
  for (int row = gwarp; fan && !use_tma_rows(p) && row < num_dedup; row += nwarps) {
    const int src = d_src_rank[row];
    const int token = d_src_token[row];
    const int fr = lane < K ? fan_rows[row * K + lane] : -1;
    // NOTE: the list is -1 terminated (or full); entries past the terminator are stale.
    const int n = warp_list_length(fr);
    const uint64_t dst = reinterpret_cast<uint64_t>(recv + (fr < 0 ? 0 : fr) * p.row_bytes);
    const int4* from = reinterpret_cast<const int4*>(c.sym(src, p.off_x) + token * p.row_bytes);
    warp_fan_row(dst, n, from, n16, lane);
  }
  stamp(p, 2);
  // Receive rows of a token span all expert regions: every minibatch is complete only now.
  if (fan)
    for (int mb = 0; mb < p.num_minibatches; ++mb) raise_ready(c, mb);
  grid_signal_all(c, kSigXConsumed);
  stamp(p, 3);
}

// in0: dedup buffer [>= num_dedup, row_bytes] (dispatch dedup_pull with kFlagNoFanout);
// out0: receive buffer. Local only: every receive row gets its dedup row. kFlagSkipLocal: my
// own dedup rows are read from my x buffer (which holds this epoch's tokens after the dispatch).
__global__ void __launch_bounds__(kCommThreads) fanout_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  const int num_dedup = p.sched[p.o_meta + kMetaNumDedup];
  const uint8_t* dedup = static_cast<const uint8_t*>(p.in0);
  uint8_t* recv = static_cast<uint8_t*>(p.out0);
  const bool skip_local = (p.flags & kFlagSkipLocal) != 0;
  if (use_tma_rows(p)) {
    __shared__ CopyRing ring;
    const int stages = copy_stages(p.row_bytes);
    copy_ring_init(ring, stages);
    tma_copy_rows(ring, 0, FanoutMeta{&p, dedup, recv, skip_local}, num_dedup, p.row_bytes,
                  stages, dyn_smem);
  } else {
    const int n16 = static_cast<int>(p.row_bytes / 16);
    const int K = p.num_topk;
    const int lane = threadIdx.x % 32;
    const int gwarp = blockIdx.x * kCommWarps + threadIdx.x / 32;
    const int nwarps = gridDim.x * kCommWarps;
    for (int row = gwarp; row < num_dedup; row += nwarps) {
      const int fr = lane < K ? p.sched[p.o_fan_rows + row * K + lane] : -1;
      const int n = warp_list_length(fr);
      const uint64_t dst = reinterpret_cast<uint64_t>(recv + (fr < 0 ? 0 : fr) * p.row_bytes);
      warp_fan_row(dst, n, reinterpret_cast<const int4*>(fan_src(p, dedup, row, skip_local)), n16,
                   lane);
    }
  }
  for (int mb = 0; mb < p.num_minibatches; ++mb) raise_ready(c, mb);
}

// in0: x [num_tokens, row_bytes] (local); the receive buffers are the symmetric ones of every
// rank (off_recv). Source side: each token row is read once and stored to its k receive rows.
__global__ void __launch_bounds__(kCommThreads) dispatch_push_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
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
  grid_signal_all(c, kSigRecvFilled);
  if (!block_wait_all(c, kSigRecvFilled, static_cast<uint64_t>(p.epoch))) return;
  for (int mb = 0; mb < p.num_minibatches; ++mb) raise_ready(c, mb);
}

}  // namespace mok
