// The GEMM core of the fused layer's workers on Hopper (sm_90a): the block shape, the pipeline
// stages of 128-row x 256-column x 64-deep tiles, the bounded stage wait, the consumers' k-loop
// (wgmma over the stages, fp32 accumulators in registers) and the epilogue's accumulator staging
// in shared memory. It knows nothing of experts, tokens or the layer's tile order: the forward
// (sm90_fwd.cuh) builds its roles on it, and the backward's GEMMs are meant to.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/waits.cuh"
#include "params.h"
#include "ptx/wgmma_sm90.cuh"

namespace mok {

constexpr int kLayerThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kLayerWarps = kLayerThreads / 32;
constexpr int kTileM = 128;
constexpr int kTileN = 256;
// A stage holds one k-block: 128 bytes of every operand row (the span of the 128-byte swizzle),
// whatever the operand type; the k-depth in elements is the type's (Operand::kTileK).
constexpr int kStageRowBytes = 128;
#ifndef MOK_LAYER_STAGES
#define MOK_LAYER_STAGES 4
#endif
#ifndef MOK_EPI_BUFFERS
#define MOK_EPI_BUFFERS 1
#endif
constexpr int kStages = MOK_LAYER_STAGES;
constexpr int kStageA = kTileM * kStageRowBytes;  // 16 KiB
constexpr int kStageB = kTileN * kStageRowBytes;  // 32 KiB
constexpr int kStageBytes = kStageA + kStageB;

// Operand types of the k-loop (both operands K-major in 128-byte-swizzled stages, fp32
// accumulators): element size, the k-depth of a stage and of one wgmma, the descriptor step
// between wgmmas (16-byte units), and the two instruction widths the k-loop issues. bf16 is the
// one the layer runs; a block-scaled e4m3 type adds its instructions and a scale step here.
struct OperandBf16 {
  static constexpr int kBytes = 2;
  static constexpr int kTileK = kStageRowBytes / kBytes;  // 64
  static constexpr int kInstK = 16;
  static constexpr int kSteps = kTileK / kInstK;                // wgmmas per stage
  static constexpr int kDescStep = kInstK * kBytes / 16;        // 2
  __device__ static __forceinline__ void mma_n128(float* d, uint64_t a, uint64_t b, int acc) {
    wgmma_m64n128k16(d, a, b, acc);
  }
  // d0 | d1: B's two 128-column halves in one instruction (A read once).
  __device__ static __forceinline__ void mma_n256(float* d0, float* d1, uint64_t a, uint64_t b,
                                                  int acc) {
    wgmma_m64n256k16_t<0, 0>(d0, d1, a, b, acc);
  }
  __device__ static __forceinline__ void mma_n64(float* d, uint64_t a, uint64_t b, int acc) {
    wgmma_m64n64k16(d, a, b, acc);
  }
  // B N-major (wgmma_desc_mn; a k step is kInstK rows of 128 bytes, in 16-byte units).
  static constexpr int kDescStepMN = kInstK * kStageRowBytes / 16;  // 128
  __device__ static __forceinline__ void mma_n128_nb(float* d, uint64_t a, uint64_t b, int acc) {
    wgmma_m64n128k16_nb(d, a, b, acc);
  }
  __device__ static __forceinline__ void mma_n256_nb(float* d0, float* d1, uint64_t a,
                                                     uint64_t b, int acc) {
    wgmma_m64n256k16_t<0, 1>(d0, d1, a, b, acc);
  }
  // A M-major and B N-major (both wgmma_desc_mn): the weight gradients' operands, 256 columns.
  __device__ static __forceinline__ void mma_n256_ma_nb(float* d0, float* d1, uint64_t a,
                                                        uint64_t b, int acc) {
    wgmma_m64n256k16_t<1, 1>(d0, d1, a, b, acc);
  }
};
// One consumer warpgroup's 64 x 128 bf16 output chunk: 256-byte rows whose 16-byte chunks are
// permuted by row % 8 (the accumulator stores of 8 rows then hit 32 distinct banks).
constexpr int kEpiStride = 256;
constexpr int kEpiBytes = 64 * kEpiStride;
constexpr int kEpiBuffers = MOK_EPI_BUFFERS;  // per consumer warpgroup, used in turn

// Waits for phase `parity` of a pipeline barrier, bounded like every other wait: false when
// the block's abort flag is raised, another block aborted, or the timeout expired (recorded).
// `drain`: the producer finishing a tile after an abort; it waits for the consumers (which
// always free their stages: they wait for nothing but the producer) and gives up only on the
// timeout, so that they are never left inside a tile waiting for a stage nobody fills.
__device__ __forceinline__ bool pipe_wait(const Ctx& c, uint64_t* bar, uint32_t parity,
                                          volatile int* abort_flag, int64_t extra,
                                          bool drain = false) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (!mbar_try_wait(bar, parity)) {
    if ((++spins & 1023) == 0) {
      if (!drain && (*abort_flag || c.aborted())) return false;
      if (globaltimer_ns() - start > c.p.timeout_ns) {
        record_error(c, kErrTimeout, kWaitLayerPipeline, c.p.rank, parity, 0, extra);
        *abort_flag = 1;
        return false;
      }
    }
  }
  return true;
}

// Fast reciprocal division: no slow-path branch per element (g -> -inf gives -0, as silu does).
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

template <class T>
__device__ __forceinline__ volatile T& vol(T& x) {
  return const_cast<volatile T&>(x);
}

// Writes a warpgroup's 64 x (8 kChunks) accumulator chunk (an m64n128 or m64n64 layout) as bf16
// into its shared-memory chunk: d, or bf16(silu(d) * u) for a gate/up tile (gate columns in d,
// the matching up columns in u). kChunks: 16-byte chunks per output row (16 or 8).
template <bool kSwiGLU, int kChunks = 16>
__device__ __forceinline__ void stage_chunk(const float* d, const float* u, uint8_t* epi,
                                            int warp, int lane) {
  // Row warp * 16 + lane / 4 (+ 8): its row % 8 is lane / 4 for both halves.
  const int x = lane / 4;
  uint8_t* row = epi + (warp * 16 + x) * kEpiStride + (lane % 4) * 4;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    uint8_t* at = row + ((j ^ x) << 4);  // columns 8j..8j+7 are 16-byte chunk j of the row
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float v0 = d[4 * j + 2 * hr], v1 = d[4 * j + 2 * hr + 1];
      if (kSwiGLU) {
        v0 = silu(v0) * u[4 * j + 2 * hr];
        v1 = silu(v1) * u[4 * j + 2 * hr + 1];
      }
      *reinterpret_cast<uint32_t*>(at + hr * 8 * kEpiStride) = pack_bf16x2(v0, v1);
    }
  }
}


// Store warp: copies a staged chunk out to its rows, 16 bytes per lane per row. Lane l holds
// the destinations (at output column 0) of chunk rows l (lo) and 32 + l (hi); a pass takes
// them from there by shuffle.
template <int kChunks>
__device__ __forceinline__ void copy_chunk(uint8_t* lo, uint8_t* hi, int col,
                                           const uint8_t* epi, int lane) {
  constexpr int kRows = 32 / kChunks;  // rows per pass
#pragma unroll 8
  for (int r0 = 0; r0 < 64; r0 += kRows) {
    const int r = r0 + lane / kChunks;
    const uint64_t d = __shfl_sync(~0u, reinterpret_cast<uint64_t>(r0 < 32 ? lo : hi), r % 32);
    const int chunk = (lane % kChunks) ^ (r % 8);
    if (d != 0)
      reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(d) + col * 2)[lane % kChunks] =
          *reinterpret_cast<const uint4*>(epi + r * kEpiStride + chunk * 16);
  }
}


// The end of k-block kb of a consumer's k-loop: its MMAs committed and kept in flight; the
// previous k-block's are done once at most one group is pending, so that block's stage goes
// back to the producer now. NOTE: every consumer thread arrives (no divergent branch while MMAs
// are in flight, which would make ptxas serialise the wgmma instructions).
template <int kNumStages>
__device__ __forceinline__ void kblock_done(uint64_t* empty, int kb, int& stage, int& prev_stage,
                                            uint32_t& phase) {
  wgmma_commit();
  wgmma_wait<1>();
  if (kb > 0) mbar_arrive(&empty[prev_stage]);
  prev_stage = stage;
  if (++stage == kNumStages) stage = 0, phase ^= 1;
}

// The end of a consumer's k-loop: its last MMAs done, the last stage back to the producer.
__device__ __forceinline__ void kloop_done(uint64_t* empty, int k_blocks, int prev_stage) {
  wgmma_wait<0>();
  if (k_blocks > 0) mbar_arrive(&empty[prev_stage]);
}

// One tile's k-loop for consumer warpgroup wg, over the pipeline stages (stage, prev_stage and
// phase carry on from tile to tile):
//   kFull:       rows wg * 64.. of the 128-row tile, all 256 columns: two m64n128 MMAs per k
//                step (acc0: columns 0..127, acc1: 128..255);
//   kHalfGateUp: rows 64h.. (a 64-row sub-tile), warpgroup wg's 64 gate and 64 up columns: two
//                m64n64 MMAs (acc0[0..31] gate, acc0[32..63] up);
//   kHalfDown:   rows 64h.., warpgroup wg's 128 of the 256 columns: one m64n128 (acc0);
//   kFullNB:     rows wg * 64.., 128 columns of an N-major B (two 64-column boxes of
//                kTileK rows after A): one m64n128 (acc0);
//   kFullNBWide: the same over 256 columns (four boxes): one m64n256 (acc0 | acc1).
// kNumStages: the pipeline's stages (the layer's kStages unless a kernel needs the memory).
// kStride: the bytes from one stage to the next (kStageBytes unless a kernel's stages are
// smaller). kWide (kFull only): each k step as one m64n256 (A read from shared memory once, not
// once per 128-column half) where the kernel's registers allow it; the fused forward's consumers
// do not (ptxas serialises its wgmma, C7511). kProxyFence: a proxy fence after each stage's wait,
// for stages that cp.async (generic proxy) filled in part.
enum KLoop : int { kFull = 0, kHalfGateUp, kHalfDown, kFullNB, kFullNBWide };
constexpr int kBoxNB = 64 * kStageRowBytes;  // one 64-column box of 64 k-rows, N-major

template <class Op, int kMode, int kNumStages = kStages, bool kWide = false,
          int kStride = kStageBytes, bool kProxyFence = false>
__device__ __forceinline__ void mma_kloop(float (&acc0)[64], float (&acc1)[64], uint8_t* stages,
                                          uint64_t* full, uint64_t* empty, int k_blocks, int h,
                                          int wg, int& stage, int& prev_stage, uint32_t& phase) {
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbar_wait(&full[stage], phase);  // the producer completes every stage, even on abort
    if (kProxyFence) fence_proxy_async_shared();
    const uint8_t* sa = stages + stage * kStride;
    const uint64_t da =
        wgmma_desc(sa + ((kMode == kFull || kMode >= kFullNB) ? wg : h) * 64 * 128);
    if (kMode == kFullNBWide) {
      const uint64_t db = wgmma_desc_mn(sa + kStageA, kBoxNB);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Op::kSteps; ++kk) {
        const int accum = (kb > 0 || kk > 0) ? 1 : 0;
        Op::mma_n256_nb(acc0, acc1, da + Op::kDescStep * kk, db + Op::kDescStepMN * kk, accum);
      }
    } else if (kMode == kFullNB) {
      const uint64_t db = wgmma_desc_mn(sa + kStageA, kBoxNB);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Op::kSteps; ++kk) {
        const int accum = (kb > 0 || kk > 0) ? 1 : 0;
        Op::mma_n128_nb(acc0, da + Op::kDescStep * kk, db + Op::kDescStepMN * kk, accum);
      }
    } else if (kMode == kFull) {
      const uint64_t db0 = wgmma_desc(sa + kStageA);
      const uint64_t db1 = wgmma_desc(sa + kStageA + 128 * 128);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Op::kSteps; ++kk) {
        const int accum = (kb > 0 || kk > 0) ? 1 : 0;
        if (kWide) {  // B's 256 rows are contiguous: db0 spans both halves
          Op::mma_n256(acc0, acc1, da + Op::kDescStep * kk, db0 + Op::kDescStep * kk, accum);
        } else {
          Op::mma_n128(acc0, da + Op::kDescStep * kk, db0 + Op::kDescStep * kk, accum);
          Op::mma_n128(acc1, da + Op::kDescStep * kk, db1 + Op::kDescStep * kk, accum);
        }
      }
    } else if (kMode == kHalfGateUp) {
      wgmma_fence();
      const uint64_t dg = wgmma_desc(sa + kStageA + wg * 64 * 128);
      const uint64_t du = wgmma_desc(sa + 2 * kStageA + wg * 64 * 128);
#pragma unroll
      for (int kk = 0; kk < Op::kSteps; ++kk) {
        const int accum = (kb > 0 || kk > 0) ? 1 : 0;
        Op::mma_n64(acc0, da + Op::kDescStep * kk, dg + Op::kDescStep * kk, accum);
        Op::mma_n64(acc0 + 32, da + Op::kDescStep * kk, du + Op::kDescStep * kk, accum);
      }
    } else {
      wgmma_fence();
      const uint64_t db = wgmma_desc(sa + kStageA + wg * 128 * 128);
#pragma unroll
      for (int kk = 0; kk < Op::kSteps; ++kk) {
        const int accum = (kb > 0 || kk > 0) ? 1 : 0;
        Op::mma_n128(acc0, da + Op::kDescStep * kk, db + Op::kDescStep * kk, accum);
      }
    }
    kblock_done<kNumStages>(empty, kb, stage, prev_stage, phase);
  }
  kloop_done(empty, k_blocks, prev_stage);
}

// One tile's k-loop of a weight gradient C = A^T B, the k axis along the rows of A and B: A
// M-major (two 64-column boxes of kTileK rows per stage, warpgroup wg's 64 M rows in box wg), B
// N-major (four 64-column boxes after A, one m64n256 per step: acc0 gets columns 0..127, acc1
// 128..255). The last k-block runs `last_steps` of its kSteps 16-row steps; the others multiply
// zeros (descriptors zero_a / zero_b, selected without a branch), so rows past a group's end add
// nothing.
template <class Op, int kNumStages, bool kProxyFence = false>
__device__ __forceinline__ void mma_kloop_wgrad(float (&acc0)[64], float (&acc1)[64],
                                                uint8_t* stages, uint64_t* full, uint64_t* empty,
                                                int k_blocks, int last_steps, uint64_t zero_a,
                                                uint64_t zero_b, int wg, int& stage,
                                                int& prev_stage, uint32_t& phase) {
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbar_wait(&full[stage], phase);
    if (kProxyFence) fence_proxy_async_shared();
    const uint8_t* sa = stages + stage * kStageBytes;
    const uint64_t da = wgmma_desc_mn(sa + wg * kBoxNB, kBoxNB);
    const uint64_t db = wgmma_desc_mn(sa + kStageA, kBoxNB);  // four boxes, kBoxNB apart
    const int steps = kb == k_blocks - 1 ? last_steps : Op::kSteps;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Op::kSteps; ++kk) {
      const int accum = (kb > 0 || kk > 0) ? 1 : 0;
      const bool live = kk < steps;
      const uint64_t a = live ? da + Op::kDescStepMN * kk : zero_a;
      Op::mma_n256_ma_nb(acc0, acc1, a, live ? db + Op::kDescStepMN * kk : zero_b, accum);
    }
    kblock_done<kNumStages>(empty, kb, stage, prev_stage, phase);
  }
  kloop_done(empty, k_blocks, prev_stage);
}

}  // namespace mok
