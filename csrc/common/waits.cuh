// Bounded waits, signals, grid barrier and the error record (the block-level protocol built on
// the PTX wrappers of ptx/sync.cuh).
//
// NOTE: flags that cross NVLink use system-scope release/acquire (st/red.release.sys,
// ld.acquire.sys); flags between blocks of one GPU use GPU scope. Every spin-wait is bounded by
// Params::timeout_ns measured with %globaltimer; on expiry the waiting thread records which wait,
// which peer and the counter values in the host-mapped error record, raises the sticky abort
// word and returns false, and the kernel exits.
#pragma once

#include <cstdint>

#include "params.h"
#include "ptx/sync.cuh"

namespace mok {

struct Ctx {
  const Params& p;
  __device__ explicit Ctx(const Params& params) : p(params) {}

  __device__ int32_t* meta() const { return p.sched + p.o_meta; }
  __device__ bool aborted() const {
    return *reinterpret_cast<volatile int32_t*>(meta() + kMetaAbort) != 0;
  }
  // Symmetric allocation of `rank` (may be a peer's, mapped over NVLink).
  __device__ uint8_t* sym(int rank, int64_t off) const {
    return reinterpret_cast<uint8_t*>(p.sym_base[rank]) + off;
  }
  // My counter of signal `kind` raised by `peer`, and the one I raise on `peer`.
  __device__ uint64_t* my_signal(int kind, int peer) const {
    return reinterpret_cast<uint64_t*>(sym(p.rank, p.off_signals)) + kind * kMaxRanks + peer;
  }
  __device__ uint64_t* peer_signal(int peer, int kind) const {
    return reinterpret_cast<uint64_t*>(sym(peer, p.off_signals)) + kind * kMaxRanks + p.rank;
  }
};

// The abort word as one answer for the whole block (all threads call it). NOTE: threads that
// read the word themselves can disagree when another block aborts in between, and a block split
// that way meets its next barrier with threads missing.
__device__ __forceinline__ bool block_aborted(const Ctx& c) {
  return __syncthreads_or(threadIdx.x == 0 && c.aborted()) != 0;
}

// Phase stamps of a communication kernel (kFlagStamps): thread 0 of each block writes the
// globaltimer at phase `i` (0 entry, 1 after the peers' ready signal, 2 after the copies or
// sums, 3 before exit; the schedule: 0 entry, 1 routing exchanged, 2 tables (histograms, scans,
// offsets) done, 3 positions done) into in3, uint64 [gridDim.x][kNumStamps]. Diagnostics only.
constexpr int kNumStamps = 4;
__device__ __forceinline__ void stamp(const Params& p, int i) {
  if ((p.flags & kFlagStamps) && threadIdx.x == 0)
    const_cast<uint64_t*>(static_cast<const uint64_t*>(p.in3))[blockIdx.x * kNumStamps + i] =
        globaltimer_ns();
}

// Records the first error of this workspace and raises the abort word. Later errors (often the
// cascade of the first: peers that time out waiting for an aborted rank) are dropped.
static __device__ __noinline__ void record_error(const Ctx& c, int code, int wait, int peer,
                                          int64_t observed, int64_t expected, int64_t extra) {
  int32_t* m = c.meta();
  if (atomicCAS(m + kMetaErrClaim, 0, 1) == 0) {
    volatile int64_t* e = c.p.error;
    e[kErrFieldWait] = wait;
    e[kErrFieldPeer] = peer;
    e[kErrFieldObserved] = observed;
    e[kErrFieldExpected] = expected;
    e[kErrFieldRank] = c.p.rank;
    e[kErrFieldEpoch] = c.p.epoch;
    e[kErrFieldExtra] = extra;
    // NOTE: the code is written last, after a system fence, so a host that sees a non-zero
    // code sees every other field of the record.
    __threadfence_system();
    e[kErrFieldCode] = code;
    __threadfence_system();
  }
  *reinterpret_cast<volatile int32_t*>(m + kMetaAbort) = 1;
  __threadfence();
}

// Spins until *ptr >= target. False on timeout (recorded) or when another block aborted.
static __device__ __noinline__ bool wait_ge(const Ctx& c, const uint64_t* ptr, uint64_t target, int wait,
                                     int peer) {
  uint64_t v = ld_acquire_sys(ptr);
  if (v >= target) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    v = ld_acquire_sys(ptr);
    if (v >= target) return true;
    if ((++spins & 63) == 0) {
      if (c.aborted()) return false;
      if (globaltimer_ns() - start > c.p.timeout_ns) {
        record_error(c, kErrTimeout, wait, peer, static_cast<int64_t>(v),
                     static_cast<int64_t>(target), 0);
        return false;
      }
    }
  }
}

// The block waits for signal `kind` from every rank to reach `target`, one thread per rank
// (thread r waits for rank r, r + blockDim.x, ...: the waits overlap, so the block's wait does
// not grow with the number of ranks); the result is broadcast to the block. Must be called by
// all threads of the block.
__device__ __forceinline__ bool block_wait_all(const Ctx& c, int kind, uint64_t target) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int r = threadIdx.x; r < c.p.num_ranks; r += blockDim.x)
    if (!wait_ge(c, c.my_signal(kind, r), target, kind, r)) ok = 0;
  // NOTE: each waiting thread's acquire plus this CTA barrier order every thread's later reads
  // after the peers' releases (causality is transitive through the barrier).
  __syncthreads();
  const bool result = ok != 0;
  __syncthreads();
  return result;
}

// The block raises signal `kind` on every rank (mine included) by one, one thread per rank,
// after a system fence so that this block's earlier stores (local and remote) are visible first.
__device__ __forceinline__ void block_signal_all(const Ctx& c, int kind) {
  // NOTE: every thread fences its own (possibly remote, still posted) stores at system scope
  // before the barrier; a fence by the signalling threads alone does not cover the other warps'
  // NVLink writes.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.p.num_ranks) __threadfence_system();
  for (int r = threadIdx.x; r < c.p.num_ranks; r += blockDim.x)
    red_add_release_sys(c.peer_signal(r, kind), 1);
}

// The block stores `value` into signal `kind` on every rank (mine included), one thread per
// rank, after a system fence; for monotone per-rank signals raised once per epoch (one block
// calls it).
__device__ __forceinline__ void block_store_all(const Ctx& c, int kind, uint64_t value) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.p.num_ranks) __threadfence_system();
  for (int r = threadIdx.x; r < c.p.num_ranks; r += blockDim.x)
    st_release_sys(c.peer_signal(r, kind), value);
}

// Last of `n` blocks out (all threads of each call it once, after their work): true in the block
// whose arrival on the local `count` is the n-th, when every arriving block's earlier memory
// operations are visible at system scope (each thread's system fence before its block arrives).
__device__ __forceinline__ bool last_arrival(uint32_t* count, uint32_t n) {
  __shared__ int last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(count, 1u) + 1 == n;
  __syncthreads();
  return last != 0;
}

// Last block out: every block calls it once after its work (all threads). It is true in the
// block that arrives last, when every block's earlier memory operations are visible at system
// scope (each thread's system fence before its block arrives), so that block alone can signal
// the peers. Nobody waits; the count resets for the next launch.
static __device__ __noinline__ bool last_block(const Ctx& c) {
  uint32_t* count = reinterpret_cast<uint32_t*>(c.meta() + kMetaLastCount);
  const bool last = last_arrival(count, gridDim.x);
  if (last && threadIdx.x == 0) {
    __threadfence();
    atomicExch(count, 0u);
  }
  return last;
}

// Every block of the grid calls it once after its work (all threads): the last block to arrive
// stores the call's epoch into signal `kind` on every rank. One remote store per rank and call,
// whatever the grid (a signal raised by every block would cost blocks x ranks remote atomics);
// its waiters wait for the epoch itself.
__device__ __forceinline__ void grid_signal_all(const Ctx& c, int kind) {
  if (last_block(c)) block_store_all(c, kind, static_cast<uint64_t>(c.p.epoch));
}

// Self-resetting grid barrier (all blocks co-resident: the launch is cooperative). False when the
// workspace aborted or the barrier timed out.
static __device__ __noinline__ bool grid_sync(const Ctx& c) {
  __shared__ int ok;
  // NOTE: system scope, so that stores to peers made before the barrier are covered by the
  // system-scope signal one block raises after it.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    ok = 1;
    uint32_t* count = reinterpret_cast<uint32_t*>(c.meta() + kMetaBarCount);
    uint32_t* gen = reinterpret_cast<uint32_t*>(c.meta() + kMetaBarGen);
    const uint32_t g = ld_acquire_gpu(gen);
    __threadfence();
    const uint32_t arrived = atomicAdd(count, 1u) + 1;
    if (arrived == gridDim.x) {
      atomicExch(count, 0u);
      // NOTE: the count is reset before the generation moves on, so no block of the next
      // barrier can arrive on a stale count.
      __threadfence();
      st_release_gpu(gen, g + 1);
    } else {
      const uint64_t start = globaltimer_ns();
      uint32_t spins = 0;
      while (ld_acquire_gpu(gen) == g) {
        if ((++spins & 63) == 0) {
          if (c.aborted()) {
            ok = 0;
            break;
          }
          if (globaltimer_ns() - start > c.p.timeout_ns) {
            record_error(c, kErrTimeout, kWaitGridBarrier, c.p.rank, arrived, gridDim.x, 0);
            ok = 0;
            break;
          }
        }
      }
    }
    __threadfence();
    if (c.aborted()) ok = 0;  // read once, for the whole block
  }
  __syncthreads();
  const bool result = ok != 0;
  __syncthreads();
  return result;
}

}  // namespace mok
