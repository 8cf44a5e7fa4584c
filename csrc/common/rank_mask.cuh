// A set of ranks as bits, as wide as kMaxRanks (a token's owner ranks in the combine), so that no
// loop over ranks depends on a 32-bit word.
#pragma once

#include <cstdint>

#include "params.h"

namespace mok {

struct RankMask {
  static constexpr int kWords = (kMaxRanks + 63) / 64;
  uint64_t w[kWords];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  __device__ __forceinline__ void set(int r) { w[r >> 6] |= 1ull << (r & 63); }
  __device__ __forceinline__ bool has(int r) const { return (w[r >> 6] >> (r & 63)) & 1ull; }
  __device__ __forceinline__ int count() const {
    int n = 0;
#pragma unroll
    for (int i = 0; i < kWords; ++i) n += __popcll(w[i]);
    return n;
  }
  // Lane `src`'s mask, for every lane of the warp.
  __device__ __forceinline__ RankMask shfl(int src) const {
    RankMask m;
#pragma unroll
    for (int i = 0; i < kWords; ++i) m.w[i] = __shfl_sync(0xffffffffu, w[i], src);
    return m;
  }
};

// Owner ranks of token t: the ranks of its top-k experts (Params' schedule, dst_rank).
__device__ __forceinline__ RankMask token_owners(const Params& p, int t) {
  const int32_t* dr = p.sched + p.o_dst_rank + static_cast<int64_t>(t) * p.num_topk;
  RankMask m;
  m.clear();
  for (int k = 0; k < p.num_topk; ++k) m.set(dr[k]);
  return m;
}

// The most distinct owner ranks a token can have: one per top-k expert, at most every rank.
__host__ __device__ constexpr int max_owner_terms(int num_ranks, int num_topk) {
  return num_ranks < num_topk ? num_ranks : num_topk;
}

}  // namespace mok
