// The combine kernels (push, pull, and the two dedup pull steps), built on the routines of
// comm/combine.cuh. Included by the communication launcher only.
#pragma once

#include <cstdint>

#include "comm/combine.cuh"
#include "params.h"

namespace mok {

// in0: y [capacity, hidden] bf16 (expert outputs in schedule row order, local);
// in1: topk_weights [num_tokens, num_topk] fp32; in2: shared_y [num_tokens, hidden] or null;
// in3: topk_idx [num_tokens, num_topk] int32 (dedup); out0: out [num_tokens, hidden] bf16.
template <bool kDedup>
__global__ void __launch_bounds__(kCommThreads) combine_push_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  // NOTE: my slots are free once this kernel runs: the previous reduce that read them is an
  // earlier kernel on this stream.
  if (blockIdx.x == 0) block_signal_all(c, kSigSlotsFree);
  if (!block_wait_all(c, kSigSlotsFree, static_cast<uint64_t>(p.epoch))) return;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const int K = p.num_topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + warp;
  const int nwarps = gridDim.x * kCommWarps;
  const uint8_t* y = static_cast<const uint8_t*>(p.in0);
  if (!kDedup) {
    const int32_t* src_rank = p.sched + p.o_src_rank;
    const int32_t* src_index = p.sched + p.o_src_index;
    const int num_rows = p.sched[p.o_meta + kMetaNumRows];
    for (int row = gwarp; row < num_rows; row += nwarps) {
      const int r = src_rank[row];
      if (r < 0) continue;
      uint8_t* slot = c.sym(r, p.off_slots) + src_index[row] * row_bytes;
      warp_copy_row(reinterpret_cast<int4*>(slot),
                    reinterpret_cast<const int4*>(y + row * row_bytes), n16, lane);
    }
  } else {
    __shared__ WarpTerms terms;
    const int32_t* d_src_rank = p.sched + p.o_dedup_src_rank;
    const int32_t* d_slot = p.sched + p.o_dedup_slot;
    const int32_t* fan_rows = p.sched + p.o_fan_rows;
    const float* fan_w = reinterpret_cast<const float*>(p.sched + p.o_fan_w);
    const int num_dedup = p.sched[p.o_meta + kMetaNumDedup];
    // NOTE: at one rank every token is a dedup row whose only partial is this rank's: its sum
    // goes straight to out (warp_weighted_sum_one_rank, the same bits as the slot and the
    // reduce below), which is then skipped.
    const bool one_rank = p.num_ranks == 1;
    const int32_t* d_src_token = p.sched + p.o_dedup_src_token;
    const bool shared_fp32 = (p.flags & kFlagSharedFp32) != 0;
    for (int row = gwarp; row < num_dedup; row += nwarps) {
      const int fr = lane < K ? fan_rows[row * K + lane] : -1;
      const int n = warp_list_length(fr);  // entries past the -1 terminator are stale
      if (lane < n) {
        terms.src[warp][lane] = reinterpret_cast<uint64_t>(y + fr * row_bytes);
        terms.w[warp][lane] = fan_w[row * K + lane];
      }
      __syncwarp();
      if (one_rank) {
        const int64_t t = d_src_token[row];
        warp_weighted_sum_one_rank(
            reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out0) + t * row_bytes),
            shared_row(p, t, row_bytes), shared_fp32, terms.src[warp], terms.w[warp], n, n16, lane);
      } else {
        uint8_t* slot = c.sym(d_src_rank[row], p.off_slots) + d_slot[row] * row_bytes;
        warp_weighted_sum(reinterpret_cast<uint4*>(slot), nullptr, false, terms.src[warp],
                          terms.w[warp], n, n16, lane);
      }
      __syncwarp();
    }
  }
  grid_signal_all(c, kSigSlotsFilled);
  if (!block_wait_all(c, kSigSlotsFilled, static_cast<uint64_t>(p.epoch))) return;
  if (kDedup && p.num_ranks == 1) return;  // every token's sum written above
  __shared__ WarpTerms terms;
  reduce_tokens(c, kDedup ? 1 : 0, terms);
}

// in0: y [capacity, hidden] bf16 (staged into the symmetric y buffer if kFlagStage, else y
// already lives there); in1, in2, out0 as combine_push_kernel.
__global__ void __launch_bounds__(kCommThreads) combine_pull_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  if (p.flags & kFlagStage) {
    if (!block_wait_all(c, kSigYConsumed, static_cast<uint64_t>(p.epoch - 1)))
      return;
    const int num_rows = p.sched[p.o_meta + kMetaNumRows];
    grid_copy(c.sym(p.rank, p.off_y), p.in0, static_cast<int64_t>(num_rows) * p.hidden * 2);
    if (!grid_sync(c)) return;
  }
  if (blockIdx.x == 0) block_signal_all(c, kSigYReady);
  if (!block_wait_all(c, kSigYReady, static_cast<uint64_t>(p.epoch))) return;
  __shared__ WarpTerms terms;
  reduce_tokens(c, 2, terms);
  grid_signal_all(c, kSigYConsumed);
}

// in0: y [capacity, hidden] bf16 (local). Fills my partials buffer for this epoch (family
// "partials"), after every rank finished reading the previous epoch's partials.
__global__ void __launch_bounds__(kCommThreads) dedup_partials_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  if (!block_wait_all(c, kSigPartConsumed, static_cast<uint64_t>(p.epoch - 1))) return;
  const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
  const int slots = partials_slots(p.num_topk);
  const PartialsMeta meta{&c, static_cast<const uint8_t*>(p.in0)};
  const int num_dedup = p.sched[p.o_meta + kMetaNumDedup];
  if (p.flags & kFlagVector)
    warp_reduce_rows(meta, num_dedup, rb, false);
  else
    tma_reduce_rows(meta, num_dedup, rb, p.num_topk, false, false, reduce_stages(rb, slots),
                    dyn_smem);
  // Each dedup row's partial lies in row `row` here: its home rank finds it at slot
  // token * K + j of its partials index (j: my place among the token's owners).
  const int32_t* home = p.sched + p.o_dedup_src_rank;
  const int32_t* slot = p.sched + p.o_dedup_slot;
  for (int row = blockIdx.x * blockDim.x + threadIdx.x; row < num_dedup; row += gridDim.x * blockDim.x)
    partials_index(c, home[row])[slot[row]] = row;
  if (last_block(c)) block_store_all(c, kSigPartReady, static_cast<uint64_t>(p.epoch));
}

// in2: shared_y [num_tokens, hidden] (bf16 or fp32) or null; out0: out [num_tokens, hidden] bf16.
// Reads every owner's partials of epoch p.epoch. NOTE: the owners may overwrite them once every
// rank said "consumed", so only the last sum of an epoch says it (the others carry kFlagKeep).
__global__ void __launch_bounds__(kCommThreads) dedup_sum_kernel(const __grid_constant__ Params p) {
  const Ctx c(p);
  stamp(p, 0);
  if (block_aborted(c)) return;
  if (!block_wait_all(c, kSigPartReady, static_cast<uint64_t>(p.epoch))) return;
  stamp(p, 1);
  const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
  const bool has_shared = (p.flags & kFlagHasShared) != 0;
  const bool fp32 = (p.flags & kFlagSharedFp32) != 0;
  const int terms = max_owner_terms(p.num_ranks, p.num_topk);
  const int slots = reduce_slots(terms, has_shared);
  const int gslots = gather_slots(terms, has_shared, fp32);
  if ((p.flags & kFlagGather) && gather_units(gslots) > 0)
    gather_sum_rows(c, gather_units(gslots), gslots);
  else if (p.flags & (kFlagVector | kFlagGather))
    warp_reduce_rows(DedupSumMeta{&c}, p.num_tokens, rb, fp32);
  else if (sum_stages(rb, p.num_ranks, p.num_topk) >= kMinStages)
    tma_sum_rows(c, sum_stages(rb, p.num_ranks, p.num_topk), dyn_smem);
  else
    tma_reduce_rows(DedupSumMeta{&c}, p.num_tokens, rb, terms, has_shared, fp32,
                    reduce_stages(rb, slots), dyn_smem);
  stamp(p, 2);
  if (last_block(c) && !(p.flags & kFlagKeep))
    block_store_all(c, kSigPartConsumed, static_cast<uint64_t>(p.epoch));
  stamp(p, 3);
}

}  // namespace mok
