// The experts' backward from saved g / u in one launch (Hopper, sm_90a): the down projection's
// dgrad with the SwiGLU backward, the gate / up dgrad and both weight gradients, as tasks of
// one persistent kernel.
//
// Per expert e (rows [start_e, end_e) of the receive buffer, grouped by expert):
//   dh tiles      dh = dy @ w_down[e] (fp32), the SwiGLU backward from the saved fp32 g / u, the
//                 router-weight partials (the math of sm90_bwd.cuh's kSwigluSavedWide: the
//                 same bits; g / u in and hw / dgu out through the pipeline stages by TMA)
//                 -> hw, dgu, part; 128 rows x 256 intermediate columns;
//   d_a tiles     d_a = dgu @ w_gate_up[e] (the gate / up projections' input gradient, fp32
//                 accumulators, bf16 out); 128 rows x 256 hidden columns, k over 2I;
//   wgrad tiles   dW_gate_up[e] = dgu^T a, dW_down[e] = dy^T hw (sm90_bwd.cuh's weight-gradient
//                 tiles, the same bits).
// Tasks are numbered: every dh tile (expert, column block, row block), then every d_a tile in
// the same order, then per expert its dW_gate_up tiles and its dW_down tiles. Each block's
// producer thread claims the next task from one counter, so a task is claimed only after every
// task before it, and it waits only on tasks before it: a d_a tile on the dh tiles of its row
// block, a weight-gradient tile on every dh tile of its expert (counters raised by the dh
// tiles' consumers after their stores). Claimed tasks always finish (their producer loaded
// their stages before claiming the next one), so the waits cannot deadlock, whatever the grid
// and whichever blocks are resident. Every output element is written by one task with a fixed
// k order (no split-K, no atomics on data): the result does not depend on the grid or on which
// block ran what.
//
// Roles per block (384 threads) as in sm90_bwd.cuh: a producer thread, two consumer
// warpgroups, two store warps for the weight gradients. The dh and d_a tiles run over four
// 48 KiB stages; the weight-gradient tiles over three, whose output staging lies where the
// fourth was: a block's producer changes over once, after its last dh / d_a task, when the
// consumers have freed every stage.
//
// Waits on other blocks are bounded (Params::timeout_ns): on expiry the producer records the
// wait in the host-mapped error record, raises the abort word and stops claiming; every block
// then finishes what it holds and exits.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/waits.cuh"
#include "layer/counters.cuh"
#include "layer/sm90_bwd.cuh"
#include "params.h"

namespace mok {

// The task kinds a launch runs (a mask): a launch without kBwdRunDh takes hw / dgu as inputs.
enum BwdRun : int { kBwdRunDh = 1, kBwdRunDa = 2, kBwdRunWgrad = 4, kBwdRunAll = 7 };
enum BwdTask : int { kTaskDh = 0, kTaskDa = 1 };

constexpr int kFusedDgradStages = BwdPipe<kSwigluSavedWide>::kNumStages;
static_assert(kFusedDgradStages * kStageBytes <= kWgradStages * kStageBytes + 4 * kEpiBytes,
              "the weight gradients' zero block lies past the dgrad stages");
constexpr int kFusedSmem = kWgradSmem;

// A dh tile's epilogue runs over kDhEpiStages stages of the dgrad ring after its k-blocks. Stage
// q holds the saved g and u of the tile's 128 rows at its intermediate columns 32q.. (fp32, a
// 128-row x 32-column box each, 128-byte swizzle), loaded by the producer while the consumers
// run the tile's last k-blocks. Each consumer warpgroup writes hw, dg and du of its 64 rows into
// its own part of the stage (bf16, 64 rows x 32 columns each, 64-byte swizzle) and one of its
// threads stores them by TMA, as 16-row boxes up to its expert's end (group ends are multiples of
// 16). (Loaded and stored by every thread straight from and to global memory, this epilogue
// took over a third of the dh tiles' time: without it they ran 1.44 against 2.27 ms at
// DeepSeek-V3's per-rank shape; docs/perf-notes.md.)
constexpr int kDhEpiStages = 8;
constexpr int kDhEpiBox = kTileM * 128;     // g or u: 128 rows x 32 fp32
constexpr int kDhEpiWgBytes = 64 * 128;     // a warpgroup's 64 rows of a g or u box
constexpr int kDhEpiPiece = 64 * 64;        // a warpgroup's hw, dg or du: 64 rows x 32 bf16
static_assert(2 * kDhEpiBox + 2 * kDhEpiWgBytes <= kStageBytes, "a dh epilogue stage");

struct FusedBwdKernelArgs {
  Params p;                // error record, abort word, timeout
  SwigluBwdKernelArgs dh;  // map_dy, map_wd, ends, row_w, hw, dgu, part, gu32, sizes
  CUtensorMap map_dgu;     // dgu [rows, 2I], 128-row x 64-column boxes (A of d_a)
  CUtensorMap map_wgu;     // w_gate_up [L * 2I, H], 64 x 64 boxes (N-major B of d_a)
  CUtensorMap map_gu;      // gu32 [rows, 2I] fp32, 128-row x 32-column boxes (dh epilogue in)
  // hw out through dh.map_h_st (16-row x 32-column boxes, 64-byte swizzle), dgu through:
  CUtensorMap map_dgu_st;  // dgu [rows, 2I], the same boxes (out)
  uint16_t* d_a;           // [rows, H] bf16
  WgradKernelArgs wgrad[2];  // 0: dW_gate_up = dgu^T a (M 2I, N H); 1: dW_down = dy^T hw (H, I)
  // [0] the next task; then per row tile (tiles_before order) and per expert the dh tiles done.
  uint32_t* counters;
  int max_row_tiles;  // the row-tile counters' length
  int run;            // BwdRun mask
  int64_t fault;      // tests only: a dh task that never reports done (-1: none)
};

// The tile a dgrad stage's first k-block belongs to: kind (-1: the end of the dgrad tasks),
// first row, its expert's end row, column block, row tile, expert, task.
struct FusedShared {
  int task[kFusedDgradStages][7];
};
static __shared__ __align__(8) FusedShared fsh;

// How a launch's tasks are numbered (every block computes the same): dh tasks [0, da0), d_a
// tasks [da0, n_dgrad), weight-gradient tasks [n_dgrad, n_tasks).
struct FusedTasks {
  int row_tiles, dh_blocks, da_blocks, wgu_tiles, wd_tiles;
  int da0, n_dgrad, n_tasks;
  __device__ FusedTasks(const FusedBwdKernelArgs& f) {
    const SwigluBwdKernelArgs& k = f.dh;
    row_tiles = bsh.tiles_before[k.num_experts];
    dh_blocks = k.inter / 256;
    da_blocks = k.hidden / 256;
    wgu_tiles = (2 * k.inter / kTileM) * (k.hidden / kTileN);
    wd_tiles = (k.hidden / kTileM) * (k.inter / kTileN);
    const int n_dh = (f.run & kBwdRunDh) ? row_tiles * dh_blocks : 0;
    const int n_da = (f.run & kBwdRunDa) ? row_tiles * da_blocks : 0;
    const int n_wg = (f.run & kBwdRunWgrad) ? k.num_experts * (wgu_tiles + wd_tiles) : 0;
    da0 = n_dh;
    n_dgrad = n_dh + n_da;
    n_tasks = n_dgrad + n_wg;
  }
};

// Loads an N-major k-loop tile (A: 128 rows of `a` from row a_row, 64 k per stage; B: four
// 64-column boxes of `b` at columns b_col.., rows b_row + k..) into the dgrad stages, and its
// fields into the first stage's task entry.
__device__ __forceinline__ void fused_load_nb(const CUtensorMap* a, const CUtensorMap* b,
                                              int a_row, int b_row, int b_col, int k_blocks,
                                              const int (&fields)[7], int& stage,
                                              uint32_t& phase) {
  uint8_t* stages = bwd_stages();
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbar_wait(&bsh.empty[stage], phase ^ 1);
    if (kb == 0) {
#pragma unroll
      for (int q = 0; q < 7; ++q) vol(fsh.task[stage][q]) = fields[q];
    }
    uint8_t* sa = stages + stage * kStageBytes;
    const int kc = kb * OperandBf16::kTileK;
    mbar_arrive_expect_tx(&bsh.full[stage], kStageA + 4 * kBoxNB);
    tma_load_2d(sa, a, &bsh.full[stage], kc, a_row);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      tma_load_2d(sa + kStageA + q * kBoxNB, b, &bsh.full[stage], b_col + 64 * q, b_row + kc);
    if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
  }
}

// A dh tile's epilogue stages: g and u of its rows from row0, columns col0 + 32 q.. per stage q.
__device__ __forceinline__ void fused_load_dh_epi(const FusedBwdKernelArgs& f, int row0, int col0,
                                                  int& stage, uint32_t& phase) {
#pragma unroll 1
  for (int q = 0; q < kDhEpiStages; ++q) {
    mbar_wait(&bsh.empty[stage], phase ^ 1);
    uint8_t* sa = bwd_stages() + stage * kStageBytes;
    mbar_arrive_expect_tx(&bsh.full[stage], 2 * kDhEpiBox);
    const int col = col0 + kEpiCols * q;
    tma_load_2d(sa, &f.map_gu, &bsh.full[stage], col, row0);
    tma_load_2d(sa + kDhEpiBox, &f.map_gu, &bsh.full[stage], f.dh.inter + col, row0);
    if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
  }
}

// The end of the dgrad tasks: a stage of kind -1, then every other stage freed by the
// consumers (their memory is the weight gradients' next).
__device__ __forceinline__ void fused_dgrad_end(int stage, uint32_t phase) {
  mbar_wait(&bsh.empty[stage], phase ^ 1);
  vol(fsh.task[stage][0]) = -1;
  mbar_arrive(&bsh.full[stage]);
  for (int q = 1; q < kFusedDgradStages; ++q) {
    const int s = stage + q;
    mbar_wait(&bsh.empty[s % kFusedDgradStages], (s < kFusedDgradStages ? phase : phase ^ 1) ^ 1);
  }
}

__device__ __forceinline__ void fused_producer(const FusedBwdKernelArgs& f, const Ctx& c) {
  const FusedTasks t(f);
  const SwigluBwdKernelArgs& k = f.dh;
  uint32_t* next = f.counters;
  uint32_t* dh_rt = f.counters + 1;
  uint32_t* dh_e = dh_rt + f.max_row_tiles;
  const bool deps = (f.run & kBwdRunDh) != 0;
  int stage = 0, gstage = 0;
  uint32_t phase = 0, gphase = 0;
  bool dgrad = true, ok = true;
  for (;;) {
    const int i = ok ? static_cast<int>(atomicAdd(next, 1u)) : t.n_tasks;
    if (dgrad && i >= t.n_dgrad) {
      fused_dgrad_end(stage, phase);
      dgrad = false;
    }
    if (i >= t.n_tasks) break;
    if (i < t.n_dgrad) {
      const bool is_dh = i < t.da0;
      int e, row0, nb;
      find_tile(k, is_dh ? i : i - t.da0, is_dh ? t.dh_blocks : t.da_blocks, e, row0, nb);
      const int rt = bsh.tiles_before[e] + (row0 - group_start(k, e)) / kTileM;
      const int fields[7] = {is_dh ? kTaskDh : kTaskDa, row0, k.ends[e], nb, rt, e, i};
      if (is_dh) {
        fused_load_nb(&k.map_dy, &k.map_wd, row0, e * k.hidden, nb * 256,
                      k.hidden / OperandBf16::kTileK, fields, stage, phase);
        fused_load_dh_epi(f, row0, nb * 256, stage, phase);
        continue;
      }
      if (deps) {
        ok = wait_count(c, dh_rt + rt, t.dh_blocks, kWaitBwdDgrad, rt);
        if (!ok) continue;
        fence_proxy_async_global();  // dgu, stored by other blocks, read by TMA
      }
      fused_load_nb(&f.map_dgu, &f.map_wgu, row0, e * 2 * k.inter, nb * 256,
                    2 * k.inter / OperandBf16::kTileK, fields, stage, phase);
      continue;
    }
    const int local = i - t.n_dgrad;
    const int per_expert = t.wgu_tiles + t.wd_tiles;
    const int e = local / per_expert;
    int r = local % per_expert;
    const int prob = r < t.wgu_tiles ? 0 : 1;
    if (prob == 1) r -= t.wgu_tiles;
    if (deps) {
      const uint32_t need = (bsh.tiles_before[e + 1] - bsh.tiles_before[e]) * t.dh_blocks;
      ok = wait_count(c, dh_e + e, need, kWaitBwdDgrad, -1 - e);
      if (!ok) continue;
      fence_proxy_async_global();  // dgu and hw, stored by other blocks, read by TMA
    }
    const WgradKernelArgs& w = f.wgrad[prob];
    const int n_blocks = w.n / kTileN;
    wgrad_load_tile(w, prob, e, r / n_blocks, r % n_blocks, gstage, gphase);
  }
  wgrad_load_end(gstage, gphase);
}

// d_a's epilogue: warpgroup wg's 64 rows of the tile's 256 columns (acc0: 0..127, acc1:
// 128..255, the m64n128 layout of swiglu_bwd_epilogue) as bf16, rows before the group's end.
__device__ __forceinline__ void fused_da_epilogue(const FusedBwdKernelArgs& f,
                                                  const float (&acc0)[64],
                                                  const float (&acc1)[64], int row0, int end,
                                                  int nb, int wg, int warp, int lane) {
  const int H = f.dh.hidden;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + wg * 64 + warp * 16 + lane / 4 + 8 * hr;
    if (row >= end) continue;
    uint16_t* at = f.d_a + static_cast<int64_t>(row) * H + nb * 256 + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(at + 8 * j) =
          pack_bf16x2(acc0[4 * j + 2 * hr], acc0[4 * j + 2 * hr + 1]);
      *reinterpret_cast<uint32_t*>(at + 128 + 8 * j) =
          pack_bf16x2(acc1[4 * j + 2 * hr], acc1[4 * j + 2 * hr + 1]);
    }
  }
}

// A dh tile's epilogue (the SwiGLU backward of swiglu_bwd_epilogue, the same bits) over its
// kDhEpiStages stages, for warpgroup wg's 64 rows: dh of the tile's columns 0..127 in acc0,
// 128..255 in acc1, in the m64n128 layout (thread (warp, lane): rows warp * 16 + lane / 4 (+ 8),
// columns 8j + 2 (lane % 4) (+ 1)).
__device__ __forceinline__ void fused_dh_epilogue(const FusedBwdKernelArgs& f,
                                                  const float (&acc0)[64],
                                                  const float (&acc1)[64], int row0, int end,
                                                  int nb, int wg, int tid, int& stage,
                                                  uint32_t& phase) {
  const SwigluBwdKernelArgs& k = f.dh;
  const int warp = tid / 32, lane = tid % 32, x = lane / 4;
  const int row_hr0 = row0 + wg * 64 + warp * 16 + x;  // the thread's rows: this and + 8
  float psum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < kDhEpiStages; ++q) {
    const float(&d)[64] = q < 4 ? acc0 : acc1;
    float w[2];  // the rows' weights, read per stage (L1 hits): kept across them, they spilled
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = row_hr0 + 8 * hr;
      w[hr] = k.row_w == nullptr ? 1.0f : k.row_w[row < end ? row : 0];
    }
    mbar_wait(&bsh.full[stage], phase);
    uint8_t* sa = bwd_stages() + stage * kStageBytes;
    const uint8_t* g_rows = sa + wg * kDhEpiWgBytes;
    uint8_t* u_rows = sa + kDhEpiBox + wg * kDhEpiWgBytes;  // then du
    uint8_t* hw_out = sa + 2 * kDhEpiBox + wg * kDhEpiWgBytes;
    uint8_t* dg_out = hw_out + kDhEpiPiece;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * (q % 4) + jj;  // columns 8j.. of the 128-column half
        const float2 g2 = lds_f2(g_rows + epi_f32_at(tid, hr, jj));
        const float2 u2 = lds_f2(u_rows + epi_f32_at(tid, hr, jj));
        float hw[2], dg[2], du[2];
        swiglu_grad(g2.x, u2.x, d[4 * j + 2 * hr], w[hr], psum[hr], hw[0], dg[0], du[0]);
        swiglu_grad(g2.y, u2.y, d[4 * j + 2 * hr + 1], w[hr], psum[hr], hw[1], dg[1], du[1]);
        const int out = epi_bf16_at(tid, hr, jj);
        *reinterpret_cast<uint32_t*>(hw_out + out) = pack_bf16x2(hw[0], hw[1]);
        *reinterpret_cast<uint32_t*>(dg_out + out) = pack_bf16x2(dg[0], dg[1]);
      }
    }
    // du into the warpgroup's u rows once all of them are read (computed again from g: holding
    // it in registers over the barrier spilled)
    named_sync(1 + wg, 128);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * (q % 4) + jj;
        const float2 g2 = lds_f2(g_rows + epi_f32_at(tid, hr, jj));
        *reinterpret_cast<uint32_t*>(u_rows + epi_bf16_at(tid, hr, jj)) =
            pack_bf16x2(swiglu_du(g2.x, d[4 * j + 2 * hr], w[hr]),
                        swiglu_du(g2.y, d[4 * j + 2 * hr + 1], w[hr]));
      }
    }
    fence_proxy_async_shared();  // these writes before the TMA's reads
    named_sync(1 + wg, 128);
    if (tid == 0) {
      const int col = (2 * nb + q / 4) * 128 + kEpiCols * (q % 4);
#pragma unroll
      for (int b = 0; b < 64 / kEpiStoreRows; ++b) {
        const int row = row0 + wg * 64 + b * kEpiStoreRows;
        if (row >= end) break;
        const int at = b * kEpiStoreRows * 64;
        tma_store_2d(&f.dh.map_h_st, hw_out + at, col, row);
        tma_store_2d(&f.map_dgu_st, dg_out + at, col, row);
        tma_store_2d(&f.map_dgu_st, u_rows + at, k.inter + col, row);
      }
      bulk_commit();
      bulk_wait_read<0>();  // the stage read: the producer may fill it again
    }
    mbar_arrive(&bsh.empty[stage]);
    if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
    if (q % 4 == 3) {  // a 128-column half done: its router-weight partials
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = row_hr0 + 8 * hr;
        float p = psum[hr];
        p += __shfl_xor_sync(~0u, p, 1);
        p += __shfl_xor_sync(~0u, p, 2);
        if (row < end && k.part != nullptr && lane % 4 == 0)
          k.part[static_cast<int64_t>(2 * nb + q / 4) * k.rows + row] = p;
        psum[hr] = 0.0f;
      }
    }
  }
  if (tid == 0) bulk_wait_all();  // hw / dgu written before the tile is reported done
}

template <int kOut>
__device__ __forceinline__ void fused_consumer(const FusedBwdKernelArgs& f, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  uint32_t* dh_rt = f.counters + 1;
  uint32_t* dh_e = dh_rt + f.max_row_tiles;
  int stage = 0, prev_stage = 0;
  uint32_t phase = 0;
  float acc0[64], acc1[64];
  for (;;) {
    mbar_wait(&bsh.full[stage], phase);
    const int kind = vol(fsh.task[stage][0]);
    if (kind < 0) break;
    const int row0 = vol(fsh.task[stage][1]), end = vol(fsh.task[stage][2]);
    const int nb = vol(fsh.task[stage][3]), rt = vol(fsh.task[stage][4]);
    const int e = vol(fsh.task[stage][5]), task = vol(fsh.task[stage][6]);
    const int k_blocks = (kind == kTaskDh ? f.dh.hidden : 2 * f.dh.inter) / OperandBf16::kTileK;
    mma_kloop<OperandBf16, kFullNBWide, kFusedDgradStages>(
        acc0, acc1, bwd_stages(), bsh.full, bsh.empty, k_blocks, 0, wg, stage, prev_stage, phase);
    if (kind == kTaskDh) {
      fused_dh_epilogue(f, acc0, acc1, row0, end, nb, wg, tid, stage, phase);
      // Publish: hw / dgu (written by this block's TMA stores, complete) are read by other
      // blocks' TMA; one release after both warpgroups' barrier covers them.
      fence_proxy_async_global();
      named_sync(3, 256);
      if (threadIdx.x == 128 && task != f.fault) {
        red_add_release_gpu(dh_rt + rt, 1u);
        red_add_release_gpu(dh_e + e, 1u);
      }
    } else {
      fused_da_epilogue(f, acc0, acc1, row0, end, nb, wg, warp, lane);
    }
  }
  wgrad_consumer<kOut>(wg);
}

template <int kOut>
__global__ void __launch_bounds__(kLayerThreads, 1)
    bwd_fused_kernel(const __grid_constant__ FusedBwdKernelArgs f) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const Ctx c(f.p);
  if (block_aborted(c)) return;  // an earlier kernel of this record failed
  wgrad_init();
  if (threadIdx.x < 32) count_tiles(f.dh);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kFusedDgradStages; ++s) {
      mbar_init(&bsh.full[s], 1);
      mbar_init(&bsh.empty[s], 2 * 128);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
      if (f.run & kBwdRunDh) tma_prefetch_map(&f.dh.map_dy), tma_prefetch_map(&f.dh.map_wd);
      if (f.run & kBwdRunDa) tma_prefetch_map(&f.map_dgu), tma_prefetch_map(&f.map_wgu);
      fused_producer(f, c);
    } else if ((warp == 1 || warp == 2) && threadIdx.x % 32 == 0) {
      wgrad_storer<kOut>(f.wgrad, warp - 1);
    }
  } else {
    setmaxnreg_inc<224>();
    fused_consumer<kOut>(f, wg - 1);
  }
#endif
}

}  // namespace mok
