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
  kOutCycles = 7,    // %clock64 cycles of the timed loop (with kOutNs: the SM clock)
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

// ---- push signalling (python -m mok.bench probe, sections poll_cost .. signal_jitter) ----------

// Poll cost: one block sweeps `k` (1..128) packed uint64 flags that already hold >= target
// (ld.acquire at GPU or system scope), `warmup` untimed sweeps, then `sweeps` timed ones
// (out[kOutNs]). mode 0: one warp, flag j on lane j % 32, a warp vote per sweep; 1: one thread
// loads the k flags in turn; 2: one thread per flag, a block vote (__syncthreads_and) per sweep.
// out[kOutSink] counts sweeps that found a flag below target (0 unless the flags were not set).
int poll_flags(int64_t flags, int64_t k, int64_t mode, int64_t gpu_scope, int64_t target,
               int64_t warmup, int64_t sweeps, int64_t out, int64_t stream);

// Fence cost: `grid` blocks of 1024 threads, one per SM, each stores `bytes_per_block` (multiple
// of 16, may be 0) with 16-byte stores into its slice of `dst` (local or a peer's), then
// publishes them as the communication kernels do and raises its uint64 flag flags[block] to
// `flag_value` with st.release.sys. fence 0: every thread fence.sc.sys (__threadfence_system),
// barrier, thread 0 fence.sc.sys + st.release.sys; 1: the same with fence.acq_rel.sys; 2:
// barrier, thread 0 st.release.sys only. Thread 0 then spins until `hold_ns` after its entry so
// that the SM clock can be read off (bounded). rec: int64 [grid][8] per block, %globaltimer /
// %clock64 pairs: entry, stores issued (after the barrier), flag raised, end of the hold.
int fence_cost(int64_t dst, int64_t bytes_per_block, int64_t flags, int64_t flag_value,
               int64_t fence, int64_t grid, int64_t hold_ns, int64_t rec, int64_t stream);

// Block start skew: a cooperative launch (as the persistent kernels) of `grid` blocks with
// `blocks_per_sm` (1..4) blocks per SM at most (shared memory reserved accordingly); thread 0 of
// each block stamps %globaltimer at entry, reads %smid and holds its SM for `hold_ns` (bounded),
// recording the smallest %globaltimer step it saw. rec: int64 [grid][4] = entry ns, SM id,
// smallest timer step (ns, 0 if none), hold ns. Fails (cudaErrorCooperativeLaunchTooLarge) if
// the grid cannot be co-resident.
int block_skew(int64_t blocks_per_sm, int64_t grid, int64_t hold_ns, int64_t rec,
               int64_t stream);

// Flag ping-pong between two blocks of this GPU with every round trip recorded: block 0 posts
// i+1 to *flag1 and waits for i+1 on *flag0, block 1 echoes (flags zero on entry). After
// `warmup` untimed round trips, block 0 keeps the %clock64 cycles of each of `iters` (1..28672)
// round trips in shared memory and writes them to samples (uint32 [iters]) at the end;
// out[kOutNs] / out[kOutCycles]: %globaltimer ns / %clock64 cycles of the timed loop.
int pingpong_samples(int64_t flag0, int64_t flag1, int64_t gpu_scope, int64_t warmup,
                     int64_t iters, int64_t timeout_ns, int64_t samples, int64_t out,
                     int64_t stream);

// cudaDeviceEnablePeerAccess(peer_device) from the current device (already enabled: success).
int enable_peer_access(int64_t peer_device);

}  // namespace probe
}  // namespace mok
