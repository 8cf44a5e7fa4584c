// Routing all-gather into symmetric memory and the schedule table, built on the device.
//
// The table equals reference/schedule.py bitwise (as int32). One cooperative launch, four phases
// separated by grid barriers:
//   0. validate this rank's routing and push it (int32 experts, fp32 weights) into every rank's
//      route buffer, with the status word (input error, token count); signal kSigRoute; wait
//      for every rank's routing;
//   1. per (source rank, chunk of tokens): histogram over experts, and the tokens with an expert
//      on this rank (dedup rows);
//   2. exclusive scan of the histograms over chunks -> counts M[e, r] and per-chunk bases; the
//      padded region starts S of every rank; capacity check;
//   3. one warp per chunk walks its tokens in order: the o-th row from rank r for expert e lands
//      at S + sum_r' min(M[e, r'], o) + #{r' < r : M[e, r'] > o} (round robin over sources).
// NOTE: a token's top-k experts are distinct, so the occurrence of (token, k) within its
// expert's rows only depends on earlier tokens: the warp can assign all k lanes of a token at
// once without conflicts.
#pragma once

#include <cstdint>

#include "common/waits.cuh"
#include "params.h"

namespace mok {

constexpr int kScheduleThreads = 256;
constexpr int kScheduleWarps = kScheduleThreads / 32;
// Routing entries (ids and weights) a warp of the schedule's positions phase stages in shared
// memory at a time: a whole number of tokens (kMaxTopk entries or fewer each), read by coalesced
// loads instead of one dependent load per token in the walk.
constexpr int kRouteWindow = 256;
static_assert(kRouteWindow >= kMaxTopk, "a window holds at least one token's entries");
// The schedule kernel's dynamic shared memory: per warp, a running count per expert and the
// routing window.
__host__ __device__ constexpr size_t schedule_smem_bytes(int num_experts) {
  return sizeof(int32_t) * kScheduleWarps * (num_experts + 2 * kRouteWindow);
}

__device__ __forceinline__ int round_robin_pos(const int32_t* counts, int num_ranks, int occ,
                                               int src) {
  int pos = 0;
  for (int q = 0; q < num_ranks; ++q) {
    const int m = counts[q];
    pos += min(m, occ) + ((q < src && m > occ) ? 1 : 0);
  }
  return pos;
}

// Position inside its group of the `occ`-th entry from source `src` when the group holds the
// rows of source 0, then those of source 1, ...: with every rank holding consecutive global
// tokens, the rows of an expert are in global token order at every rank count.
__device__ __forceinline__ int source_order_pos(const int32_t* counts, int occ, int src) {
  int pos = occ;
  for (int q = 0; q < src; ++q) pos += counts[q];
  return pos;
}

}  // namespace mok
