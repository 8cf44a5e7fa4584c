// Host entry points of the probe microbenchmarks (probe/probe.cu), bound in torch/bindings.cpp and
// driven by mok/bench/probe.py (`python -m mok.bench probe`).
//
// Addresses are plain integers (Tensor.data_ptr(), symmetric-memory buffer_ptrs; a peer's
// address is the one mapped into *this* process), the stream is a raw cudaStream_t value
// (torch.cuda.current_stream().cuda_stream). Every function returns a cudaError_t value (0 on
// success); the latency and TMA kernels also report a detected timeout in `out` (below), which the
// caller reads after synchronising. No torch types here, so probe.cu compiles without torch.
#pragma once

#include <cstdint>

namespace mok {
namespace probe {

// Fields of the int64 `out` record (device memory, kOutWords words, zeroed by the caller).
enum OutField : int {
  kOutNs = 0,        // elapsed %globaltimer ns of the timed loop (latency kernels)
  kOutCode = 1,      // kProbeOk or kProbeTimeout
  kOutIter = 2,      // iteration (or chunk) whose wait timed out
  kOutSeen = 3,      // last value observed by the timed-out wait
  kOutExpected = 4,  // value it waited for
  kOutBlock = 5,     // block that timed out
  kOutSink = 6,      // data-dependent sink, keeps the loads alive
  kOutWords = 8,
};
enum ProbeCode : int { kProbeOk = 0, kProbeTimeout = 1 };

// 16-byte (int4) grid-stride copy of `bytes` (multiple of 16), 1024 threads per block, one block
// per SM (the launch reserves enough shared memory that two blocks never share an SM).
int copy_vector(int64_t dst, int64_t src, int64_t bytes, int64_t grid, int64_t stream);

// cp.async.bulk copy in chunks of `chunk_bytes` (multiple of 16): per block, one thread keeps
// `inflight` global->shared bulk loads in flight (mbarrier completion) and stores each chunk back
// with a shared->global bulk store (up to 4 stores still reading shared memory). Chunks are dealt
// round-robin to `grid` blocks; (inflight + 4) x chunk_bytes must fit in 220 KiB.
int copy_tma(int64_t dst, int64_t src, int64_t bytes, int64_t chunk_bytes, int64_t inflight,
             int64_t grid, int64_t timeout_ns, int64_t out, int64_t stream);

// Reads `bytes` (multiple of 64) with 16-byte loads over `grid` blocks of 1024 threads (HBM read
// bandwidth); a data-dependent value lands in out[kOutSink] only if it matches a magic value.
int read_bandwidth(int64_t src, int64_t bytes, int64_t grid, int64_t out, int64_t stream);

// Flag ping-pong, one thread per block. Block b spins on *wait_b and stores to *post_b (uint64
// flags; wait_b local, post_b local or a peer's). The ping block (ping_block: 0, 1 or -1 for
// none) posts base+i+1 then waits for base+i+1; the other waits then posts. `warmup` untimed
// round trips absorb the launch skew between two GPUs, then `iters` are timed with %globaltimer
// by the ping block (out[kOutNs]). gpu_scope: release/acquire at GPU scope instead of system.
// Flags must hold <= base on entry; the caller raises base by warmup + iters per launch.
int pingpong(int64_t wait0, int64_t post0, int64_t wait1, int64_t post1, int64_t grid,
             int64_t ping_block, int64_t gpu_scope, int64_t warmup, int64_t iters, int64_t base,
             int64_t timeout_ns, int64_t out, int64_t stream);

// One thread chases next = buf[next] (uint64 word indices relative to buf) with ld.global.cv:
// `warmup` untimed loads, then `loads` timed dependent loads (out[kOutNs]).
int chase(int64_t buf, int64_t start, int64_t warmup, int64_t loads, int64_t out,
          int64_t stream);

}  // namespace probe
}  // namespace mok
