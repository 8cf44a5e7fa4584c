// Microbenchmark kernels behind `python -m mok.bench probe`: the peer-copy engines (16-byte
// vector copies, TMA bulk copies), HBM reads, flag ping-pong latency, dependent-load latency and
// the push-signalling costs (flag polling, release fences, block start skew, the distribution of
// flag round trips).
// The simulator's GPU profile (sim/app/calibrate.py) is fitted from what they measure.
//
// Includes only CUDA and csrc/ headers (CI compile-checks it for sm_90a and sm_100a). The PTX
// wrappers come from ptx/tma.cuh (mbarrier, cp.async.bulk) and ptx/sync.cuh (%globaltimer,
// system-scope release/acquire), so the probe measures the same instructions the communication
// kernels use.
//
// NOTE: every kernel that must own its SM (the copies, the ping-pong blocks) reserves more than
// half of an SM's shared memory, so two of its blocks never share an SM: `grid` blocks = `grid`
// SMs, which is the x axis of every bandwidth-vs-SMs curve.
#include <cuda_runtime.h>

#include <cstdint>

#include "probe/probe.h"
#include "ptx/sync.cuh"
#include "ptx/tma.cuh"

namespace mok {
namespace probe {

namespace {

constexpr int kCopyThreads = 1024;
constexpr int kReadThreads = 1024;
constexpr int kOneSmPerBlockSmem = 120 * 1024;  // > half of the 228 KiB of an sm_90/sm_100 SM
constexpr int kMaxInflight = 16;
// Bulk-store groups allowed to still read shared memory: waiting for each store's read before
// the next load (a lag of 1) capped 2 KiB chunks at ~7 GB/s per SM on an H200, latency-bound
// on the store side rather than on the loads this probe is meant to measure.
constexpr int kStoreLag = 4;
constexpr int kMaxSmem = 220 * 1024;  // under the 227 KiB per-block opt-in limit (sm_90, sm_100)

__device__ __forceinline__ void report_timeout(int64_t* out, int64_t iter, int64_t seen,
                                               int64_t expected) {
  // NOTE: the first timeout wins; later ones are usually its cascade (the partner of a stuck
  // block). The host reads the record after the kernel ended, so no fence is needed.
  auto* code = reinterpret_cast<unsigned long long*>(out + kOutCode);
  if (atomicCAS(code, 0ull, static_cast<unsigned long long>(kProbeTimeout)) == 0ull) {
    out[kOutIter] = iter;
    out[kOutSeen] = seen;
    out[kOutExpected] = expected;
    out[kOutBlock] = blockIdx.x;
  }
}

// ---- 16-byte vector copy ----------------------------------------------------------------------
__global__ void __launch_bounds__(kCopyThreads)
    copy_vector_kernel(int4* __restrict__ dst, const int4* __restrict__ src, int64_t n16) {
  // NOTE: one int4 in flight per thread, 16 KiB per SM: the method of the committed probe
  // (mok/bench/results/h200x2-probe-2026-11-29.json), so new probes stay comparable with it.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16;
       i += stride)
    dst[i] = src[i];
}

// ---- TMA bulk copy ----------------------------------------------------------------------------
__device__ __forceinline__ bool mbar_wait_bounded(uint64_t* bar, uint32_t parity,
                                                  uint64_t timeout_ns) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (globaltimer_ns() - start > timeout_ns) return false;
  }
  return true;
}

__global__ void __launch_bounds__(32)
    copy_tma_kernel(uint8_t* dst, const uint8_t* src, int64_t bytes, int64_t chunk, int inflight,
                    uint64_t timeout_ns, int64_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t full[kMaxInflight + kStoreLag];
  if (threadIdx.x != 0) return;  // one thread drives the ring
  // Ring of inflight + kStoreLag stages: `inflight` loads are outstanding while up to kStoreLag
  // stages are still read by their bulk stores.
  const int ring = inflight + kStoreLag;
  for (int s = 0; s < ring; ++s) mbar_init(&full[s], 1);
  mbar_init_fence();
  const int64_t num_chunks = (bytes + chunk - 1) / chunk;
  const int64_t b = blockIdx.x, g = gridDim.x;
  const int64_t n = num_chunks > b ? (num_chunks - b + g - 1) / g : 0;
  auto offset = [&](int64_t j) { return (b + j * g) * chunk; };
  auto length = [&](int64_t j) {
    const int64_t left = bytes - offset(j);
    return static_cast<uint32_t>(left < chunk ? left : chunk);
  };
  auto load = [&](int64_t j) {
    const int s = static_cast<int>(j % ring);
    mbar_arrive_expect_tx(&full[s], length(j));
    bulk_load(smem + s * chunk, src + offset(j), length(j), &full[s]);
  };
  for (int64_t j = 0; j < n && j < ring; ++j) load(j);
  for (int64_t j = 0; j < n; ++j) {
    const int s = static_cast<int>(j % ring);
    const uint32_t parity = static_cast<uint32_t>((j / ring) & 1);
    if (!mbar_wait_bounded(&full[s], parity, timeout_ns)) {
      // NOTE: a bulk load that never completes means the source mapping is broken; leave with
      // the record rather than hang (the host reports it and stops the probe).
      report_timeout(out, j, -1, parity);
      return;
    }
    bulk_store(dst + offset(j), smem + s * chunk, length(j));
    bulk_commit();
    // Every store group but the kStoreLag newest has read its stage: refill the stage of chunk
    // j - kStoreLag with the chunk `ring` further on.
    bulk_wait_read<kStoreLag>();
    if (j >= kStoreLag && j - kStoreLag + ring < n) load(j - kStoreLag + ring);
  }
  bulk_wait_all();
}

// ---- HBM read ---------------------------------------------------------------------------------
__global__ void __launch_bounds__(kReadThreads)
    read_kernel(const int4* __restrict__ src, int64_t n16, int64_t* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int acc = 0;
  // Four independent 16-byte loads per thread in flight (no further unrolling: it spills on
  // sm_100 under the 64-register cap of 1024-thread blocks).
#pragma unroll 1
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
  }
#pragma unroll 1
  for (; i < n16; i += stride) {
    const int4 a = src[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  // NOTE: a data-dependent store the compiler cannot prove dead keeps every load alive.
  if (acc == 0x5eed1234) out[kOutSink] = acc;
}

// ---- flag ping-pong ---------------------------------------------------------------------------
__device__ __forceinline__ uint64_t ld_acquire_gpu_u64(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu_u64(uint64_t* ptr, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

template <bool kGpuScope>
__device__ __forceinline__ uint64_t load_flag(const uint64_t* p) {
  return kGpuScope ? ld_acquire_gpu_u64(p) : ld_acquire_sys(p);
}

// The ping-pong's bounded wait: spins until *flag >= v; false, with the timeout of iteration
// `iter` reported in `out`, once timeout_ns pass first.
template <bool kGpuScope>
__device__ __forceinline__ bool wait_flag_at_least(const uint64_t* flag, uint64_t v,
                                                   uint64_t timeout_ns, int64_t* out,
                                                   int64_t iter) {
  uint64_t seen = load_flag<kGpuScope>(flag);
  if (seen >= v) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while ((seen = load_flag<kGpuScope>(flag)) < v) {
    if ((++spins & 255) == 0 && globaltimer_ns() - start > timeout_ns) {
      report_timeout(out, iter, static_cast<int64_t>(seen), static_cast<int64_t>(v));
      return false;
    }
  }
  return true;
}
template <bool kGpuScope>
__device__ __forceinline__ void store_flag(uint64_t* p, uint64_t v) {
  if (kGpuScope)
    st_release_gpu_u64(p, v);
  else
    st_release_sys(p, v);
}

template <bool kGpuScope>
__global__ void pingpong_kernel(uint64_t* wait0, uint64_t* post0, uint64_t* wait1,
                                uint64_t* post1, int ping_block, int64_t warmup, int64_t iters,
                                uint64_t base, uint64_t timeout_ns, int64_t* out) {
  if (threadIdx.x != 0) return;
  uint64_t* wait = blockIdx.x == 0 ? wait0 : wait1;
  uint64_t* post = blockIdx.x == 0 ? post0 : post1;
  const bool ping = static_cast<int>(blockIdx.x) == ping_block;
  const int64_t total = warmup + iters;
  uint64_t t0 = globaltimer_ns();
  for (int64_t i = 0; i < total; ++i) {
    if (i == warmup) t0 = globaltimer_ns();
    const uint64_t v = base + static_cast<uint64_t>(i) + 1;
    if (ping) store_flag<kGpuScope>(post, v);
    if (!wait_flag_at_least<kGpuScope>(wait, v, timeout_ns, out, i)) return;
    if (!ping) store_flag<kGpuScope>(post, v);
  }
  if (ping) out[kOutNs] = static_cast<int64_t>(globaltimer_ns() - t0);
}

// ---- dependent loads --------------------------------------------------------------------------
__device__ __forceinline__ uint64_t ld_cv_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.global.cv.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__global__ void chase_kernel(const uint64_t* buf, int64_t start, int64_t warmup, int64_t loads,
                             int64_t* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  uint64_t idx = static_cast<uint64_t>(start);
  for (int64_t i = 0; i < warmup; ++i) idx = ld_cv_u64(buf + idx);
  const uint64_t t0 = globaltimer_ns();
  for (int64_t i = 0; i < loads; ++i) idx = ld_cv_u64(buf + idx);
  const uint64_t t1 = globaltimer_ns();
  out[kOutNs] = static_cast<int64_t>(t1 - t0);
  out[kOutSink] = static_cast<int64_t>(idx);
}

// ---- push signalling --------------------------------------------------------------------------
constexpr int kPollMaxFlags = 128;
constexpr int kFenceThreads = 1024;
constexpr int kFenceRecWords = 8;
constexpr int kSkewThreads = 128;
constexpr int kSkewRecWords = 4;
constexpr int kMaxJitterSamples = 28672;        // 112 KiB of uint32 in the reserved 120 KiB
constexpr uint64_t kHoldMaxSpins = 1ull << 24;  // bound of the hold loops besides their time

__device__ __forceinline__ uint64_t clock_cycles() {
  uint64_t c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
  return c;
}
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// Spins until %globaltimer is `hold_ns` past `start` (or kHoldMaxSpins reads); returns the last
// read and the smallest non-zero step between consecutive reads (0 if none) in *step.
__device__ __forceinline__ uint64_t hold_until(uint64_t start, uint64_t hold_ns, uint64_t* step) {
  uint64_t prev = globaltimer_ns(), now = prev, best = 0;
  for (uint64_t spin = 0; now - start < hold_ns && spin < kHoldMaxSpins; ++spin) {
    now = globaltimer_ns();
    if (now != prev) {
      if (best == 0 || now - prev < best) best = now - prev;
      prev = now;
    }
  }
  *step = best;
  return now;
}

// kMode 0: one warp (lane l polls flags l, l + 32, ...); 1: thread 0 polls all k in turn; 2: one
// thread per flag. Every sweep loads each flag once; no wait (the flags are already set).
template <bool kGpuScope, int kMode>
__global__ void poll_kernel(const uint64_t* flags, int k, uint64_t target, int64_t warmup,
                            int64_t sweeps, int64_t* out) {
  const int t = static_cast<int>(threadIdx.x);
  if (kMode == 1 && t != 0) return;
  int64_t missed = 0;
  uint64_t t0 = globaltimer_ns();
  for (int64_t s = 0; s < warmup + sweeps; ++s) {
    if (s == warmup) {
      if (kMode == 2) __syncthreads();
      t0 = globaltimer_ns();
    }
    bool ok = true;
    if (kMode == 0) {
      for (int j = t; j < k; j += 32) ok = (load_flag<kGpuScope>(flags + j) >= target) && ok;
      ok = __all_sync(0xffffffffu, ok) != 0;
    } else if (kMode == 1) {
      for (int j = 0; j < k; ++j) ok = (load_flag<kGpuScope>(flags + j) >= target) && ok;
    } else {
      if (t < k) ok = load_flag<kGpuScope>(flags + t) >= target;
      ok = __syncthreads_and(ok) != 0;
    }
    missed += ok ? 0 : 1;
  }
  if (t == 0) {
    out[kOutNs] = static_cast<int64_t>(globaltimer_ns() - t0);
    out[kOutSink] = missed;
  }
}

// kFence 0: fence.sc.sys (as __threadfence_system in common/waits.cuh), 1: fence.acq_rel.sys,
// 2: none (thread 0's st.release.sys alone).
template <int kFence>
__device__ __forceinline__ void release_fence() {
  if (kFence == 0) __threadfence_system();
  if (kFence == 1) fence_acq_rel_sys();
}

template <int kFence>
__global__ void __launch_bounds__(kFenceThreads)
    fence_kernel(int4* dst, int64_t n16, uint64_t* flags, uint64_t flag_value, uint64_t hold_ns,
                 int64_t* rec) {
  const int t = static_cast<int>(threadIdx.x);
  uint64_t g0 = 0, c0 = 0;
  if (t == 0) {
    g0 = globaltimer_ns();
    c0 = clock_cycles();
  }
  __syncthreads();
  int4* mine = dst + static_cast<int64_t>(blockIdx.x) * n16;
  const int4 v = make_int4(static_cast<int>(blockIdx.x), t, 0x5eed, 1);
  for (int64_t i = t; i < n16; i += kFenceThreads) mine[i] = v;
  // Every store of the block is issued; what the fence waits for is still in flight.
  __syncthreads();
  uint64_t g1 = 0, c1 = 0;
  if (t == 0) {
    g1 = globaltimer_ns();
    c1 = clock_cycles();
  }
  release_fence<kFence>();
  __syncthreads();
  if (t != 0) return;
  release_fence<kFence>();
  st_release_sys(flags + blockIdx.x, flag_value);
  const uint64_t c2 = clock_cycles();
  const uint64_t g2 = globaltimer_ns();
  uint64_t step = 0;
  const uint64_t g3 = hold_until(g0, hold_ns, &step);
  const uint64_t c3 = clock_cycles();
  int64_t* r = rec + static_cast<int64_t>(blockIdx.x) * kFenceRecWords;
  const uint64_t vals[kFenceRecWords] = {g0, c0, g1, c1, g2, c2, g3, c3};
  for (int j = 0; j < kFenceRecWords; ++j) r[j] = static_cast<int64_t>(vals[j]);
}

__global__ void __launch_bounds__(kSkewThreads) skew_kernel(uint64_t hold_ns, int64_t* rec) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = globaltimer_ns();
  const uint32_t sm = sm_id();
  uint64_t step = 0;
  const uint64_t t1 = hold_until(t0, hold_ns, &step);
  int64_t* r = rec + static_cast<int64_t>(blockIdx.x) * kSkewRecWords;
  r[0] = static_cast<int64_t>(t0);
  r[1] = static_cast<int64_t>(sm);
  r[2] = static_cast<int64_t>(step);
  r[3] = static_cast<int64_t>(t1 - t0);
}

template <bool kGpuScope>
__global__ void pingpong_samples_kernel(uint64_t* flag0, uint64_t* flag1, int64_t warmup,
                                        int64_t iters, uint64_t timeout_ns, uint32_t* samples,
                                        int64_t* out) {
  extern __shared__ uint32_t cycles[];  // [iters], block 0
  if (threadIdx.x != 0) return;
  const bool ping = blockIdx.x == 0;
  uint64_t* wait = ping ? flag0 : flag1;
  uint64_t* post = ping ? flag1 : flag0;
  const int64_t total = warmup + iters;
  uint64_t g0 = globaltimer_ns(), c0 = clock_cycles(), prev = c0;
  for (int64_t i = 0; i < total; ++i) {
    if (ping && i == warmup) {
      g0 = globaltimer_ns();
      c0 = clock_cycles();
      prev = c0;
    }
    const uint64_t v = static_cast<uint64_t>(i) + 1;
    if (ping) store_flag<kGpuScope>(post, v);
    if (!wait_flag_at_least<kGpuScope>(wait, v, timeout_ns, out, i)) return;
    if (!ping) {
      store_flag<kGpuScope>(post, v);
    } else if (i >= warmup) {
      const uint64_t c = clock_cycles();
      const uint64_t d = c - prev;
      cycles[i - warmup] = d > 0xffffffffull ? 0xffffffffu : static_cast<uint32_t>(d);
      prev = c;
    }
  }
  if (!ping) return;
  out[kOutCycles] = static_cast<int64_t>(prev - c0);
  out[kOutNs] = static_cast<int64_t>(globaltimer_ns() - g0);
  for (int64_t j = 0; j < iters; ++j) samples[j] = cycles[j];
}

template <typename Kernel>
cudaError_t reserve_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

cudaStream_t as_stream(int64_t s) { return reinterpret_cast<cudaStream_t>(s); }
template <typename T>
T* as_ptr(int64_t p) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

}  // namespace

int copy_vector(int64_t dst, int64_t src, int64_t bytes, int64_t grid, int64_t stream) {
  if (bytes <= 0 || bytes % 16 || grid <= 0 || (dst | src) % 16)
    return static_cast<int>(cudaErrorInvalidValue);
  cudaError_t e = reserve_smem(copy_vector_kernel, kOneSmPerBlockSmem);
  if (e != cudaSuccess) return static_cast<int>(e);
  copy_vector_kernel<<<static_cast<unsigned>(grid), kCopyThreads, kOneSmPerBlockSmem,
                       as_stream(stream)>>>(as_ptr<int4>(dst), as_ptr<const int4>(src),
                                            bytes / 16);
  return static_cast<int>(cudaGetLastError());
}

int copy_tma(int64_t dst, int64_t src, int64_t bytes, int64_t chunk_bytes, int64_t inflight,
             int64_t grid, int64_t timeout_ns, int64_t out, int64_t stream) {
  const int64_t smem_ring = (inflight + kStoreLag) * chunk_bytes;
  if (bytes <= 0 || bytes % 16 || chunk_bytes <= 0 || chunk_bytes % 16 || inflight < 1 ||
      inflight > kMaxInflight || smem_ring > kMaxSmem || grid <= 0 || (dst | src) % 16)
    return static_cast<int>(cudaErrorInvalidValue);
  const int smem =
      static_cast<int>(smem_ring > kOneSmPerBlockSmem ? smem_ring : kOneSmPerBlockSmem);
  cudaError_t e = reserve_smem(copy_tma_kernel, smem);
  if (e != cudaSuccess) return static_cast<int>(e);
  copy_tma_kernel<<<static_cast<unsigned>(grid), 32, smem, as_stream(stream)>>>(
      as_ptr<uint8_t>(dst), as_ptr<const uint8_t>(src), bytes, chunk_bytes,
      static_cast<int>(inflight), static_cast<uint64_t>(timeout_ns), as_ptr<int64_t>(out));
  return static_cast<int>(cudaGetLastError());
}

int read_bandwidth(int64_t src, int64_t bytes, int64_t grid, int64_t out, int64_t stream) {
  if (bytes <= 0 || bytes % 64 || grid <= 0 || src % 16)
    return static_cast<int>(cudaErrorInvalidValue);
  read_kernel<<<static_cast<unsigned>(grid), kReadThreads, 0, as_stream(stream)>>>(
      as_ptr<const int4>(src), bytes / 16, as_ptr<int64_t>(out));
  return static_cast<int>(cudaGetLastError());
}

int pingpong(int64_t wait0, int64_t post0, int64_t wait1, int64_t post1, int64_t grid,
             int64_t ping_block, int64_t gpu_scope, int64_t warmup, int64_t iters, int64_t base,
             int64_t timeout_ns, int64_t out, int64_t stream) {
  if (grid < 1 || grid > 2 || ping_block < -1 || ping_block >= grid || warmup < 0 || iters < 1 ||
      base < 0)
    return static_cast<int>(cudaErrorInvalidValue);
  auto kernel = gpu_scope ? pingpong_kernel<true> : pingpong_kernel<false>;
  cudaError_t e = reserve_smem(kernel, kOneSmPerBlockSmem);
  if (e != cudaSuccess) return static_cast<int>(e);
  kernel<<<static_cast<unsigned>(grid), 32, kOneSmPerBlockSmem, as_stream(stream)>>>(
      as_ptr<uint64_t>(wait0), as_ptr<uint64_t>(post0), as_ptr<uint64_t>(wait1),
      as_ptr<uint64_t>(post1), static_cast<int>(ping_block), warmup, iters,
      static_cast<uint64_t>(base), static_cast<uint64_t>(timeout_ns), as_ptr<int64_t>(out));
  return static_cast<int>(cudaGetLastError());
}

int chase(int64_t buf, int64_t start, int64_t warmup, int64_t loads, int64_t out,
          int64_t stream) {
  if (start < 0 || warmup < 0 || loads < 1 || buf % 8) return static_cast<int>(cudaErrorInvalidValue);
  chase_kernel<<<1, 32, 0, as_stream(stream)>>>(as_ptr<const uint64_t>(buf), start, warmup, loads,
                                                 as_ptr<int64_t>(out));
  return static_cast<int>(cudaGetLastError());
}

int poll_flags(int64_t flags, int64_t k, int64_t mode, int64_t gpu_scope, int64_t target,
               int64_t warmup, int64_t sweeps, int64_t out, int64_t stream) {
  if (k < 1 || k > kPollMaxFlags || mode < 0 || mode > 2 || warmup < 0 || sweeps < 1 ||
      flags % 8)
    return static_cast<int>(cudaErrorInvalidValue);
  using Kernel = void (*)(const uint64_t*, int, uint64_t, int64_t, int64_t, int64_t*);
  const Kernel kernels[2][3] = {
      {poll_kernel<false, 0>, poll_kernel<false, 1>, poll_kernel<false, 2>},
      {poll_kernel<true, 0>, poll_kernel<true, 1>, poll_kernel<true, 2>}};
  const unsigned threads = mode == 2 ? static_cast<unsigned>((k + 31) / 32 * 32) : 32u;
  kernels[gpu_scope ? 1 : 0][mode]<<<1, threads, 0, as_stream(stream)>>>(
      as_ptr<const uint64_t>(flags), static_cast<int>(k), static_cast<uint64_t>(target), warmup,
      sweeps, as_ptr<int64_t>(out));
  return static_cast<int>(cudaGetLastError());
}

int fence_cost(int64_t dst, int64_t bytes_per_block, int64_t flags, int64_t flag_value,
               int64_t fence, int64_t grid, int64_t hold_ns, int64_t rec, int64_t stream) {
  if (bytes_per_block < 0 || bytes_per_block % 16 || fence < 0 || fence > 2 || grid < 1 ||
      hold_ns < 0 || dst % 16 || flags % 8)
    return static_cast<int>(cudaErrorInvalidValue);
  auto kernel = fence == 0 ? fence_kernel<0> : fence == 1 ? fence_kernel<1> : fence_kernel<2>;
  cudaError_t e = reserve_smem(kernel, kOneSmPerBlockSmem);
  if (e != cudaSuccess) return static_cast<int>(e);
  kernel<<<static_cast<unsigned>(grid), kFenceThreads, kOneSmPerBlockSmem, as_stream(stream)>>>(
      as_ptr<int4>(dst), bytes_per_block / 16, as_ptr<uint64_t>(flags),
      static_cast<uint64_t>(flag_value), static_cast<uint64_t>(hold_ns), as_ptr<int64_t>(rec));
  return static_cast<int>(cudaGetLastError());
}

int block_skew(int64_t blocks_per_sm, int64_t grid, int64_t hold_ns, int64_t rec,
               int64_t stream) {
  // Dynamic shared memory per block that lets exactly `blocks_per_sm` blocks share an SM
  // (228 KiB per SM, 1 KiB reserved per block on sm_90 / sm_100).
  constexpr int kSmemKiB[4] = {120, 100, 64, 50};
  if (blocks_per_sm < 1 || blocks_per_sm > 4 || grid < 1 || hold_ns < 0)
    return static_cast<int>(cudaErrorInvalidValue);
  const int smem = kSmemKiB[blocks_per_sm - 1] * 1024;
  cudaError_t e = reserve_smem(skew_kernel, smem);
  // The largest shared-memory carveout, so that blocks_per_sm blocks do fit on one SM.
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(skew_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             static_cast<int>(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return static_cast<int>(e);
  uint64_t hold = static_cast<uint64_t>(hold_ns);
  int64_t* rec_ptr = as_ptr<int64_t>(rec);
  void* args[] = {&hold, &rec_ptr};
  // NOTE: cooperative, as the persistent kernels (common/launch.cuh): all blocks co-resident.
  e = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(skew_kernel),
                                  dim3(static_cast<unsigned>(grid)), dim3(kSkewThreads), args,
                                  static_cast<size_t>(smem), as_stream(stream));
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) cudaGetLastError();  // a refused launch leaves its error behind
  return static_cast<int>(e);
}

int pingpong_samples(int64_t flag0, int64_t flag1, int64_t gpu_scope, int64_t warmup,
                     int64_t iters, int64_t timeout_ns, int64_t samples, int64_t out,
                     int64_t stream) {
  if (warmup < 0 || iters < 1 || iters > kMaxJitterSamples || (flag0 | flag1) % 8 || samples % 4)
    return static_cast<int>(cudaErrorInvalidValue);
  auto kernel = gpu_scope ? pingpong_samples_kernel<true> : pingpong_samples_kernel<false>;
  cudaError_t e = reserve_smem(kernel, kOneSmPerBlockSmem);
  if (e != cudaSuccess) return static_cast<int>(e);
  kernel<<<2, 32, kOneSmPerBlockSmem, as_stream(stream)>>>(
      as_ptr<uint64_t>(flag0), as_ptr<uint64_t>(flag1), warmup, iters,
      static_cast<uint64_t>(timeout_ns), as_ptr<uint32_t>(samples), as_ptr<int64_t>(out));
  return static_cast<int>(cudaGetLastError());
}

int enable_peer_access(int64_t peer_device) {
  cudaError_t e = cudaDeviceEnablePeerAccess(static_cast<int>(peer_device), 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) e = cudaSuccess;
  cudaGetLastError();  // neither outcome may linger as the thread's last error
  return static_cast<int>(e);
}

}  // namespace probe
}  // namespace mok
