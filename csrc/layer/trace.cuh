// The fused layer's event trace: what each role stamps, and the tracer that writes it.
#pragma once

#include <cstdint>

#include "params.h"

namespace mok {

// Event trace (LayerArgs::trace): one writer thread per region, so no atomics.
enum TraceEvent : int {
  kEvStaged = 1,        // communication block: x staged and every peer's x ready
  kEvPulled = 2,        // communication block: dedup rows pulled (dedup pull)
  kEvRingWait = 3,      // communication block: waiting for ring rows of minibatch (index)
  kEvReady = 4,         // communication block: minibatch (index) dispatched
  kEvDepWait = 10,      // producer: waiting for tile (index)'s operands
  kEvDepDone = 11,      // producer: tile (index)'s operands ready, loads start
  kEvTileStart = 20,    // consumer: tile (index) begins (waits for its first stage)
  kEvFirstStage = 21,   // consumer: first stage of tile (index) full
  kEvMainDone = 22,     // consumer: last MMA of tile (index) done
  kEvEpiDone = 23,      // consumer: tile (index)'s outputs stored and published
  kEvEpiStaged = 24,    // consumer: tile (index)'s first output chunk staged in shared memory
  kEvEpiStored = 25,    // consumer: tile (index)'s last output chunk handed to the store warp
  kEvEpiFenced = 26,    // (no longer stamped: the store warps fence and publish, untraced)
  kEvSumStart = 30,     // any block: fixed-order sum begins (every rank's slots filled)
  kEvSumDone = 31,      // any block: fixed-order sum done
};

// Holds no state in registers (the count lives in the region's first pair, the rest comes from
// the kernel's parameters): the consumers' registers are all taken by their accumulators.
struct Tracer {
  const LayerArgs& a;
  int which;
  __device__ Tracer(const LayerArgs& args, int region) : a(args), which(region) {}
  __device__ __forceinline__ uint64_t* region() const {
    return a.trace + (static_cast<int64_t>(blockIdx.x) * 2 + which) * a.trace_entries * 2;
  }
  // Packed event: type (8 bits) | tile kind (8 bits) | index (32 bits).
  __device__ __forceinline__ uint64_t now() const { return a.trace ? globaltimer_ns() : 0; }
  __device__ __forceinline__ void add(int type, int kind, int index) {
    add_at(now(), type, kind, index);
  }
  __device__ __forceinline__ void add_at(uint64_t t, int type, int kind, int index) {
    if (a.trace == nullptr) return;
    uint64_t* r = region();
    const int64_t n = static_cast<int64_t>(r[0]);  // continues after earlier events
    if (n + 1 >= a.trace_entries) return;
    r[2 * n + 2] = t;
    r[2 * n + 3] = (static_cast<uint64_t>(type) << 56) |
                   (static_cast<uint64_t>(kind & 0xff) << 48) | static_cast<uint32_t>(index);
    r[0] = n + 1;
  }
};

}  // namespace mok
