// The fused layer's local counters (their word offsets in LayerArgs::counters) and the bounded
// wait on one of them.
#pragma once

#include "common/waits.cuh"
#include "layer/sm90_gemm.cuh"
#include "params.h"

namespace mok {

// Word offsets of the counters (LayerArgs::counters).
struct Counters {
  int ready, gu_mb, dn_mb, gu_rb, sh_rb, staged, pulled, next_tile, consumed, total;
  __host__ __device__ explicit Counters(const Params& p) {
    const int mbs = p.num_minibatches;
    ready = 0;
    gu_mb = ready + mbs;
    dn_mb = gu_mb + mbs;
    gu_rb = dn_mb + mbs;
    sh_rb = gu_rb + (p.capacity + kTileM - 1) / kTileM;
    staged = sh_rb + (p.max_tokens + kTileM - 1) / kTileM;  // fixed layout: any call's count
    pulled = staged + 1;
    next_tile = pulled + 1;  // workers claim tiles in order from here
    consumed = next_tile + 1;  // communication blocks done reading the peers' x
    total = consumed + 1;
  }
};

__device__ __forceinline__ bool counter_reached(uint32_t v, uint32_t target) {
  return v >= target;
}

// Spins until the local counter reaches `target`. False on timeout (recorded) or abort.
static __device__ __noinline__ bool wait_count(const Ctx& c, const uint32_t* ptr, uint32_t target,
                                        int wait, int64_t extra) {
  uint32_t v = ld_acquire_gpu(ptr);
  if (counter_reached(v, target)) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    v = ld_acquire_gpu(ptr);
    if (counter_reached(v, target)) return true;
    if ((++spins & 63) == 0) {
      if (c.aborted()) return false;
      if (globaltimer_ns() - start > c.p.timeout_ns) {
        record_error(c, kErrTimeout, wait, c.p.rank, v, target, extra);
        return false;
      }
    }
  }
}

}  // namespace mok
