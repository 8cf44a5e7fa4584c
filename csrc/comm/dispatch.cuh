// Dispatch: token rows to the expert-contiguous receive buffer of the rank owning each expert.
//
//   pull:       the destination loads each receive row from the source's symmetric x buffer;
//   dedup_pull: the destination loads one row per (source rank, token) over NVLink and writes
//               it to every receive row of that token (local fan-out);
//   push:       the source stores each (token, k) row into the destination's receive buffer.
//
// pull and dedup_pull move rows with bulk copies (common/rings.cuh: one elected thread per block
// keeps
// up to 14 rows of 14 KiB in flight) unless kFlagVector asks for the v1 path (one warp per row,
// 16-byte loads/stores) or the rows are too large for >= 3 shared-memory stages. dedup_pull with
// kFlagNoFanout only fills the dedup buffer (out0, row = dedup row): the unit comparable with
// other libraries' dispatch; fanout_kernel then writes the expert-contiguous receive rows (the
// expert stage's gather in the fused layer). kFlagSkipLocal (with kFlagNoFanout) leaves this
// rank's own dedup rows out of the dedup buffer: they are already in the local x buffer, so only
// the remote rows cross the pipeline; fanout_kernel with kFlagSkipLocal reads them from x.
//
// Receive rows are written in minibatch order (pull) and each block raises the per-minibatch
// ready counter once its share of a minibatch landed (target: gridDim.x * epoch), the hook the
// fused GEMMs will wait on. Padding rows are left untouched.
#pragma once

#include <cstdint>

#include "common/rings.cuh"
#include "common/rows.cuh"
#include "common/schedule.cuh"
#include "common/waits.cuh"
#include "params.h"

namespace mok {

constexpr int kCommThreads = 512;
constexpr int kCommWarps = kCommThreads / 32;

// Bulk-copy path for rows of this size?
__device__ __forceinline__ bool use_tma_rows(const Params& p) {
  return (p.flags & kFlagVector) == 0 && copy_stages(p.row_bytes) >= kMinStages;
}

extern __shared__ __align__(128) uint8_t dyn_smem[];

// Receive row r0 + row <- the source's x row (padding rows: nothing).
struct PullMeta {
  const Ctx* c;
  int r0;
  uint8_t* recv;
  __device__ void operator()(int row, uint64_t& src, int& n, uint64_t* dst) const {
    const Params& p = c->p;
    row += r0;
    const int s = p.sched[p.o_src_rank + row];
    if (s < 0) return;
    const int token = p.sched[p.o_src_index + row] / p.num_topk;
    src = reinterpret_cast<uint64_t>(c->sym(s, p.off_x) + token * p.row_bytes);
    dst[0] = reinterpret_cast<uint64_t>(recv + row * p.row_bytes);
    n = 1;
  }
};

// Fan-out list of dedup row `row` (-1 terminated or full) -> receive row addresses.
__device__ __forceinline__ int fan_dsts(const Params& p, int row, uint8_t* recv, uint64_t* dst) {
  const int32_t* fan = p.sched + p.o_fan_rows + static_cast<int64_t>(row) * p.num_topk;
  int n = 0;
  for (int j = 0; j < p.num_topk; ++j) {
    const int fr = fan[j];
    if (fr < 0) break;
    dst[j] = reinterpret_cast<uint64_t>(recv + fr * p.row_bytes);
    n = j + 1;
  }
  return n;
}

// Dedup row <- the source's x row; to its fan-out receive rows, or to dedup-buffer row `row`.
struct DedupMeta {
  const Ctx* c;
  uint8_t* out;
  bool fan;
  __device__ void operator()(int row, uint64_t& src, int& n, uint64_t* dst) const {
    const Params& p = c->p;
    const int s = p.sched[p.o_dedup_src_rank + row];
    const int token = p.sched[p.o_dedup_src_token + row];
    src = reinterpret_cast<uint64_t>(c->sym(s, p.off_x) + token * p.row_bytes);
    if (fan) {
      n = fan_dsts(p, row, out, dst);
    } else {
      dst[0] = reinterpret_cast<uint64_t>(out + row * p.row_bytes);
      n = 1;
    }
  }
};

// Remote dedup rows (source rank != mine), numbered source by source in ascending rank:
// item i -> its dedup row. The o-th dedup row of source r sits at the round-robin position the
// schedule gave it (common/schedule.cuh phase 3).
__device__ __forceinline__ int num_remote_dedup(const Params& p) {
  return p.sched[p.o_meta + kMetaNumDedup] - p.sched[p.o_dcount + p.rank];
}
__device__ __forceinline__ int remote_dedup_row(const Params& p, int i) {
  const int32_t* dcount = p.sched + p.o_dcount;
  int r = 0;
  for (; r < p.num_ranks; ++r) {
    if (r == p.rank) continue;
    const int n = dcount[r];
    if (i < n) break;
    i -= n;
  }
  return round_robin_pos(dcount, p.num_ranks, i, r);
}

// Remote dedup row (item index -> row) <- the source's x row, into dedup-buffer row `row`.
struct RemoteDedupMeta {
  const Ctx* c;
  uint8_t* out;
  __device__ void operator()(int item, uint64_t& src, int& n, uint64_t* dst) const {
    const Params& p = c->p;
    const int row = remote_dedup_row(p, item);
    const int s = p.sched[p.o_dedup_src_rank + row];
    const int token = p.sched[p.o_dedup_src_token + row];
    src = reinterpret_cast<uint64_t>(c->sym(s, p.off_x) + token * p.row_bytes);
    dst[0] = reinterpret_cast<uint64_t>(out + row * p.row_bytes);
    n = 1;
  }
};

// Source of dedup row `row` for the fan-out: the dedup buffer, or (skip_local) my x buffer for
// my own rows.
__device__ __forceinline__ const uint8_t* fan_src(const Params& p, const uint8_t* dedup, int row,
                                                  bool skip_local) {
  if (skip_local && p.sched[p.o_dedup_src_rank + row] == p.rank)
    return reinterpret_cast<const uint8_t*>(p.sym_base[p.rank]) + p.off_x +
           p.sched[p.o_dedup_src_token + row] * p.row_bytes;
  return dedup + row * p.row_bytes;
}

// Local fan-out: dedup-buffer row -> its receive rows.
struct FanoutMeta {
  const Params* p;
  const uint8_t* dedup;
  uint8_t* recv;
  bool skip_local;
  __device__ void operator()(int row, uint64_t& src, int& n, uint64_t* dst) const {
    src = reinterpret_cast<uint64_t>(fan_src(*p, dedup, row, skip_local));
    n = fan_dsts(*p, row, recv, dst);
  }
};

// Publishes this rank's x buffer for this epoch: optionally stage in0 into it first, after
// every peer finished reading the previous epoch's rows.
__device__ __forceinline__ bool publish_x(const Ctx& c) {
  const Params& p = c.p;
  if (p.flags & kFlagStage) {
    if (!block_wait_all(c, kSigXConsumed, static_cast<uint64_t>(p.epoch - 1))) return false;
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

}  // namespace mok
