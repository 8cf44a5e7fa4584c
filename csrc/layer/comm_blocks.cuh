// The fused layer's communication blocks: x staged into the symmetric buffer, then the pull
// dispatch, minibatch by minibatch, into the receive ring.
#pragma once

#include "comm/combine.cuh"
#include "common/rows.cuh"
#include "common/waits.cuh"
#include "layer/counters.cuh"
#include "layer/tile_order.cuh"
#include "layer/trace.cuh"
#include "params.h"

namespace mok {

// ---- communication blocks ------------------------------------------------------------------

// False when the block stopped on an abort or a timeout (the same answer for all its threads).
__device__ __forceinline__ bool layer_comm(const Ctx& c, const LayerArgs& a,
                                           const TileOrder& o, int slots) {
  const Params& p = c.p;
  const int C = a.num_comm_blocks;
  const int blk = blockIdx.x;
  const Counters cnt(p);
  uint32_t* counters = a.counters;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blk * kLayerWarps + warp, nwarps = C * kLayerWarps;
  const int n16 = static_cast<int>(p.row_bytes / 16);
  __shared__ int ok;

  // Stage x once every peer finished reading the previous call's rows.
  if (!block_wait_all(c, kSigLayerXConsumed, static_cast<uint64_t>(p.epoch - 1) * C)) return false;
  uint8_t* xs = c.sym(p.rank, p.off_x);
  const uint8_t* x = static_cast<const uint8_t*>(p.in0);
  for (int t = gwarp; t < p.num_tokens; t += nwarps)
    warp_copy_row_lean(reinterpret_cast<int4*>(xs + t * p.row_bytes),
                       reinterpret_cast<const int4*>(x + t * p.row_bytes), n16, lane);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    red_add_release_gpu(counters + cnt.staged, 1u);
    ok = wait_count(c, counters + cnt.staged, C, kWaitLayerStaged, 0);
  }
  __syncthreads();
  if (!ok) return false;
  if (blk == 0) block_signal_all(c, kSigLayerXReady);
  if (!block_wait_all(c, kSigLayerXReady, static_cast<uint64_t>(p.epoch))) return false;
  Tracer tr(a, 0);
  if (threadIdx.x == 0) tr.add(kEvStaged, 0, 0);

  const bool dedup = (p.flags & kFlagDedup) != 0;
  uint8_t* dbuf = static_cast<uint8_t*>(a.dedup);
  if (dedup) {
    const int num_remote = num_remote_dedup(p);
    for (int i = gwarp; i < num_remote; i += nwarps) {
      const int row = remote_dedup_row(p, i);
      const int s = p.sched[p.o_dedup_src_rank + row];
      const int token = p.sched[p.o_dedup_src_token + row];
      warp_copy_row_lean(reinterpret_cast<int4*>(dbuf + row * p.row_bytes),
                         reinterpret_cast<const int4*>(c.sym(s, p.off_x) + token * p.row_bytes),
                         n16, lane);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      red_add_release_gpu(counters + cnt.pulled, 1u);
      ok = wait_count(c, counters + cnt.pulled, C, kWaitLayerPulled, 0);
    }
    __syncthreads();
    if (!ok) return false;
    if (threadIdx.x == 0) tr.add(kEvPulled, 0, 0);
  }
  const int32_t* src_rank = p.sched + p.o_src_rank;
  const int32_t* src_index = p.sched + p.o_src_index;
  const int32_t* fanout = p.sched + p.o_fanout;
  uint8_t* recv = c.sym(p.rank, p.off_recv);
  for (int mb = 0; mb < o.num_mbs; ++mb) {
    if (mb >= slots) {
      // The ring rows of minibatch mb - slots are free once its gate/up tiles read them.
      if (threadIdx.x == 0) {
        tr.add(kEvRingWait, 0, mb);
        const uint32_t target = 2u * o.mb_row_blocks(mb - slots) * o.n_gu;
        ok = wait_count(c, counters + cnt.gu_mb + mb - slots, target, kWaitLayerRecvFree, mb);
      }
      __syncthreads();
      if (!ok) return false;
    }
    const int r0 = mb * o.mb_rows, r1 = min(o.num_rows, r0 + o.mb_rows);
    for (int row = r0 + gwarp; row < r1; row += nwarps) {
      const int src = src_rank[row];
      if (src < 0) continue;
      const int4* from;
      if (dedup) {
        from = reinterpret_cast<const int4*>(fan_src(p, dbuf, fanout[row], true));
      } else {
        const int token = src_index[row] / p.num_topk;
        from = reinterpret_cast<const int4*>(c.sym(src, p.off_x) + token * p.row_bytes);
      }
      const int64_t ring_row = row % a.ring_rows;
      warp_copy_row(reinterpret_cast<int4*>(recv + ring_row * p.row_bytes), from, n16, lane);
    }
    // NOTE: the rows are read by the workers' TMA (async proxy): every writer fences its
    // generic stores against the async proxy before the release.
    fence_proxy_async_global();
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      red_add_release_gpu(counters + cnt.ready + mb, 1u);
      tr.add(kEvReady, 0, mb);
    }
  }
  // x consumed: the last communication block out stores epoch x C on every rank (the value C
  // blocks' increments used to reach; the waits are unchanged), so a call sends each peer one
  // flag, not one per communication block.
  if (last_arrival(counters + cnt.consumed, C))
    block_store_all(c, kSigLayerXConsumed, static_cast<uint64_t>(p.epoch) * C);
  // NOTE: one read of the abort word for the block (ok is shared), after the barrier above.
  if (threadIdx.x == 0) ok = !c.aborted();
  __syncthreads();
  return ok != 0;
}

}  // namespace mok
