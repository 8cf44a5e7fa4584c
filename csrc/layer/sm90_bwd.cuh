// The experts' backward on Hopper (sm_90a), first kernel on the GEMM core: the down
// projection's dgrad and the gate/up GEMM recomputed per expert group, with the SwiGLU backward
// in the epilogue.
//
// Per expert e (rows [start_e, end_e) of `a` and `dy`, grouped as the receive buffer holds
// them):
//   dh      = dy @ w_down[e]                     (fp32 accumulators, kept in shared memory)
//   [g | u] = a @ w_gate_up[e]^T                 (fp32 accumulators, never stored)
//   h       = silu(g) * u
//   hw      = bf16(row_w * h)                    -> hw     (the down projection's wgrad input:
//                                                           dW_down = dy^T hw)
//   dh_w    = row_w * dh
//   dg      = bf16(dh_w * u * silu'(g))          -> dgu[:, :I]
//   du      = bf16(dh_w * silu(g))               -> dgu[:, I:]
//   part[n, r] = sum over the tile's 128 columns of bf16(h) * dh (the router-weight gradient of
//                row r is the fixed-order sum over n of these partials)
// Tiles of 128 rows x 128 intermediate columns of one expert (a dh k-loop over H with w_down
// N-major, then a gate/up k-loop over H of 128 gate + 128 up columns), in the order (expert, column
// block, row block): the row blocks of one expert's column block run side by side, so its
// weights come from HBM once. Each block takes tile blockIdx.x first, then either the next one
// from a counter (the dh-only modes) or blockIdx.x + gridDim.x, ... (BwdPipe::kClaim); a tile's
// bits depend only on its inputs (no atomic adds to outputs, no split-K), so any grid and any
// claiming order give the same result. Rows of a tile past its expert's end are computed and
// dropped.
//
// Roles per block (384 threads): one producer thread (TMA loads of the stages), two consumer
// warpgroups, each running wgmma on 64 of the tile's rows and writing its epilogue straight to
// global memory (the saving forward's through shared memory and TMA stores, save_epilogue). The
// gathering variants (kGather: at one rank, rows read from the tokens instead of a dispatched
// copy) run the producer on the whole first warpgroup (bwd_producer_gather).
// Waits are on this block's own pipeline barriers only (nothing waits for another block), so
// none can stall unless the kernel itself is broken.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/rows.cuh"
#include "layer/sm90_gemm.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma_sm90.cuh"

namespace mok {

// Expert groups a launch supports (their tile counts live in shared memory).
constexpr int kBwdMaxExperts = 1024;
// The recomputing backward: three stages, and the tile's fp32 dh (128 rows x 128 columns, one
// float per accumulator of the two consumer warpgroups) where a fourth would be. (BwdPipe below:
// the other modes' stages.)
constexpr int kBwdStages = 3;
constexpr int kBwdDhBytes = kTileM * 128 * 4;
constexpr int kBwdMaxStages = 6;

// What a launch of swiglu_bwd_kernel computes: kSwigluRecompute the backward above; kSwigluSave a
// forward that keeps g / u (gate / up GEMM only; h and the fp32 [g | u] out, or h only where gu32
// is null: the forward of a layer that recomputes them); kSwigluSaved the
// backward from those (the dh GEMM only; g / u read back).
// kSwigluSavedWide (internal, chosen by the launcher for kSwigluSaved where I is a multiple of
// 256): the same with tiles of 128 rows x 256 columns, one m64n256 per k step (the 128-column
// tile's two warpgroups each read the same B: 156 bytes of shared memory per clock at the MMA
// rate against 128 available, and A comes from L2 twice as often).
enum SwigluMode : int {
  kSwigluRecompute = 0,
  kSwigluSave = 1,
  kSwigluSaved = 2,
  kSwigluSavedWide = 3
};
// Whether a mode runs only the dh k-loop (g / u read back), and its tiles' intermediate columns.
__host__ __device__ constexpr bool dh_only(int mode) {
  return mode == kSwigluSaved || mode == kSwigluSavedWide;
}
__host__ __device__ constexpr int tile_cols(int mode) {
  return mode == kSwigluSavedWide ? 256 : 128;
}
// A tile's k-blocks in a mode: dh's [0, k_blocks), then gate / up's [k_blocks, 2 k_blocks); a
// saving forward runs only gate / up's, a backward from saved g / u only dh's.
__host__ __device__ constexpr int first_kblock(int mode, int k_blocks) {
  return mode == kSwigluSave ? k_blocks : 0;
}
__host__ __device__ constexpr int end_kblock(int mode, int k_blocks) {
  return dh_only(mode) ? k_blocks : 2 * k_blocks;
}

// The pipeline of each mode. A backward from saved g / u runs only the dh k-loop, whose stages
// are 32 KiB (dy's 128 rows, w_down's 128 columns as two N-major boxes), and parks no dh, so six
// fit: with five loads in flight the w_down stream from HBM stays ahead of the MMAs (three
// stages, two in flight, held it at ~320 TFLOP/s). The other modes keep three 48 KiB stages and
// the dh memory. (A saving forward with four stages and the wide gate / up step ran Kimi-K2's
// per-rank forward 1.4 ms slower, 9.45 against 8.02 ms; docs/perf-notes.md.) kWide: gate / up
// as one m64n256 per k step, in the recomputing backward only.
template <int kMode>
struct BwdPipe {
  static constexpr int kNumStages =
      kMode == kSwigluSaved ? kBwdMaxStages : (kMode == kSwigluSavedWide ? 4 : kBwdStages);
  static constexpr int kStride = kMode == kSwigluSaved ? kStageA + 2 * kBoxNB : kStageBytes;
  static constexpr int kSmem = 1024 + kNumStages * kStride + (dh_only(kMode) ? 0 : kBwdDhBytes);
  static constexpr bool kWide = kMode == kSwigluRecompute;
  // Tiles past the first wave: claimed from a counter in order (kClaim), or block b takes
  // b + gridDim.x, b + 2 gridDim.x, ... The two row tiles of one expert's column block read the
  // same weights, from HBM once only while the blocks running them stay in step. Handed out
  // statically, blocks drift apart over a launch: the dh-only modes read w_down from HBM about
  // twice (ncu at Kimi-K2's per-rank shape: 11.9 GB for 5.6 GB of weights), and claimed tiles
  // start close together (6.8 GB, -14 % time). The other modes measured no gain from claiming
  // (the saving forward 5 % slower), so they keep the static order.
  static constexpr bool kClaim = dh_only(kMode);
  static_assert(kNumStages <= kBwdMaxStages && kStride % 1024 == 0, "stage geometry");
  static_assert(kSmem <= 227 * 1024, "shared memory of one block");
};

struct SwigluBwdKernelArgs {
  CUtensorMap map_a;   // a [rows, H], 128-row boxes
  CUtensorMap map_dy;  // dy [rows, H], 128-row boxes
  CUtensorMap map_w;   // w_gate_up [L * 2I, H], 128-row boxes
  CUtensorMap map_wd;  // w_down [L * H, I], 64-row x 64-column boxes (N-major B)
  CUtensorMap map_h_st;   // hw (kSwigluSave: h) [rows, I], 16 x 32 boxes, 64-byte swizzle (out)
  CUtensorMap map_gu_st;  // kSwigluSave: gu32 [rows, 2I] fp32, 16 x 32 boxes (out)
  const int32_t* ends;  // [L] group ends
  const float* row_w;   // [rows], or null (weight 1)
  uint16_t* hw;         // [rows, I] bf16
  uint16_t* dgu;        // [rows, 2I] bf16
  float* part;          // [I / 128, rows], or null
  float* gu32;          // [rows, 2I] fp32 g | u: written by kSwigluSave, read by kSwigluSaved
  int* next_tile;       // tiles handed out past the first wave (zeroed by the launcher)
  // The gate / up k-loop's A rows gathered from the tokens instead of map_a (null: map_a):
  // receive row r is row gather_src[r] / gather_topk of gather_x [tokens, H] (a padding row,
  // gather_src -1, and rows past a tile's expert are zeros).
  const uint16_t* gather_x;
  // The dh k-loop's A rows (dy) gathered the same way from gather_dy [tokens, H] (each token's
  // output gradient) instead of map_dy (null: map_dy); the dh-only modes gather only these.
  const uint16_t* gather_dy;
  const int32_t* gather_src;
  int gather_topk;
  int rows, hidden, inter, num_experts;
};

struct BwdShared {
  uint64_t full[kBwdMaxStages], empty[kBwdMaxStages];
  // The tile a stage's first k-block belongs to: first row, its expert's end row, column
  // block; row0 < 0 marks the end of the work.
  int stage_tile[kBwdMaxStages][3];
  // Row blocks of the experts before e (tiles_before[e] * column blocks = the first tile of
  // expert e); tiles_before[L] is the total.
  int tiles_before[kBwdMaxExperts + 1];
  // A claimed tile handed from the gathering producer's thread 0 to its other threads (two
  // slots, used in turn: a slot is written again only after every thread passed the barrier
  // behind its next read).
  int claim[2];
};
static __shared__ __align__(8) BwdShared bsh;
extern __shared__ uint8_t bwd_smem[];

__device__ __forceinline__ uint8_t* bwd_stages() {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bwd_smem) + 1023) &
                                    ~static_cast<uintptr_t>(1023));
}
// The tile's dh, one float per accumulator: entry i of consumer thread t (0..255) at i * 256 + t
// (consecutive threads, consecutive banks).
__device__ __forceinline__ float* bwd_dh() {
  return reinterpret_cast<float*>(bwd_stages() + kBwdStages * kStageBytes);
}

__device__ __forceinline__ int group_start(const SwigluBwdKernelArgs& k, int e) {
  return e == 0 ? 0 : k.ends[e - 1];
}

// Warp 0: tiles_before[] of the groups (each lane sums a run of experts, then a warp scan).
__device__ __forceinline__ void count_tiles(const SwigluBwdKernelArgs& k) {
  const int lane = threadIdx.x % 32;
  const int L = k.num_experts;
  const int per = (L + 31) / 32;
  const int e0 = lane * per, e1 = min(L, e0 + per);
  int sum = 0;
  for (int e = e0; e < e1; ++e) {
    const int n = k.ends[e] - group_start(k, e);
    sum += n > 0 ? (n + kTileM - 1) / kTileM : 0;
  }
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(~0u, incl, d);
    if (lane >= d) incl += v;
  }
  int run = incl - sum;
  for (int e = e0; e < e1; ++e) {
    bsh.tiles_before[e] = run;
    const int n = k.ends[e] - group_start(k, e);
    run += n > 0 ? (n + kTileM - 1) / kTileM : 0;
  }
  if (lane == 31) bsh.tiles_before[L] = incl;
}

// Tile i -> its expert, first row and column block.
__device__ __forceinline__ void find_tile(const SwigluBwdKernelArgs& k, int i, int n_blocks,
                                          int& e, int& row0, int& nb) {
  int lo = 0, hi = k.num_experts - 1;
  while (lo < hi) {  // the last expert whose first tile is at or before i
    const int mid = (lo + hi + 1) / 2;
    if (bsh.tiles_before[mid] * n_blocks <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  e = lo;
  const int m_tiles = bsh.tiles_before[e + 1] - bsh.tiles_before[e];
  const int local = i - bsh.tiles_before[e] * n_blocks;
  nb = local / m_tiles;
  row0 = group_start(k, e) + (local % m_tiles) * kTileM;
}

template <int kMode>
__device__ __forceinline__ void bwd_producer(const SwigluBwdKernelArgs& k, int n_tiles,
                                             int n_blocks) {
  uint8_t* stages = bwd_stages();
  const int k_blocks = k.hidden / OperandBf16::kTileK;  // per k-loop
  int stage = 0;
  uint32_t phase = 0;
  for (int i = blockIdx.x;;
       i = BwdPipe<kMode>::kClaim ? gridDim.x + atomicAdd(k.next_tile, 1) : i + gridDim.x) {
    if (i >= n_tiles) {
      mbar_wait(&bsh.empty[stage], phase ^ 1);
      vol(bsh.stage_tile[stage][0]) = -1;
      mbar_arrive(&bsh.full[stage]);
      return;
    }
    int e, row0, nb;
    find_tile(k, i, n_blocks, e, row0, nb);
    const int w_row = e * 2 * k.inter + nb * 128;
    const int wd_row = e * k.hidden;
    // dh's k-blocks (dy rows, w_down's 128 columns as two N-major boxes), then gate/up's
    const int kb0 = first_kblock(kMode, k_blocks), kb1 = end_kblock(kMode, k_blocks);
    for (int kb = kb0; kb < kb1; ++kb) {
      mbar_wait(&bsh.empty[stage], phase ^ 1);
      if (kb == kb0) {
        vol(bsh.stage_tile[stage][0]) = row0;
        vol(bsh.stage_tile[stage][1]) = k.ends[e];
        vol(bsh.stage_tile[stage][2]) = nb;
      }
      uint8_t* sa = stages + stage * BwdPipe<kMode>::kStride;
      if (kb < k_blocks) {
        const int kc = kb * OperandBf16::kTileK;
        constexpr int kBoxes = tile_cols(kMode) / 64;
        mbar_arrive_expect_tx(&bsh.full[stage], kStageA + kBoxes * kBoxNB);
        tma_load_2d(sa, &k.map_dy, &bsh.full[stage], kc, row0);
#pragma unroll
        for (int q = 0; q < kBoxes; ++q)
          tma_load_2d(sa + kStageA + q * kBoxNB, &k.map_wd, &bsh.full[stage],
                      nb * tile_cols(kMode) + 64 * q, wd_row + kc);
      } else {
        const int kc = (kb - k_blocks) * OperandBf16::kTileK;
        mbar_arrive_expect_tx(&bsh.full[stage], kStageBytes);
        tma_load_2d(sa, &k.map_a, &bsh.full[stage], kc, row0);
        tma_load_2d(sa + kStageA, &k.map_w, &bsh.full[stage], kc, w_row);
        tma_load_2d(sa + 2 * kStageA, &k.map_w, &bsh.full[stage], kc, w_row + k.inter);
      }
      if (++stage == BwdPipe<kMode>::kNumStages) stage = 0, phase ^= 1;
    }
  }
}

// bwd_producer with the gate / up k-blocks' A rows gathered (SwigluBwdKernelArgs::gather_x), run
// by all 128 threads of warpgroup 0: thread t copies 16-byte chunk t % 8 of rows t / 8 + 16 j
// (j < 8) of each k-block by cp.async, into the place the 128-row TMA box in the 128-byte swizzle
// would put it (chunk c of row r at r x 128 + (c ^ (r % 8)) x 16), each 8 consecutive threads one
// row's 128 contiguous bytes; the dh k-blocks' dy rows too where gather_dy is set (else thread 0
// loads them by TMA). Thread 0 loads the weights by TMA as bwd_producer does. Every stage's full
// barrier then takes 129 arrivals: thread 0's with the TMA bytes and one per thread
// (cp_async_mbar_arrive once its copies landed, or a plain arrive). Tiles claimed from the counter
// (the dh-only modes) go from thread 0 to the others through bsh.claim and a named barrier.
// (One one-row TMA load per row instead, 128 per k-block, ran the fused layer's gate / up at a
// quarter of its speed: docs/perf-notes.md.)
constexpr int kGatherThreads = 128;
constexpr int kGatherBarrier = 4;  // named barrier of the gathering producer warpgroup
constexpr int kGatherRowsPerThread = kTileM * 8 / kGatherThreads;

template <int kMode>
__device__ __forceinline__ void bwd_producer_gather(const SwigluBwdKernelArgs& k, int n_tiles,
                                                    int n_blocks) {
  uint8_t* stages = bwd_stages();
  const int t = threadIdx.x;
  const int chunk = t % 8, r0 = t / 8;
  // the swizzled place of this thread's chunk in its rows (r0 + 16 j has r0's low three bits)
  const int sw = r0 * 128 + ((chunk ^ (r0 % 8)) << 4);
  const int k_blocks = k.hidden / OperandBf16::kTileK;
  const int64_t H = k.hidden;
  const bool gather_dy = kMode != kSwigluSave && k.gather_dy != nullptr;
  constexpr int kBoxes = tile_cols(kMode) / 64;
  int stage = 0, turn = 0;
  uint32_t phase = 0;
  for (int i = blockIdx.x;; ++turn) {
    if (turn > 0) {  // the next tile: claimed from the counter, or the grid's stride
      if (!BwdPipe<kMode>::kClaim) {
        i += gridDim.x;
      } else {
        if (t == 0) vol(bsh.claim[turn % 2]) = gridDim.x + atomicAdd(k.next_tile, 1);
        named_sync(kGatherBarrier, kGatherThreads);
        i = vol(bsh.claim[turn % 2]);
      }
    }
    if (i >= n_tiles) {
      mbar_wait(&bsh.empty[stage], phase ^ 1);
      if (t == 0) {
        vol(bsh.stage_tile[stage][0]) = -1;
        mbar_arrive(&bsh.full[stage]);
      }
      mbar_arrive(&bsh.full[stage]);
      cp_async_commit();  // every copy of this thread landed before it exits
      cp_async_wait<0>();
      return;
    }
    int e, row0, nb;
    find_tile(k, i, n_blocks, e, row0, nb);
    const int end = k.ends[e];
    // this thread's rows: the element offset of each one's token row in gather_x, or -1
    int64_t src[kGatherRowsPerThread];
#pragma unroll
    for (int j = 0; j < kGatherRowsPerThread; ++j) {
      const int row = row0 + r0 + 16 * j;
      const int s = row < end ? k.gather_src[row] : -1;
      src[j] = s >= 0 ? static_cast<int64_t>(s / k.gather_topk) * H + chunk * 8 : -1;
    }
    const int w_row = e * 2 * k.inter + nb * 128;
    const int wd_row = e * k.hidden;
    const int kb0 = first_kblock(kMode, k_blocks), kb1 = end_kblock(kMode, k_blocks);
    for (int kb = kb0; kb < kb1; ++kb) {
      mbar_wait(&bsh.empty[stage], phase ^ 1);
      uint8_t* sa = stages + stage * BwdPipe<kMode>::kStride;
      if (t == 0) {
        if (kb == kb0) {
          vol(bsh.stage_tile[stage][0]) = row0;
          vol(bsh.stage_tile[stage][1]) = end;
          vol(bsh.stage_tile[stage][2]) = nb;
        }
        if (kb < k_blocks) {
          const int kc = kb * OperandBf16::kTileK;
          mbar_arrive_expect_tx(&bsh.full[stage], (gather_dy ? 0 : kStageA) + kBoxes * kBoxNB);
          if (!gather_dy) tma_load_2d(sa, &k.map_dy, &bsh.full[stage], kc, row0);
#pragma unroll
          for (int q = 0; q < kBoxes; ++q)
            tma_load_2d(sa + kStageA + q * kBoxNB, &k.map_wd, &bsh.full[stage],
                        nb * tile_cols(kMode) + 64 * q, wd_row + kc);
        } else {
          const int kc = (kb - k_blocks) * OperandBf16::kTileK;
          mbar_arrive_expect_tx(&bsh.full[stage], kStageBytes - kStageA);
          tma_load_2d(sa + kStageA, &k.map_w, &bsh.full[stage], kc, w_row);
          tma_load_2d(sa + 2 * kStageA, &k.map_w, &bsh.full[stage], kc, w_row + k.inter);
        }
      }
      if (kb < k_blocks && !gather_dy) {
        mbar_arrive(&bsh.full[stage]);
      } else {
        const bool dh = kb < k_blocks;
        const int kc = (dh ? kb : kb - k_blocks) * OperandBf16::kTileK;
        const uint16_t* from = dh ? k.gather_dy : k.gather_x;
#pragma unroll
        for (int j = 0; j < kGatherRowsPerThread; ++j)
          cp_async16_zfill(sa + sw + j * 16 * 128, from + (src[j] >= 0 ? src[j] + kc : 0),
                           src[j] >= 0 ? 16 : 0);
        cp_async_mbar_arrive(&bsh.full[stage]);
      }
      if (++stage == BwdPipe<kMode>::kNumStages) stage = 0, phase ^= 1;
    }
  }
}

__device__ __forceinline__ float round_bf16(float v) {
  return bf16_lo(pack_bf16x2(v, 0.0f));
}

__device__ __forceinline__ float sigmoid_fast(float g) {
  return __fdividef(1.0f, 1.0f + __expf(-g));
}
// The SwiGLU backward of one element: g, u (gate and up), d (dh) and w (the row's router
// weight) give hw = w h, dg and du; psum gathers bf16(h) * d (the router weight's gradient).
// Every epilogue that computes these calls this, so they are the same bits in each.
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float w, float& psum,
                                            float& hw, float& dg, float& du) {
  const float sig = sigmoid_fast(g);
  const float s = g * sig;
  const float hv = s * u;
  psum += round_bf16(hv) * d;
  // NOTE: a row of weight 0 (padding: saved g / u there are whatever the forward's receive
  // buffer held, possibly inf or NaN) gives exact zeros, not 0 * garbage.
  hw = w != 0.0f ? w * hv : 0.0f;
  const float dw = d * w;
  dg = w != 0.0f ? dw * u * (sig * (1.0f + g * (1.0f - sig))) : 0.0f;
  du = w != 0.0f ? dw * s : 0.0f;
}
// swiglu_grad's du alone (the same operations, so the same bits).
__device__ __forceinline__ float swiglu_du(float g, float d, float w) {
  const float s = g * sigmoid_fast(g);
  const float dw = d * w;
  return w != 0.0f ? dw * s : 0.0f;
}

// Epilogues staged for TMA stores: chunks of kEpiCols columns (an fp32 box row is 128 bytes, the
// swizzle's span), stored as boxes of kEpiStoreRows rows (group ends are multiples of it where a
// whole box is stored, so no row of the next expert is written).
constexpr int kEpiCols = 32;
constexpr int kEpiStoreRows = 16;

// Byte offsets of consumer thread tid's elements (hr, jj) of the
// m64n128 accumulator layout in 32-column boxes of its warpgroup's rows: row r = warp * 16 +
// lane / 4 + 8 hr (r % 8 == lane / 4, (r / 2) % 4 == lane / 8; the lane alone for a warp's own
// 16-row box), columns 8 jj + 2 (lane % 4) (+ 1) of the box's 32. fp32 boxes (128-byte rows) in
// the 128-byte swizzle: 16-byte unit 2 jj + (lane % 4) / 2 of row r at unit ^ (r % 8); bf16
// boxes (64-byte rows) in the 64-byte swizzle: unit jj of row r at unit ^ ((r / 2) % 4).
__device__ __forceinline__ int epi_f32_at(int tid, int hr, int jj) {
  const int lane = tid % 32, x = lane / 4;
  // ((2 jj + (lane % 4) / 2) ^ x) << 4, as (jj << 5) ^ a per-thread constant
  const int fixed = ((tid / 32) * 16 + x) * 128 + ((((lane % 4) / 2) ^ x) << 4) + 8 * (lane % 2);
  return (fixed ^ (jj << 5)) + hr * 8 * 128;
}
__device__ __forceinline__ int epi_bf16_at(int tid, int hr, int jj) {
  const int lane = tid % 32;
  const int fixed = ((tid / 32) * 16 + lane / 4) * 64 + ((lane / 8) << 4) + 4 * (lane % 4);
  return (fixed ^ (jj << 4)) + hr * 8 * 64;
}
__device__ __forceinline__ float2 lds_f2(const void* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(p)));
  return v;
}
// 4-byte stores to a shared-memory address (smem_addr's 32-bit window).
__device__ __forceinline__ void sts_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void sts_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

// The epilogue of warpgroup wg's 64 rows of a tile, in the m64n128 accumulator layout (thread
// (warp, lane) holds rows warp * 16 + lane / 4 (+ 8) and columns 8j + 2 (lane % 4) (+ 1) for
// j = 0..15). kSwigluRecompute: gate in acc0, up in acc1, dh parked in shared memory; the SwiGLU
// backward. kSwigluSave: gate in acc0, up in acc1; h and the fp32 g / u out. kSwigluSaved: dh in
// acc0, g / u read back; the SwiGLU backward (kSwigluSavedWide: once per 128-column half). (The
// accumulators are only read here: ptxas serialises a kernel's wgmma when anything but wgmma
// writes them.)
template <int kMode>
__device__ __forceinline__ void swiglu_bwd_epilogue(const SwigluBwdKernelArgs& k,
                                                    const float (&acc0)[64],
                                                    const float (&acc1)[64], int row0, int end,
                                                    int nb, int wg, int warp, int lane) {
  const int I = k.inter;
  const float* dh = bwd_dh() + wg * 128 + warp * 32 + lane;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + wg * 64 + warp * 16 + lane / 4 + 8 * hr;
    const bool valid = row < end;
    const int64_t at = static_cast<int64_t>(valid ? row : 0) * I + nb * 128 + 2 * (lane % 4);
    // the same columns in a [rows, 2I] row (gate half; the up half is I further)
    const int64_t gat = at + static_cast<int64_t>(valid ? row : 0) * I;
    const float w = k.row_w == nullptr ? 1.0f : k.row_w[valid ? row : 0];
    float psum = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      float gv[2], uv[2];
      if (dh_only(kMode)) {
        float2 g2 = make_float2(0.0f, 0.0f), u2 = g2;
        if (valid) {
          g2 = *reinterpret_cast<const float2*>(k.gu32 + gat + 8 * j);
          u2 = *reinterpret_cast<const float2*>(k.gu32 + gat + I + 8 * j);
        }
        gv[0] = g2.x, gv[1] = g2.y, uv[0] = u2.x, uv[1] = u2.y;
      } else {
#pragma unroll
        for (int q = 0; q < 2; ++q) gv[q] = acc0[4 * j + 2 * hr + q], uv[q] = acc1[4 * j + 2 * hr + q];
      }
      if (kMode == kSwigluSave) {
        if (valid) {
          const float h0 = silu(gv[0]) * uv[0], h1 = silu(gv[1]) * uv[1];
          *reinterpret_cast<uint32_t*>(k.hw + at + 8 * j) = pack_bf16x2(h0, h1);
          if (k.gu32 != nullptr) {
            *reinterpret_cast<float2*>(k.gu32 + gat + 8 * j) = make_float2(gv[0], gv[1]);
            *reinterpret_cast<float2*>(k.gu32 + gat + I + 8 * j) = make_float2(uv[0], uv[1]);
          }
        }
        continue;
      }
      float hw[2], dg[2], du[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float d =
            dh_only(kMode) ? acc0[4 * j + 2 * hr + q] : dh[(4 * j + 2 * hr + q) * 256];
        swiglu_grad(gv[q], uv[q], d, w, psum, hw[q], dg[q], du[q]);
      }
      if (valid) {
        *reinterpret_cast<uint32_t*>(k.hw + at + 8 * j) = pack_bf16x2(hw[0], hw[1]);
        *reinterpret_cast<uint32_t*>(k.dgu + gat + 8 * j) = pack_bf16x2(dg[0], dg[1]);
        *reinterpret_cast<uint32_t*>(k.dgu + gat + I + 8 * j) = pack_bf16x2(du[0], du[1]);
      }
    }
    if (kMode == kSwigluSave) continue;
    psum += __shfl_xor_sync(~0u, psum, 1);
    psum += __shfl_xor_sync(~0u, psum, 2);
    if (valid && k.part != nullptr && lane % 4 == 0)
      k.part[static_cast<int64_t>(nb) * k.rows + row] = psum;
  }
}

// kSwigluSave's epilogue: h and the fp32 g / u of warpgroup wg's 64 rows (gate in acc0, up in
// acc1). Each warp owns 16 of the rows. A warp whose 16 rows all lie before its expert's end
// stages them, 32 columns at a time, in its own kSaveWarpBytes of the parked-dh memory (unused
// in this mode), and its lane 0 stores them by TMA, waiting before each chunk only until the
// last one has been read out of shared memory. A warp at the end of a group that is not a
// multiple of 16 rows stores its rows before the end itself. (Stored by every thread straight to
// global memory, the dh tiles' epilogue took over a third of their time; docs/perf-notes.md.)
constexpr int kSaveWarpBytes = 8 * 1024;  // g (2 KiB), u (2 KiB), h (1 KiB) of 16 x 32
static_assert(8 * kSaveWarpBytes <= kBwdDhBytes, "the save epilogue's staging");

__device__ __forceinline__ void save_epilogue(const SwigluBwdKernelArgs& k,
                                              const float (&acc0)[64], const float (&acc1)[64],
                                              int row0, int end, int nb, int wg, int warp,
                                              int lane) {
  const int box_row = row0 + wg * 64 + warp * kEpiStoreRows;
  if (box_row + kEpiStoreRows > end) {  // warp-uniform
    swiglu_bwd_epilogue<kSwigluSave>(k, acc0, acc1, row0, end, nb, wg, warp, lane);
    return;
  }
  uint8_t* g_box = reinterpret_cast<uint8_t*>(bwd_dh()) + (wg * 4 + warp) * kSaveWarpBytes;
  uint8_t* u_box = g_box + kEpiStoreRows * kEpiCols * 4;
  uint8_t* h_box = u_box + kEpiStoreRows * kEpiCols * 4;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (lane == 0) bulk_wait_read<0>();  // the buffer's last stores have read it
    __syncwarp();
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int i = 4 * (4 * q + jj) + 2 * hr;  // columns 32 q + 8 jj.. of the tile's 128
        const float g0 = acc0[i], g1 = acc0[i + 1], u0 = acc1[i], u1 = acc1[i + 1];
        const int at = epi_f32_at(lane, hr, jj);
        *reinterpret_cast<float2*>(g_box + at) = make_float2(g0, g1);
        *reinterpret_cast<float2*>(u_box + at) = make_float2(u0, u1);
        *reinterpret_cast<uint32_t*>(h_box + epi_bf16_at(lane, hr, jj)) =
            pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
      }
    }
    fence_proxy_async_shared();  // these writes before the TMA's reads
    __syncwarp();
    if (lane == 0) {
      const int col = nb * 128 + kEpiCols * q;
      tma_store_2d(&k.map_h_st, h_box, col, box_row);
      if (k.gu32 != nullptr) {
        tma_store_2d(&k.map_gu_st, g_box, col, box_row);
        tma_store_2d(&k.map_gu_st, u_box, k.inter + col, box_row);
      }
      bulk_commit();
    }
  }
}

// kGather: the stages' A rows arrive by cp.async (bwd_producer_gather), generic-proxy writes that
// the wgmma (async proxy) reads: each k-block is preceded by a proxy fence.
template <int kMode, bool kGather = false>
__device__ __forceinline__ void bwd_consumer(const SwigluBwdKernelArgs& k, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int k_blocks = k.hidden / OperandBf16::kTileK;
  int stage = 0, prev_stage = 0;
  uint32_t phase = 0;
  float acc0[64], acc1[64];  // dh in acc0, then gate in acc0 and up in acc1
  for (;;) {
    mbar_wait(&bsh.full[stage], phase);
    const int row0 = vol(bsh.stage_tile[stage][0]);
    if (row0 < 0) break;
    const int end = vol(bsh.stage_tile[stage][1]);
    const int nb = vol(bsh.stage_tile[stage][2]);
    if (kMode == kSwigluSavedWide)
      mma_kloop<OperandBf16, kFullNBWide, BwdPipe<kMode>::kNumStages, false, kStageBytes,
                kGather>(acc0, acc1, bwd_stages(), bsh.full, bsh.empty, k_blocks, 0, wg, stage,
                         prev_stage, phase);
    else if (kMode != kSwigluSave)
      mma_kloop<OperandBf16, kFullNB, BwdPipe<kMode>::kNumStages, false,
                BwdPipe<kMode>::kStride, kGather>(acc0, acc1, bwd_stages(), bsh.full, bsh.empty,
                                                  k_blocks, 0, wg, stage, prev_stage, phase);
    if (kMode == kSwigluRecompute) {
      // NOTE: only this thread reads its entries back (the same accumulator layout), so no
      // barrier is needed between the store and the epilogue's loads.
      float* dh = bwd_dh() + wg * 128 + tid;
#pragma unroll
      for (int i = 0; i < 64; ++i) dh[i * 256] = acc0[i];
    }
    if (!dh_only(kMode))
      mma_kloop<OperandBf16, kFull, BwdPipe<kMode>::kNumStages, BwdPipe<kMode>::kWide,
                kStageBytes, kGather>(acc0, acc1, bwd_stages(), bsh.full, bsh.empty, k_blocks, 0,
                                      wg, stage, prev_stage, phase);
    if (kMode == kSwigluSavedWide) {  // dh of columns 256 nb.. in acc0, of 256 nb + 128.. in acc1
      swiglu_bwd_epilogue<kMode>(k, acc0, acc1, row0, end, 2 * nb, wg, warp, lane);
      swiglu_bwd_epilogue<kMode>(k, acc1, acc0, row0, end, 2 * nb + 1, wg, warp, lane);
    } else if (kMode == kSwigluSave) {
      save_epilogue(k, acc0, acc1, row0, end, nb, wg, warp, lane);
    } else {
      swiglu_bwd_epilogue<kMode>(k, acc0, acc1, row0, end, nb, wg, warp, lane);
    }
  }
  if (kMode == kSwigluSave && lane == 0) bulk_wait_all();  // the TMA stores done before exit
}

// kGather: the k-loops' A rows gathered from SwigluBwdKernelArgs::gather_x (gate / up) and
// gather_dy (dh) by the producer warpgroup (bwd_producer_gather).
template <int kMode, bool kGather = false>
__global__ void __launch_bounds__(kLayerThreads, 1)
    swiglu_bwd_kernel(const __grid_constant__ SwigluBwdKernelArgs k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int n_blocks = k.inter / tile_cols(kMode);
  if (threadIdx.x < 32) count_tiles(k);
  if (threadIdx.x == 0) {
    // gathered A rows: one arrival per producer thread besides thread 0's TMA one
    for (int s = 0; s < BwdPipe<kMode>::kNumStages; ++s) {
      mbar_init(&bsh.full[s], kGather ? 1 + kGatherThreads : 1);
      mbar_init(&bsh.empty[s], 2 * 128);  // every thread of both consumer warpgroups
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int n_tiles = bsh.tiles_before[k.num_experts] * n_blocks;
  if (static_cast<int>(blockIdx.x) >= n_tiles) return;
  // Registers as in the forward's workers: few for the producer, 224 for the accumulators.
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    if constexpr (kGather) {
      if (threadIdx.x == 0) {  // the maps it loads by TMA (the gathered ones are not encoded)
        if (!dh_only(kMode)) tma_prefetch_map(&k.map_w);
        if (kMode != kSwigluSave) tma_prefetch_map(&k.map_wd);
        if (kMode != kSwigluSave && k.gather_dy == nullptr) tma_prefetch_map(&k.map_dy);
        if (kMode == kSwigluSave) tma_prefetch_map(&k.map_h_st);
        if (kMode == kSwigluSave && k.gu32 != nullptr) tma_prefetch_map(&k.map_gu_st);
      }
      bwd_producer_gather<kMode>(k, n_tiles, n_blocks);
    } else if (threadIdx.x == 0) {
      if (!dh_only(kMode)) tma_prefetch_map(&k.map_a), tma_prefetch_map(&k.map_w);
      if (kMode != kSwigluSave) tma_prefetch_map(&k.map_dy), tma_prefetch_map(&k.map_wd);
      if (kMode == kSwigluSave) tma_prefetch_map(&k.map_h_st);
      if (kMode == kSwigluSave && k.gu32 != nullptr) tma_prefetch_map(&k.map_gu_st);
      bwd_producer<kMode>(k, n_tiles, n_blocks);
    }
  } else {
    setmaxnreg_inc<224>();
    bwd_consumer<kMode, kGather>(k, wg - 1);
  }
#endif
}

// ---- weight gradients ----------------------------------------------------------------------
//
// C[e] = A[e]^T B[e] for every expert group e: A [rows, M] and B [rows, N] row-major, rows
// grouped by expert (group ends multiples of 16), C [L, M, N] bf16 (dW_gate_up = dgu^T a,
// dW_down = dy^T hw). Tiles of 128 M x 256 N of one expert, each reducing over all of its
// expert's rows in one fp32 accumulation (no split-K, no atomics: any grid gives the same
// bits); an expert without rows gets a zero tile. The k axis is the rows: A and B are M- / N-
// major operands (64-column TMA boxes of 64 rows), and a group's last k-block runs only its
// 16-row steps that hold the group's rows. Tiles in the order (expert, M block, N block): the
// blocks working at a time share their expert's A and B in L2. Roles as in the kernel above,
// plus two store warps (warps 1 and 2): each consumer warpgroup stages its 64 x 128 output
// chunks in shared memory (two buffers, each two 64 x 64 boxes in the 128-byte swizzle) and
// goes on with its next tile while one lane of its store warp writes them out by TMA tensor
// stores. (Copied out by the store warp's lanes with 16-byte stores, a chunk took ~4500
// clocks, more than the tile's MMAs: the consumers waited for their buffers ~40 % of the time.)
//
// Stored transposed (WgradTrans): the same tiles of A^T B written as C^T, C [L, N, M]: dW_gate_up
// computed as x^T dgu (x's rows the 128-column operand A: gathered at one rank, a third of a
// k-block's bytes instead of two thirds) and stored in the weight's [L, 2I, H] layout. Each
// warpgroup's 64 M x 128 N accumulator chunk becomes 128 rows x 64 columns of C^T, staged in the
// same buffers at transposed places (wgrad_stage_t, wgrad_stage_f32_t).

// What the kernel writes: bf16 C; fp32 C; or fp32 C added onto what C holds (a caller's fp32
// gradient accumulator, as `main_grad` in Megatron: one TMA reduce-add per element, from the
// one tile that owns it, so the sum is the same bits whatever the order of the tiles).
enum WgradOut : int { kWgradBf16 = 0, kWgradF32 = 1, kWgradF32Add = 2 };

// Which tiles are stored transposed: none; every tile (the standalone kernels' transposed
// form); problem 0's only (the fused backward's dW_gate_up as x^T dgu, its dW_down as it is).
enum WgradTrans : int { kWgradTNone = 0, kWgradTAll = 1, kWgradTProb0 = 2 };
template <int kT>
__device__ __forceinline__ bool wgrad_transposed(int prob) {
  return kT == kWgradTAll || (kT == kWgradTProb0 && prob == 0);
}

constexpr int kWgradStages = 3;
constexpr int kWgradBoxBytes = 64 * 128;  // one staged box of C: 64 rows of 128 bytes
constexpr int kWgradZeroBytes = 10 * 1024;  // zero_a (2 KiB), zero_b (8 KiB): one 16-row step
// Two staged output chunks (acc0's and acc1's columns) per consumer warpgroup.
constexpr int kWgradSmem = 1024 + kWgradStages * kStageBytes + 4 * kEpiBytes + kWgradZeroBytes;

struct WgradKernelArgs {
  CUtensorMap map_a;  // A [rows, M], 64-row x 64-column boxes
  CUtensorMap map_b;  // B [rows, N], 64-row x 64-column boxes
  // C [L * M, N] (stored transposed: [L * N, M]), 64-row boxes of 128 bytes (TMA stores)
  CUtensorMap map_c;
  const int32_t* ends;  // [L] group ends (multiples of 16)
  int m, n, num_experts;
};

struct WgradShared {
  uint64_t full[kWgradStages], empty[kWgradStages];
  // The tile a stage's first k-block belongs to: expert (-1: end of the work), M block,
  // N block, k-blocks (0: an expert without rows; the stage carries no data), last steps.
  // Then the problem (an index into the storer's WgradKernelArgs: 0 unless a launch runs two).
  int stage_tile[kWgradStages][6];
  // The staged chunks, per consumer warpgroup and buffer: staged / copied out, and the job
  // (expert, M block, first column, zero tile, problem; expert -1: no more).
  uint64_t epi_full[2][2], epi_empty[2][2];
  int jobs[2][2][5];
};
static __shared__ __align__(8) WgradShared gsh;

__device__ __forceinline__ uint8_t* wgrad_epi(int wg, int b) {
  return bwd_stages() + kWgradStages * kStageBytes + (2 * wg + b) * kEpiBytes;
}
__device__ __forceinline__ uint8_t* wgrad_zero() {
  return bwd_stages() + kWgradStages * kStageBytes + 4 * kEpiBytes;
}

// Weight-gradient tile (e, mb, nb) of problem `prob`: its fields into stage `stage`'s
// stage_tile (the stage already waited for), by one thread; returns its k-blocks (64 rows each,
// 0 for an expert without rows).
__device__ __forceinline__ int wgrad_tile_fields(const WgradKernelArgs& k, int prob, int e, int mb,
                                                 int nb, int stage) {
  const int start = e == 0 ? 0 : k.ends[e - 1];
  const int rows = k.ends[e] - start;
  const int k_blocks = rows > 0 ? (rows + 63) / 64 : 0;
  vol(gsh.stage_tile[stage][0]) = e;
  vol(gsh.stage_tile[stage][1]) = mb;
  vol(gsh.stage_tile[stage][2]) = nb;
  vol(gsh.stage_tile[stage][3]) = k_blocks;
  vol(gsh.stage_tile[stage][4]) = k_blocks > 0 ? (rows - (k_blocks - 1) * 64 + 15) / 16 : 0;
  vol(gsh.stage_tile[stage][5]) = prob;
  return k_blocks;
}

// Loads weight-gradient tile (e, mb, nb) of problem `prob` (its operands in k) into the stages
// from `stage` on, the tile's fields in the first one's stage_tile.
__device__ __forceinline__ void wgrad_load_tile(const WgradKernelArgs& k, int prob, int e, int mb,
                                                int nb, int& stage, uint32_t& phase) {
  uint8_t* stages = bwd_stages();
  mbar_wait(&gsh.empty[stage], phase ^ 1);
  const int start = e == 0 ? 0 : k.ends[e - 1];
  const int k_blocks = wgrad_tile_fields(k, prob, e, mb, nb, stage);
  if (k_blocks == 0) {  // a zero tile: the stage says so and carries nothing
    mbar_arrive(&gsh.full[stage]);
    if (++stage == kWgradStages) stage = 0, phase ^= 1;
    return;
  }
  for (int kb = 0; kb < k_blocks; ++kb) {
    if (kb > 0) mbar_wait(&gsh.empty[stage], phase ^ 1);
    uint8_t* sa = stages + stage * kStageBytes;
    const int row = start + kb * 64;
    mbar_arrive_expect_tx(&gsh.full[stage], kStageBytes);
#pragma unroll
    for (int q = 0; q < 2; ++q)
      tma_load_2d(sa + q * kBoxNB, &k.map_a, &gsh.full[stage], mb * kTileM + 64 * q, row);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      tma_load_2d(sa + kStageA + q * kBoxNB, &k.map_b, &gsh.full[stage], nb * kTileN + 64 * q,
                  row);
    if (++stage == kWgradStages) stage = 0, phase ^= 1;
  }
}

// The end of the weight-gradient work: a stage whose expert is -1.
__device__ __forceinline__ void wgrad_load_end(int stage, uint32_t phase) {
  mbar_wait(&gsh.empty[stage], phase ^ 1);
  vol(gsh.stage_tile[stage][0]) = -1;
  mbar_arrive(&gsh.full[stage]);
}

__device__ __forceinline__ void wgrad_producer(const WgradKernelArgs& k, int n_tiles) {
  const int m_blocks = k.m / kTileM, n_blocks = k.n / kTileN;
  const int per_expert = m_blocks * n_blocks;
  int stage = 0;
  uint32_t phase = 0;
  for (int i = blockIdx.x; i < n_tiles; i += gridDim.x)
    wgrad_load_tile(k, 0, i / per_expert, (i % per_expert) / n_blocks, i % n_blocks, stage,
                    phase);
  wgrad_load_end(stage, phase);
}

// A weight gradient with one operand's rows gathered from the tokens (at one rank: dW_gate_up's B,
// the input rows x; dW_down's A, the output gradient rows): receive row r is row
// src[r] / topk of `rows` [tokens, cols] (-1, a padding row, and rows past a group: zeros).
struct WgradGather {
  const uint16_t* rows;
  const int32_t* src;
  int topk, cols;
};
struct WgradGatherKernelArgs {
  WgradKernelArgs k;
  WgradGather g;
};
constexpr int kWgradGatherThreads = 128;  // the producer warpgroup

// The producer warpgroup of the gathering weight-gradient kernel, all 128 threads (the kernel
// has no store warps: its consumers store their own chunks, wgrad_stage<.., true>). Thread 0
// does wgrad_producer's part for the other operand (each tile's fields in its first stage, the
// TMA loads); every thread copies its share of operand kOperand (0: A, 128 columns, two boxes;
// 1: B, 256 columns, four boxes) of each k-block by cp.async, into the places its 64-row TMA
// boxes in the 128-byte swizzle would put it (k-row r of a box at 128 r, 16-byte unit u at
// (u ^ (r % 8)) x 16). A warp instruction copies whole rows (one 512-byte row of B, or two
// 256-byte rows of A), the four warps taking turns by row, so each warp has 16 rows per
// k-block (B: 16 instructions a thread, A: 8) and the copies come from all four of the SM's
// schedulers. Lane l < 16 reads the token of the warp's l-th row and hands it round by
// shuffles; it is read one k-block ahead (issued after the k-block's copies, before the next
// k-block's wait for an empty stage; a tile's first before the tile's wait), so the copies never
// wait for a token's load. The full barriers take 1 + 128 arrivals (thread 0's with the TMA
// bytes, then one per thread once its copies landed). (With warp 3 alone copying, 64
// instructions a thread per k-block of B, the gathering weight gradients ran at a fraction of
// the TMA kernel's speed: docs/perf-notes.md.)
template <int kOperand>
__device__ __forceinline__ void wgrad_gather_producer(const WgradKernelArgs& k,
                                                      const WgradGather& g, int n_tiles) {
  constexpr int kChunks = kOperand == 0 ? 16 : 32;  // 16-byte units of a row in the tile
  constexpr int kRowsPerStep = 32 / kChunks;        // rows one warp instruction copies
  constexpr int kRowsPerTurn = 4 * kRowsPerStep;    // the four warps' rows of one step
  constexpr int kSteps = 64 / kRowsPerTurn;         // instructions per thread and k-block
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int c = lane % kChunks, sub = lane / kChunks;
  const int m_blocks = k.m / kTileM, n_blocks = k.n / kTileN;
  const int per_expert = m_blocks * n_blocks;
  uint8_t* stages = bwd_stages();
  int stage = 0;
  uint32_t phase = 0;
  // lane l < 16: the token of the warp's l-th row of the k-block at row0 (-1: none)
  auto tokens_at = [&](int row0, int end) {
    int tok = -1;
    if (lane < 16) {
      const int r =
          (lane / kRowsPerStep) * kRowsPerTurn + warp * kRowsPerStep + lane % kRowsPerStep;
      const int s = row0 + r < end ? g.src[row0 + r] : -1;
      tok = s >= 0 ? s / g.topk : -1;
    }
    return tok;
  };
  for (int i = blockIdx.x; i < n_tiles; i += gridDim.x) {
    const int e = i / per_expert, mb = (i % per_expert) / n_blocks, nb = i % n_blocks;
    const int start = e == 0 ? 0 : k.ends[e - 1], end = k.ends[e];
    const int rows = end - start;
    const int k_blocks = rows > 0 ? (rows + 63) / 64 : 0;
    int tok = k_blocks > 0 ? tokens_at(start, end) : -1;  // the first k-block's
    mbar_wait(&gsh.empty[stage], phase ^ 1);
    if (t == 0) wgrad_tile_fields(k, 0, e, mb, nb, stage);
    if (k_blocks == 0) {  // a zero tile: the stage says so and carries nothing
      if (t == 0) mbar_arrive(&gsh.full[stage]);
      mbar_arrive(&gsh.full[stage]);
      if (++stage == kWgradStages) stage = 0, phase ^= 1;
      continue;
    }
    const int64_t col = (kOperand == 0 ? mb * kTileM : nb * kTileN) + c * 8;
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (kb > 0) mbar_wait(&gsh.empty[stage], phase ^ 1);
      uint8_t* sa = stages + stage * kStageBytes;
      const int row0 = start + kb * 64;
      if (t == 0) {  // the other operand by TMA
        mbar_arrive_expect_tx(&gsh.full[stage], kOperand == 0 ? kStageBytes - kStageA : kStageA);
        if (kOperand == 0) {
#pragma unroll
          for (int q = 0; q < 4; ++q)
            tma_load_2d(sa + kStageA + q * kBoxNB, &k.map_b, &gsh.full[stage],
                        nb * kTileN + 64 * q, row0);
        } else {
#pragma unroll
          for (int q = 0; q < 2; ++q)
            tma_load_2d(sa + q * kBoxNB, &k.map_a, &gsh.full[stage], mb * kTileM + 64 * q,
                        row0);
        }
      }
      uint8_t* base = sa + (kOperand == 0 ? 0 : kStageA);
#pragma unroll 4  // a few copies' addresses live at a time: the warpgroup has 56 registers
      for (int q = 0; q < kSteps; ++q) {
        const int r = q * kRowsPerTurn + warp * kRowsPerStep + sub;
        const int tk = __shfl_sync(~0u, tok, q * kRowsPerStep + sub);
        uint8_t* dst = base + (c / 8) * kBoxNB + r * 128 + (((c % 8) ^ (r % 8)) << 4);
        cp_async16_zfill(dst, g.rows + (tk >= 0 ? static_cast<int64_t>(tk) * g.cols + col : 0),
                         tk >= 0 ? 16 : 0);
      }
      if (kb + 1 < k_blocks) tok = tokens_at(row0 + 64, end);  // the next k-block's
      cp_async_mbar_arrive(&gsh.full[stage]);
      if (++stage == kWgradStages) stage = 0, phase ^= 1;
    }
  }
  mbar_wait(&gsh.empty[stage], phase ^ 1);  // the end of the work: a stage whose expert is -1
  if (t == 0) {
    vol(gsh.stage_tile[stage][0]) = -1;
    mbar_arrive(&gsh.full[stage]);
  }
  mbar_arrive(&gsh.full[stage]);
  cp_async_commit();
  cp_async_wait<0>();
}

// A TMA reduce-add of one box from shared memory onto the map's coordinates (the map's type:
// fp32 here), in the thread's current bulk group.
__device__ __forceinline__ void tma_add_2d(const CUtensorMap* map, const void* smem_src, int col,
                                          int row) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], "
      "[%1];" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem_src)), "r"(col), "r"(row)
      : "memory");
}

// One staged chunk of consumer warpgroup wg (its two boxes at `epi`, or the zero block for an
// expert without rows) into C by TMA, as one bulk group: stored, or for kWgradF32Add added onto
// C (nothing for a zero chunk: the group is then empty). col0: the chunk's first N column.
// Transposed (`tr`): the chunk is rows e N + col0.. of C^T [L * N, M], at its columns
// mb * 128 + wg * 64..; a bf16 chunk's two boxes are its rows 0..63 and 64..127 (64 columns
// each), an fp32 chunk's its columns 0..31 and 32..63 (64 rows each). No box reaches another
// expert's rows (N is a multiple of 256) or past M (a multiple of 128).
template <int kOut>
__device__ __forceinline__ void wgrad_store_chunk(const WgradKernelArgs& k, const uint8_t* epi,
                                                  bool zero, int e, int mb, int col0, int wg,
                                                  bool tr = false) {
  constexpr int kBoxCols = kOut == kWgradBf16 ? 64 : 32;
  const int col = tr ? mb * kTileM + wg * 64 : col0;
  const int row = tr ? e * k.n + col0 : e * k.m + mb * kTileM + wg * 64;
  const bool below = tr && kOut == kWgradBf16;  // the second box 64 rows on, else beside
  if (kOut == kWgradF32Add) {
    if (!zero) {
      tma_add_2d(&k.map_c, epi, col, row);
      tma_add_2d(&k.map_c, epi + kWgradBoxBytes, below ? col : col + kBoxCols,
                 below ? row + 64 : row);
    }
  } else {
    tma_store_2d(&k.map_c, epi, col, row);
    tma_store_2d(&k.map_c, zero ? epi : epi + kWgradBoxBytes, below ? col : col + kBoxCols,
                 below ? row + 64 : row);
  }
  bulk_commit();
}

// Buffer b free for the next chunk: its last chunk read by its store. `self` (the gathering
// kernel, no store warps): thread 0 stored the chunks itself, one bulk group each in buffer
// order, so the group before the latest is this buffer's; else the store warp says so.
template <bool kSelf>
__device__ __forceinline__ void wgrad_epi_free(int wg, int b, uint32_t uses, int tid) {
  if constexpr (kSelf) {
    if (tid == 0) bulk_wait_read<1>();
    named_sync(1 + wg, 128);
  } else {
    mbar_wait(&gsh.epi_empty[wg][b], (uses & 1) ^ 1);
  }
}

// The staged chunk handed on: to the store warp (a job; it knows from the problem whether the
// chunk is transposed), or with kSelf stored by thread 0 from `self` (the one problem of the
// gathering kernel; `tr`: staged transposed).
template <int kOut, bool kSelf>
__device__ __forceinline__ void wgrad_epi_hand(const WgradKernelArgs* self, bool zero, int e,
                                               int mb, int col0, int prob, int wg, int b,
                                               int tid, bool tr = false) {
  named_sync(1 + wg, 128);
  if (tid != 0) return;
  if constexpr (kSelf) {
    wgrad_store_chunk<kOut>(*self, zero ? wgrad_zero() : wgrad_epi(wg, b), zero, e, mb, col0, wg,
                            tr);
  } else {
    vol(gsh.jobs[wg][b][0]) = e, vol(gsh.jobs[wg][b][1]) = mb, vol(gsh.jobs[wg][b][2]) = col0;
    vol(gsh.jobs[wg][b][3]) = zero, vol(gsh.jobs[wg][b][4]) = prob;
    mbar_arrive(&gsh.epi_full[wg][b]);
  }
}

// Warpgroup wg's 64 x 128 output chunk (columns col0.. of its rows) from `acc` into its buffer b
// as two 64 x 64 boxes (columns 0..63, then 64..127) in the 128-byte swizzle that C's tensor map
// stores from: row r at byte 128 r of its box, its 16-byte unit u at unit u ^ (r % 8) (the 8 rows
// of a store then hit 32 distinct banks). Handed to its store warp (wgrad_storer); `uses`: the
// buffer's earlier chunks. `zero`: an expert without rows, whose chunk the store warp writes from
// the zero block (the accumulators are never written by anything but wgmma: ptxas serialises
// every wgmma of a kernel that does).
template <int kOut, bool kSelf>
__device__ __forceinline__ void wgrad_stage(const float (&acc)[64], bool zero, int e, int mb,
                                            int col0, int prob, int wg, int b, uint32_t uses,
                                            int tid, const WgradKernelArgs* self) {
  wgrad_epi_free<kSelf>(wg, b, uses, tid);  // the last chunk's TMA has read the buffer
  if (!zero) {
    const int warp = tid / 32, lane = tid % 32, x = lane / 4;  // rows warp * 16 + x (+ 8)
    uint8_t* row = wgrad_epi(wg, b) + (warp * 16 + x) * 128 + (lane % 4) * 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {  // columns 8j..8j+7: box j / 8, unit j % 8
      uint8_t* at = row + (j / 8) * kWgradBoxBytes + (((j % 8) ^ x) << 4);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<uint32_t*>(at + hr * 8 * 128) =
            pack_bf16x2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
    }
    fence_proxy_async_shared();  // these writes before the TMA's reads
  }
  wgrad_epi_hand<kOut, kSelf>(self, zero, e, mb, col0, prob, wg, b, tid);
}

// The fp32 form: columns 64 hh.. of the chunk in `acc` (its 128 columns col0 - 64 hh..) as two
// 64 x 32 fp32 boxes in the same swizzle, into buffer b for the store warp, which writes it to
// columns col0.. of C (or adds it there).
template <int kOut, bool kSelf>
__device__ __forceinline__ void wgrad_stage_f32(const float (&acc)[64], int hh, bool zero, int e,
                                                int mb, int col0, int prob, int wg, int b,
                                                uint32_t uses, int tid,
                                                const WgradKernelArgs* self) {
  wgrad_epi_free<kSelf>(wg, b, uses, tid);
  if (!zero) {
    const int warp = tid / 32, lane = tid % 32, x = lane / 4;
    uint8_t* row = wgrad_epi(wg, b) + (warp * 16 + x) * 128 + 8 * (lane % 2);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {  // columns 8 jj.. of the half: box jj / 4, 16-byte unit u
      const int j = 8 * hh + jj, u = 2 * (jj % 4) + (lane % 4) / 2;
      uint8_t* at = row + (jj / 4) * kWgradBoxBytes + ((u ^ x) << 4);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(at + hr * 8 * 128) =
            make_float2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
    }
    fence_proxy_async_shared();
  }
  wgrad_epi_hand<kOut, kSelf>(self, zero, e, mb, col0, prob, wg, b, tid);
}

// The transposed staging (tiles stored as C^T): byte offsets in a warpgroup's chunk buffer, two
// boxes of 64 rows x 128 bytes in the 128-byte swizzle (row r at 128 r, its 16-byte unit u at
// u ^ (r % 8)), as C^T's map stores them. Consumer thread tid (0..127: warp w, lane l) holds
// accumulator rows m = 16 w + l / 4 (+ 8 hr) and columns n = 8 j + 2 (l % 4) (+ 1): C^T's
// columns and rows. Each function gives the place of column group j = 0; group j lies
// j x kWgradTStep bytes on (8 rows of 128 bytes: the same swizzle phase). Neither layout needs
// padding: the swizzle alone puts every store's 32 lanes in 32 distinct banks.
constexpr int kWgradTStep = 8 * 128;
// bf16 (a 64 x 128 chunk: C^T rows n = 0..127 in two boxes, columns m = 0..63): one 32-bit word
// per (j, hr), C^T row n + o (o = (l / 4) % 2) at columns m' = 16 w + 8 hr + 2 (l / 8) and
// m' + 1, built from this thread's element and lane l ^ 4's (accumulator row m ^ 1). A store's
// lanes: rows 8 j + 2 (l % 4) + o, the eight rows of one swizzle period, each at one 16-byte
// unit (2 w + hr before the swizzle) in four words.
__host__ __device__ constexpr int wgrad_t_bf16_at(int tid, int hr) {
  const int w = tid / 32, l = tid % 32;
  const int x = 2 * (l % 4) + (l / 4) % 2;  // the row % 8
  return x * 128 + (((2 * w + hr) ^ x) << 4) + 4 * (l / 8);
}
// fp32 (a 64 x 64 chunk: C^T rows n = 64 hh.. of the accumulator's 128, columns m = 0..31 in
// box 0, 32..63 in box 1): one 4-byte word per (jj, hr, q) of the chunk's column groups
// j = 8 hh + jj, C^T row 8 jj + 2 (l % 4) + q at column 16 w + 8 hr + l / 4 (box w / 2). A
// store's lanes: four rows of one parity x eight consecutive columns (units u and u ^ 1), eight
// distinct units after the swizzle.
__host__ __device__ constexpr int wgrad_t_f32_at(int tid, int hr, int q) {
  const int w = tid / 32, l = tid % 32;
  const int x = 2 * (l % 4) + q;                // the row % 8
  const int u = 4 * (w % 2) + 2 * hr + l / 16;  // column (16 (w % 2) + 8 hr + l / 4) of the box
  return (w / 2) * kWgradBoxBytes + x * 128 + ((u ^ x) << 4) + 4 * ((l / 4) % 4);
}

// wgrad_stage of a tile stored transposed: the chunk of `acc` (C's columns col0..col0 + 127 of
// warpgroup wg's 64 rows) as C^T's rows col0.. x 64 columns (wgrad_t_bf16_at). Each thread
// packs both of its columns n and n + 1 (rows m, m + 8), keeps one and swaps the other with lane
// l ^ 4 (o = 0 keeps n, o = 1 keeps n + 1), so a word holds rows m & ~1 and m | 1 of one column:
// one shuffle and two stores per j, the bf16 rounding the same as wgrad_stage's.
template <int kOut, bool kSelf>
__device__ __forceinline__ void wgrad_stage_t(const float (&acc)[64], bool zero, int e, int mb,
                                              int col0, int prob, int wg, int b, uint32_t uses,
                                              int tid, const WgradKernelArgs* self) {
  wgrad_epi_free<kSelf>(wg, b, uses, tid);
  if (!zero) {
    const uint32_t at0 = smem_addr(wgrad_epi(wg, b)) + wgrad_t_bf16_at(tid, 0);
    const uint32_t at1 = smem_addr(wgrad_epi(wg, b)) + wgrad_t_bf16_at(tid, 1);
    const bool o = (tid / 4) % 2 != 0;
    // the words of hr 0 (low halves) and hr 1 (high halves), row m & ~1's element first
    const uint32_t sel0 = o ? 0x1054u : 0x5410u, sel1 = o ? 0x3276u : 0x7632u;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t c0 = pack_bf16x2(acc[4 * j], acc[4 * j + 2]);      // column n: m, m + 8
      const uint32_t c1 = pack_bf16x2(acc[4 * j + 1], acc[4 * j + 3]);  // column n + 1
      const uint32_t got = __shfl_xor_sync(~0u, o ? c0 : c1, 4);
      const uint32_t keep = o ? c1 : c0;
      sts_b32(at0 + j * kWgradTStep, __byte_perm(keep, got, sel0));
      sts_b32(at1 + j * kWgradTStep, __byte_perm(keep, got, sel1));
    }
    fence_proxy_async_shared();  // these writes before the TMA's reads
  }
  wgrad_epi_hand<kOut, kSelf>(self, zero, e, mb, col0, prob, wg, b, tid, true);
}

// wgrad_stage_f32 of a tile stored transposed: columns 64 hh.. of the chunk in `acc` as C^T's 64
// rows col0.. (wgrad_t_f32_at), one 4-byte store per element: 32 stores, as many shared-memory
// wavefronts as wgrad_stage_f32's 16 8-byte ones, and no shuffle.
// NOTE: both transposed stagings step from per-thread 32-bit shared addresses of j = 0: with
// each element's place computed whole, or from generic pointers, ptxas spilled the fused
// backward's consumers (288-472 bytes of stack, against 32 without the transposed form).
template <int kOut, bool kSelf>
__device__ __forceinline__ void wgrad_stage_f32_t(const float (&acc)[64], int hh, bool zero,
                                                  int e, int mb, int col0, int prob, int wg,
                                                  int b, uint32_t uses, int tid,
                                                  const WgradKernelArgs* self) {
  wgrad_epi_free<kSelf>(wg, b, uses, tid);
  if (!zero) {
    const uint32_t epi = smem_addr(wgrad_epi(wg, b));
    uint32_t at[2][2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int q = 0; q < 2; ++q) at[hr][q] = epi + wgrad_t_f32_at(tid, hr, q);
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
        for (int q = 0; q < 2; ++q)
          sts_f32(at[hr][q] + jj * kWgradTStep, acc[4 * (8 * hh + jj) + 2 * hr + q]);
      }
    }
    fence_proxy_async_shared();
  }
  wgrad_epi_hand<kOut, kSelf>(self, zero, e, mb, col0, prob, wg, b, tid, true);
}

// Store warp of consumer warpgroup wg (its lane 0): takes the chunks in order (buffers 0, 1, 0,
// ...), stores each chunk's two boxes (or the zero block twice) by TMA into its problem's C
// (probs[problem]; transposed as kT says) and gives the buffer back once the TMA has read it;
// the writes to C are waited for only at the end. kWgradF32Add adds the boxes onto C instead,
// and adds nothing for an expert without rows.
template <int kOut, int kT = kWgradTNone>
static __device__ __noinline__ void wgrad_storer(const WgradKernelArgs* probs, int wg) {
  for (uint32_t n = 0;; ++n) {
    const int b = n & 1;
    mbar_wait(&gsh.epi_full[wg][b], (n >> 1) & 1);
    const int e = vol(gsh.jobs[wg][b][0]);
    if (e < 0) break;
    const int mb = vol(gsh.jobs[wg][b][1]), col0 = vol(gsh.jobs[wg][b][2]);
    const bool zero = vol(gsh.jobs[wg][b][3]) != 0;
    const int prob = vol(gsh.jobs[wg][b][4]);
    wgrad_store_chunk<kOut>(probs[prob], zero ? wgrad_zero() : wgrad_epi(wg, b), zero, e, mb,
                            col0, wg, wgrad_transposed<kT>(prob));
    bulk_wait_read<0>();
    mbar_arrive(&gsh.epi_empty[wg][b]);
  }
  bulk_wait_all();  // C written before the block exits
}

// kGathered: the gathering kernel's consumers: stages filled in part by cp.async
// (wgrad_gather_producer), so a proxy fence before each k-block's MMAs; no store warps, so
// thread 0 stores each staged chunk itself from `self` (its one problem). kT: which tiles are
// staged transposed (WgradTrans).
template <int kOut, bool kGathered = false, int kT = kWgradTNone>
__device__ __forceinline__ void wgrad_consumer(int wg, const WgradKernelArgs* self = nullptr) {
  const int tid = threadIdx.x % 128;
  int stage = 0, prev_stage = 0;
  uint32_t phase = 0;
  float acc0[64], acc1[64];
  const uint64_t zero_a = wgmma_desc_mn(wgrad_zero(), 2048);
  const uint64_t zero_b = wgmma_desc_mn(wgrad_zero() + 2048, 2048);
  uint32_t n = 0;  // chunks handed to the store warp: chunk n goes through buffer n % 2
  for (;;) {
    mbar_wait(&gsh.full[stage], phase);
    const int e = vol(gsh.stage_tile[stage][0]);
    if (e < 0) break;
    const int mb = vol(gsh.stage_tile[stage][1]);
    const int nb = vol(gsh.stage_tile[stage][2]);
    const int k_blocks = vol(gsh.stage_tile[stage][3]);
    const int last_steps = vol(gsh.stage_tile[stage][4]);
    const int prob = vol(gsh.stage_tile[stage][5]);
    if (k_blocks == 0) {
      mbar_arrive(&gsh.empty[stage]);
      if (++stage == kWgradStages) stage = 0, phase ^= 1;
    } else {
      mma_kloop_wgrad<OperandBf16, kWgradStages, kGathered>(
          acc0, acc1, bwd_stages(), gsh.full, gsh.empty, k_blocks, last_steps, zero_a, zero_b,
          wg, stage, prev_stage, phase);
    }
    const bool zero = k_blocks == 0;
    const int col0 = nb * kTileN;
    if (kOut == kWgradBf16) {
      if (wgrad_transposed<kT>(prob)) {
        wgrad_stage_t<kOut, kGathered>(acc0, zero, e, mb, col0, prob, wg, 0, n >> 1, tid, self);
        wgrad_stage_t<kOut, kGathered>(acc1, zero, e, mb, col0 + 128, prob, wg, 1, n >> 1, tid,
                                       self);
      } else {
        wgrad_stage<kOut, kGathered>(acc0, zero, e, mb, col0, prob, wg, 0, n >> 1, tid, self);
        wgrad_stage<kOut, kGathered>(acc1, zero, e, mb, col0 + 128, prob, wg, 1, n >> 1, tid,
                                     self);
      }
      n += 2;
    } else if (wgrad_transposed<kT>(prob)) {
#pragma unroll
      for (int q = 0; q < 4; ++q, ++n)  // the same quarters, as C^T's rows col0 + 64 q..
        wgrad_stage_f32_t<kOut, kGathered>(q < 2 ? acc0 : acc1, q % 2, zero, e, mb,
                                           col0 + 64 * q, prob, wg, n & 1, n >> 1, tid, self);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q, ++n)  // 64-column quarters: acc0's halves, then acc1's
        wgrad_stage_f32<kOut, kGathered>(q < 2 ? acc0 : acc1, q % 2, zero, e, mb, col0 + 64 * q,
                                         prob, wg, n & 1, n >> 1, tid, self);
    }
  }
  if constexpr (kGathered) {  // C written before the block exits
    if (tid == 0) bulk_wait_all();
    return;
  }
  // The store warp's last job: it stops once it has written everything before it.
  mbar_wait(&gsh.epi_empty[wg][n & 1], ((n >> 1) & 1) ^ 1);
  if (tid == 0) {
    vol(gsh.jobs[wg][n & 1][0]) = -1;
    mbar_arrive(&gsh.epi_full[wg][n & 1]);
  }
}

// The weight-gradient tiles' shared state, by every thread of the block before its first
// __syncthreads: the zero operand of the steps past a group's end (written for the async proxy)
// and, by thread 0, the barriers (mbar_init_fence still to come).
__device__ __forceinline__ void wgrad_init(uint32_t full_arrivals = 1) {
  uint4* zero = reinterpret_cast<uint4*>(wgrad_zero());
  for (int i = threadIdx.x; i < kWgradZeroBytes / 16; i += blockDim.x) zero[i] = uint4{0, 0, 0, 0};
  fence_proxy_async_shared();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWgradStages; ++s) {
      mbar_init(&gsh.full[s], full_arrivals);
      mbar_init(&gsh.empty[s], 2 * 128);
    }
    for (int w = 0; w < 2; ++w) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(&gsh.epi_full[w][b], 1);   // the warpgroup's thread 0
        mbar_init(&gsh.epi_empty[w][b], 1);  // its store warp's lane 0
      }
    }
  }
}

// The weight-gradient kernels' body. kGather: -1, or the operand (0: A, 1: B) whose rows the
// producer warpgroup gathers (wgrad_gather_producer, from g; thread 0 also loads the other).
// kT: kWgradTNone, or kWgradTAll (every tile stored transposed, C [L, N, M]).
template <int kOut, int kGather, int kT>
__device__ __forceinline__ void wgrad_run(const WgradKernelArgs& k, const WgradGather& g) {
  wgrad_init(kGather < 0 ? 1 : 1 + kWgradGatherThreads);
  if (threadIdx.x == 0) mbar_init_fence();
  __syncthreads();
  const int n_tiles = k.num_experts * (k.m / kTileM) * (k.n / kTileN);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    const int warp = threadIdx.x / 32;
    if constexpr (kGather >= 0) {
      if (threadIdx.x == 0) tma_prefetch_map(kGather == 0 ? &k.map_b : &k.map_a);
      wgrad_gather_producer<kGather>(k, g, n_tiles);
    } else if (threadIdx.x == 0) {
      tma_prefetch_map(&k.map_a);
      tma_prefetch_map(&k.map_b);
      wgrad_producer(k, n_tiles);
    } else if ((warp == 1 || warp == 2) && threadIdx.x % 32 == 0) {
      tma_prefetch_map(&k.map_c);
      wgrad_storer<kOut, kT>(&k, warp - 1);
    }
  } else {
    setmaxnreg_inc<224>();
    if (kGather >= 0 && threadIdx.x == 128) tma_prefetch_map(&k.map_c);
    wgrad_consumer<kOut, (kGather >= 0), kT>(wg - 1, &k);
  }
}

// kTransposed: C^T stored, [L, N, M] (the same tiles, k order and sums; only the epilogue
// differs).
template <int kOut, bool kTransposed = false>
__global__ void __launch_bounds__(kLayerThreads, 1)
    wgrad_kernel(const __grid_constant__ WgradKernelArgs k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgrad_run<kOut, -1, kTransposed ? kWgradTAll : kWgradTNone>(k, WgradGather{});
#endif
}

// wgrad_kernel with operand kOperand (0: A, 1: B) gathered by the producer warpgroup
// (wgrad_gather_producer) and the chunks stored by the consumers themselves. The launcher builds
// the transposed form with operand 0 only (x's rows as A of x^T dgu).
template <int kOut, int kOperand, bool kTransposed = false>
__global__ void __launch_bounds__(kLayerThreads, 1)
    wgrad_gather_kernel(const __grid_constant__ WgradGatherKernelArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgrad_run<kOut, kOperand, kTransposed ? kWgradTAll : kWgradTNone>(a.k, a.g);
#endif
}

}  // namespace mok
