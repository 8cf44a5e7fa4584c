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
//                 tiles, the same bits; with kWguT dW_gate_up as (a^T dgu)^T, the transposed
//                 form of the standalone kernel).
// Tasks are numbered: every dh tile (expert, column block, row block), then every d_a tile in
// the same order, then per expert its dW_gate_up tiles and its dW_down tiles.
//
// With the token transfers (FusedBwdKernelArgs::xfer.row_src set; one rank) the launch also
// moves the rows itself:
//   copy tiles    the reverse combine: each receive row of a row tile gets its token's output
//                 gradient and input row (grad_out, x -> the dy and a rows; zeros in rows
//                 without a token); the copies of expert e + copy_ahead's row tiles are
//                 numbered just before expert e's dh tiles, so they run under earlier GEMMs;
//   d_a tiles     store each row into its (token, k) slot instead of its receive row;
//   sum tasks     after every d_a tile, the reverse dispatch: dx[t] = bf16(dx_shared[t] +
//                 slot[t, 0] + slot[t, 1] + ...) in fixed k order (comm/combine.cuh's sum, so
//                 the bits of the combine kernel), numbered after the d_a tiles.
// A dh tile then also waits for the copy of its row tile, a sum task for every d_a tile.
//
// With peers (BwdTransfers::row_rank set: several ranks, a workspace in Params) the rows travel
// between ranks inside the launch, in the forward's manner (layer/sm90_fwd.cuh), through
// signals of the backward's own epochs (Params::epoch):
//   task 0's     claimer raises every rank's "slots free" before anything else (this rank's
//                stream finished every earlier read of its slots, whichever kernel made them);
//   stage tasks  numbered first: copy 32 of this rank's tokens' x and grad_out rows into its
//                symmetric staging regions, once every peer's "slots filled" of the previous
//                call says it finished reading them;
//   publish      one task after them: waits for them, raises every rank's "staged";
//   copy tiles   read their rows from the source ranks' staging regions (after every rank's
//                "staged", waited once per block);
//   d_a tiles    store each row into its home rank's (token, k) slot over NVLink (after every
//                rank's "slots free", once per block); a row tile's first d_a tile also stages
//                its rows' router-weight gradients (the dh tiles' partials summed in column
//                order) in the symmetric row_grads region, for the home ranks to read after
//                the launch;
//   fill         one task after every d_a tile: raises every rank's "slots filled";
//   sum tasks    after every rank's "slots filled" (once per block), as at one rank.
// Every wait is bounded and recorded; every cross-rank wait is on a task every rank numbers
// before the waiting one (or on a launch's start), so the launch cannot deadlock.
// Each block's producer thread claims the next task from one counter, so a task is claimed
// only after every task before it, and it waits only on tasks before it: a d_a tile on the dh
// tiles of its row block, a weight-gradient tile on every dh tile of its expert (counters
// raised by the dh tiles' consumers after their stores). Claimed tasks always finish (their
// producer loaded their stages before claiming the next one), so the waits cannot deadlock,
// whatever the grid and whichever blocks are resident. Every output element is written by one
// task with a fixed k order (no split-K, no atomics on data): the result does not depend on
// the grid or on which block ran what.
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
#include <new>

#include "common/rows.cuh"
#include "common/waits.cuh"
#include "layer/counters.cuh"
#include "layer/sm90_bwd.cuh"
#include "params.h"

namespace mok {

// The task kinds a launch runs (a mask): a launch without kBwdRunDh takes hw / dgu as inputs.
enum BwdRun : int { kBwdRunDh = 1, kBwdRunDa = 2, kBwdRunWgrad = 4, kBwdRunAll = 7 };
enum BwdTask : int { kTaskDh = 0, kTaskDa = 1, kTaskCopy = 2, kTaskSum = 3, kTaskStage = 4 };

// Tokens per sum task (transfers).
constexpr int kSumTokens = 32;
constexpr int kConsumerWarps = 8;

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

// A d_a tile's staged epilogue (FusedBwdKernelArgs::da_staged, no transfers) runs over
// kDaEpiStages stages of the dgrad ring after its k-blocks, which the producer hands over empty:
// stage q takes the tile's columns 128 q.. (acc0, then acc1), each consumer warpgroup's 64 rows
// as two 64-column halves of 64 rows x 128 bytes in the 128-byte swizzle (8 KiB each), stored by
// one of its threads as 16-row boxes up to its expert's end. (Stored by every thread as 4-byte
// words straight to global memory, each warp instruction half of eight 32-byte sectors, as with
// transfers still.)
constexpr int kDaEpiStages = 2;
constexpr int kDaEpiHalf = 64 * 128;          // 64 rows x 64 bf16 columns
constexpr int kDaEpiWgBytes = 2 * kDaEpiHalf;  // a warpgroup's 64 rows x 128 columns
static_assert(2 * kDaEpiWgBytes <= kStageBytes, "a d_a epilogue stage");
static_assert(kDaEpiStages < kFusedDgradStages, "the d_a epilogue leaves the ring a stage");

// The token transfers of a launch that runs them (row_src set): bf16 rows of H columns.
struct BwdTransfers {
  const uint16_t* grad_out;  // [T, H] the layer's output gradient
  const uint16_t* x;         // [T, H] the layer's input
  const int32_t* row_src;    // [rows] token * K + k of each receive row (-1: no token); or null
  uint16_t* dy_rows;         // [rows, H] out: grad_out by receive row (dh.map_dy's memory)
  uint16_t* a_rows;          // [rows, H] out: x by receive row (wgrad[0]'s B; kWguT: its A)
  uint16_t* slots;           // [T * K, H] d_a by (token, k)
  const float* dx_shared;    // [T, H] fp32, the shared expert's input gradient, or null
  uint16_t* dx;              // [T, H] out
  int num_tokens, num_topk;
  int dedup;  // sum as the dedup combine does (a bf16 partial of the k rows, then dx_shared)
  int copy_ahead;  // experts whose row copies are numbered ahead of their dh tiles (>= 1)
  // With peers (else null / 0): each receive row's source rank (Params' schedule), and the
  // symmetric regions of grad_out's staged rows and of the rows' router-weight gradients.
  const int32_t* row_rank;
  int64_t off_dy, off_row_grads;
};

struct FusedBwdKernelArgs {
  Params p;                // error record, abort word, timeout
  SwigluBwdKernelArgs dh;  // map_dy, map_wd, ends, row_w, hw, dgu, part, gu32, sizes
  CUtensorMap map_dgu;     // dgu [rows, 2I], 128-row x 64-column boxes (A of d_a)
  CUtensorMap map_wgu;     // w_gate_up [L * 2I, H], 64 x 64 boxes (N-major B of d_a)
  CUtensorMap map_gu;      // gu32 [rows, 2I] fp32, 128-row x 32-column boxes (dh epilogue in)
  // hw out through dh.map_h_st (16-row x 32-column boxes, 64-byte swizzle), dgu through:
  CUtensorMap map_dgu_st;  // dgu [rows, 2I], the same boxes (out)
  uint16_t* d_a;           // [rows, H] bf16
  // d_a out by TMA (16-row x 64-column boxes, 128-byte swizzle) where its epilogue is staged
  // (da_staged, no transfers: fused_da_epilogue_staged); else each thread stores its own.
  CUtensorMap map_da_st;
  int da_staged;
  // 0: dW_gate_up = dgu^T a (M 2I, N H; with kWguT a^T dgu, M H, N 2I, stored transposed);
  // 1: dW_down = dy^T hw (M H, N I)
  WgradKernelArgs wgrad[2];
  BwdTransfers xfer;
  // [0] the next task; then per row tile (tiles_before order) and per expert the dh tiles done;
  // then per row tile its copy done, the d_a tiles done and the stage tasks done (transfers).
  uint32_t* counters;
  int max_row_tiles;  // the row-tile counters' length
  int run;            // BwdRun mask
  int64_t fault;      // tests only: a dh task that never reports done (-1: none)
};

// The counters' parts (FusedBwdKernelArgs::counters, in that order).
struct FusedCounters {
  uint32_t* next;     // the next task
  uint32_t* dh_rt;    // per row tile: its dh tiles done
  uint32_t* dh_e;     // per expert: its dh tiles done
  uint32_t* copied;   // per row tile: its rows copied (transfers)
  uint32_t* da_done;  // the d_a tiles done (transfers)
  uint32_t* staged;   // the stage tasks done (peers)
  __device__ explicit FusedCounters(const FusedBwdKernelArgs& f)
      : next(f.counters),
        dh_rt(next + 1),
        dh_e(dh_rt + f.max_row_tiles),
        copied(dh_e + f.dh.num_experts),
        da_done(copied + f.max_row_tiles),
        staged(da_done + 1) {}
};

// The tile a dgrad stage's first k-block belongs to: kind (-1: the end of the dgrad tasks),
// first row, its expert's end row, column block, row tile, expert, task. A copy or sum task
// takes a stage without data.
struct FusedShared {
  int task[kFusedDgradStages][7];
};

static __shared__ __align__(8) FusedShared fsh;

// How a launch's tasks are numbered (every block computes the same): dh tasks [0, da0), d_a
// tasks [da0, n_dgrad), weight-gradient tasks [n_dgrad, n_tasks).
// With transfers: copy and dh tasks interleaved in [pre, da0), d_a tasks [da0, da_end), sum
// tasks [sum0, n_dgrad). With peers also stage tasks [0, n_stage), the publish task n_stage
// (pre = n_stage + 1), and the fill task da_end (sum0 = da_end + 1).
struct FusedTasks {
  int row_tiles, dh_blocks, da_blocks, wgu_tiles, wd_tiles;
  int n_stage, pre, da0, da_end, sum0, n_dgrad, n_tasks;
  bool xfer, peers;
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
    xfer = f.xfer.row_src != nullptr;
    peers = f.xfer.row_rank != nullptr;
    const int n_copy = xfer ? row_tiles : 0;
    const int n_sum = xfer ? (f.xfer.num_tokens + kSumTokens - 1) / kSumTokens : 0;
    n_stage = peers ? n_sum : 0;
    pre = peers ? n_stage + 1 : 0;
    da0 = pre + n_copy + n_dh;
    da_end = da0 + n_da;
    sum0 = da_end + (peers ? 1 : 0);
    n_dgrad = sum0 + n_sum;
    n_tasks = n_dgrad + n_wg;
  }
};

// A task before da0 -> kind (kTaskDh or kTaskCopy), expert, first row, column block (dh) and
// row tile. Without transfers every one is a dh tile in find_tile's order. With them (D =
// copy_ahead), the copies of experts [0, D) come first, then per expert e the copies of expert
// e + D and the dh tiles of e: expert e's block starts at tiles_before[min(e + D, L)] +
// dh_blocks * tiles_before[e] (non-decreasing in e).
__device__ __forceinline__ void find_dh_or_copy(const SwigluBwdKernelArgs& k, const FusedTasks& t,
                                                int kCopyAhead, int i, int& kind, int& e,
                                                int& row0, int& nb, int& rt) {
  const int L = k.num_experts;
  const int* tb = bsh.tiles_before;
  kind = kTaskDh;
  if (!t.xfer) {
    find_tile(k, i, t.dh_blocks, e, row0, nb);
    rt = tb[e] + (row0 - group_start(k, e)) / kTileM;
    return;
  }
  i -= t.pre;  // the stage and publish tasks come first
  int copy = i;  // the row tile of a copy task
  if (i >= tb[min(kCopyAhead, L)]) {
    int lo = 0, hi = L - 1;
    while (lo < hi) {  // the last expert whose block starts at or before i
      const int mid = (lo + hi + 1) / 2;
      if (tb[min(mid + kCopyAhead, L)] + t.dh_blocks * tb[mid] <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int local = i - tb[min(lo + kCopyAhead, L)] - t.dh_blocks * tb[lo];
    const int ahead = lo + kCopyAhead;
    const int copies = ahead < L ? tb[ahead + 1] - tb[ahead] : 0;
    if (local >= copies) {
      e = lo;
      const int m_tiles = tb[e + 1] - tb[e];
      const int d = local - copies;
      nb = d / m_tiles;
      rt = tb[e] + d % m_tiles;
      row0 = group_start(k, e) + (d % m_tiles) * kTileM;
      return;
    }
    copy = tb[ahead] + local;
  }
  kind = kTaskCopy;
  find_tile(k, copy, 1, e, row0, nb);
  rt = copy;
}

// Hands a task without operands (a copy or a sum) to the consumers through a stage.
__device__ __forceinline__ void fused_hand(const int (&fields)[7], int& stage, uint32_t& phase) {
  mbar_wait(&bsh.empty[stage], phase ^ 1);
#pragma unroll
  for (int q = 0; q < 7; ++q) vol(fsh.task[stage][q]) = fields[q];
  mbar_arrive(&bsh.full[stage]);
  if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
}

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

// Peers: waits (one thread) until signal `kind` from every rank reached `target`.
__device__ __forceinline__ bool peers_reached(const Ctx& c, int kind, uint64_t target) {
  for (int r = 0; r < c.p.num_ranks; ++r)
    if (!wait_ge(c, c.my_signal(kind, r), target, kind, r)) return false;
  return true;
}

// Peers: stores `value` into signal `kind` on every rank (one thread), after a system fence.
__device__ __forceinline__ void peers_store(const Ctx& c, int kind, uint64_t value) {
  __threadfence_system();
  for (int r = 0; r < c.p.num_ranks; ++r) st_release_sys(c.peer_signal(r, kind), value);
}

// Peers: every calling thread acquires signal `kind` of every rank (the producer waited for
// them; this orders the thread's own reads of what they publish).
__device__ __forceinline__ void peers_acquire(const Ctx& c, int kind) {
  for (int r = 0; r < c.p.num_ranks; ++r) (void)ld_acquire_sys(c.my_signal(kind, r));
}

__device__ __forceinline__ void fused_producer(const FusedBwdKernelArgs& f, const Ctx& c) {
  // NOTE: in shared memory: in registers the numbering and the peers' state pushed this one
  // thread into local-memory spills
  __shared__ __align__(8) char task_words[sizeof(FusedTasks)];
  new (task_words) FusedTasks(f);
  const FusedTasks& t = *reinterpret_cast<const FusedTasks*>(task_words);
  const SwigluBwdKernelArgs& k = f.dh;
  const FusedCounters cnt(f);
  const bool deps = (f.run & kBwdRunDh) != 0;
  const uint64_t epoch = static_cast<uint64_t>(c.p.epoch);
  int stage = 0, gstage = 0;
  uint32_t phase = 0, gphase = 0;
  bool dgrad = true, ok = true;
  // Peers: the cross-rank waits this block passed (each once per launch), a bit each.
  uint32_t seen = 0;
  const auto reached = [&](int bit, int kind, uint64_t target) {
    if (seen & (1u << bit)) return true;
    if (!peers_reached(c, kind, target)) return false;
    seen |= 1u << bit;
    return true;
  };
  for (;;) {
    const int i = ok ? static_cast<int>(atomicAdd(cnt.next, 1u)) : t.n_tasks;
    // NOTE: raised by the block that claims the first task, before any wait of its own: a
    // block that runs (not block 0, which the launch does not promise to be resident).
    if (t.peers && i == 0) peers_store(c, kSigBwdSlotsFree, epoch);
    if (dgrad && i >= t.n_dgrad) {
      fused_dgrad_end(stage, phase);
      dgrad = false;
    }
    if (i >= t.n_tasks) break;
    if (i < t.pre) {
      if (i < t.n_stage) {  // a stage task: the peers finished reading the previous call's rows
        ok = reached(0, kSigBwdSlotsFilled, epoch - 1);
        if (!ok) continue;
        const int fields[7] = {kTaskStage, i * kSumTokens, 0, 0, 0, 0, i};
        fused_hand(fields, stage, phase);
      } else {  // publish: every stage task done
        ok = wait_count(c, cnt.staged, static_cast<uint32_t>(t.n_stage), kWaitBwdStaged, 0);
        if (ok) peers_store(c, kSigBwdStaged, epoch);
      }
      continue;
    }
    if (t.peers && i == t.da_end) {  // fill: every d_a row pushed (fenced by its tile)
      ok = wait_count(c, cnt.da_done, static_cast<uint32_t>(t.da_end - t.da0), kWaitBwdDa, -1);
      if (ok) peers_store(c, kSigBwdSlotsFilled, epoch);
      continue;
    }
    if (i >= t.sum0 && i < t.n_dgrad) {  // a sum task: every d_a tile stored
      if (t.peers) {
        ok = reached(3, kSigBwdSlotsFilled, epoch);
      } else {
        const int n_da = t.da_end - t.da0;
        ok = wait_count(c, cnt.da_done, static_cast<uint32_t>(n_da), kWaitBwdDa, i - t.sum0);
      }
      if (!ok) continue;
      const int fields[7] = {kTaskSum, (i - t.sum0) * kSumTokens, 0, 0, 0, 0, i};
      fused_hand(fields, stage, phase);
      continue;
    }
    if (i < t.n_dgrad) {
      const bool is_dh = i < t.da0;
      int kind = kTaskDa, e, row0, nb, rt;
      if (is_dh) {
        find_dh_or_copy(k, t, f.xfer.copy_ahead, i, kind, e, row0, nb, rt);
      } else {
        find_tile(k, i - t.da0, t.da_blocks, e, row0, nb);
        rt = bsh.tiles_before[e] + (row0 - group_start(k, e)) / kTileM;
      }
      const int fields[7] = {kind, row0, k.ends[e], nb, rt, e, i};
      if (kind == kTaskCopy) {
        if (t.peers) ok = reached(1, kSigBwdStaged, epoch);
        if (!ok) continue;
        fused_hand(fields, stage, phase);
        continue;
      }
      if (kind == kTaskDh) {
        if (t.xfer) {  // the dy rows of the tile, copied by another task (generic stores)
          ok = wait_count(c, cnt.copied + rt, 1u, kWaitBwdCopy, rt);
          if (!ok) continue;
          fence_proxy_async_global();
        }
        fused_load_nb(&k.map_dy, &k.map_wd, row0, e * k.hidden, nb * 256,
                      k.hidden / OperandBf16::kTileK, fields, stage, phase);
        fused_load_dh_epi(f, row0, nb * 256, stage, phase);
        continue;
      }
      if (t.peers) ok = reached(2, kSigBwdSlotsFree, epoch);
      if (!ok) continue;
      if (deps) {
        ok = wait_count(c, cnt.dh_rt + rt, t.dh_blocks, kWaitBwdDgrad, rt);
        if (!ok) continue;
        fence_proxy_async_global();  // dgu, stored by other blocks, read by TMA
      }
      fused_load_nb(&f.map_dgu, &f.map_wgu, row0, e * 2 * k.inter, nb * 256,
                    2 * k.inter / OperandBf16::kTileK, fields, stage, phase);
      if (f.da_staged && !t.xfer) {
#pragma unroll 1
        for (int q = 0; q < kDaEpiStages; ++q) {  // empty stages for the staged epilogue
          mbar_wait(&bsh.empty[stage], phase ^ 1);
          mbar_arrive(&bsh.full[stage]);
          if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
        }
      }
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
      ok = wait_count(c, cnt.dh_e + e, need, kWaitBwdDgrad, -1 - e);
      if (!ok) continue;
      fence_proxy_async_global();  // dgu and hw, stored by other blocks, read by TMA
    }
    const WgradKernelArgs& w = f.wgrad[prob];
    const int n_blocks = w.n / kTileN;
    wgrad_load_tile(w, prob, e, r / n_blocks, r % n_blocks, gstage, gphase);
  }
  wgrad_load_end(gstage, gphase);
}

// Peers: the symmetric region at `off` of `rank`, as bf16 rows.
__device__ __forceinline__ uint16_t* sym_rows(const Ctx& c, int rank, int64_t off) {
  return reinterpret_cast<uint16_t*>(c.sym(rank, off));
}

// A stage task (peers): this rank's tokens [t0, t0 + kSumTokens) of x and grad_out into its
// symmetric staging regions; consumer warp cw of 8.
__device__ __forceinline__ void fused_stage_tokens(const FusedBwdKernelArgs& f, const Ctx& c,
                                                   int t0, int cw, int lane) {
  const BwdTransfers& x = f.xfer;
  const int64_t H = f.dh.hidden;
  const int n16 = static_cast<int>(H / 8);
  uint16_t* xs = sym_rows(c, c.p.rank, c.p.off_x);
  uint16_t* dys = sym_rows(c, c.p.rank, x.off_dy);
  const int last = min(t0 + kSumTokens, x.num_tokens);
  for (int64_t t = t0 + cw; t < last; t += kConsumerWarps) {
    warp_copy_row_lean(reinterpret_cast<int4*>(xs + t * H),
                       reinterpret_cast<const int4*>(x.x + t * H), n16, lane);
    warp_copy_row_lean(reinterpret_cast<int4*>(dys + t * H),
                       reinterpret_cast<const int4*>(x.grad_out + t * H), n16, lane);
  }
}

// A copy task: the rows [row0, min(row0 + 128, end)) of the dy and a buffers from their
// tokens' grad_out and x rows (zeros for a row without a token); consumer warp cw of 8. With
// peers the token rows are read from their source rank's staging regions.
__device__ __forceinline__ void fused_copy_rows(const FusedBwdKernelArgs& f, const Ctx& c,
                                                int row0, int end, int cw, int lane) {
  const BwdTransfers& x = f.xfer;
  const int64_t H = f.dh.hidden;
  const int n16 = static_cast<int>(H / 8);
  const int last = min(row0 + kTileM, end);
  for (int row = row0 + cw; row < last; row += kConsumerWarps) {
    const int s = x.row_src[row];
    int4* dy = reinterpret_cast<int4*>(x.dy_rows + row * H);
    int4* a = reinterpret_cast<int4*>(x.a_rows + row * H);
    if (s >= 0) {
      const int64_t token = s / x.num_topk;
      const uint16_t* go = x.grad_out;
      const uint16_t* xr = x.x;
      if (x.row_rank != nullptr) {
        const int src = x.row_rank[row];
        go = sym_rows(c, src, x.off_dy);
        xr = sym_rows(c, src, c.p.off_x);
      }
      warp_copy_row_lean(dy, reinterpret_cast<const int4*>(go + token * H), n16, lane);
      warp_copy_row_lean(a, reinterpret_cast<const int4*>(xr + token * H), n16, lane);
    } else {
      for (int q = lane; q < n16; q += 32) dy[q] = a[q] = make_int4(0, 0, 0, 0);
    }
  }
}

// A sum task: dx of tokens [t0, t0 + kSumTokens), one token per consumer warp at a time, with
// the combine kernels' arithmetic (comm/combine.cuh): fp32, k order, bf16 once; with dedup, the
// partial of the token's rows first (bf16), then dx_shared + partial (its one owner rank).
__device__ __forceinline__ void fused_sum_tokens(const FusedBwdKernelArgs& f, int t0, int cw,
                                                 int lane) {
  const BwdTransfers& x = f.xfer;
  const int K = x.num_topk;
  const int64_t H = f.dh.hidden;
  const int n16 = static_cast<int>(H / 8);
  const int last = min(t0 + kSumTokens, x.num_tokens);
  for (int t = t0 + cw; t < last; t += kConsumerWarps) {
    const uint4* rows = reinterpret_cast<const uint4*>(x.slots + static_cast<int64_t>(t) * K * H);
    const void* init = x.dx_shared == nullptr ? nullptr : x.dx_shared + t * H;
    uint4* out = reinterpret_cast<uint4*>(x.dx + t * H);
    for (int c = lane; c < n16; c += 32) {
      OrderedSum8 acc;
      acc.start(x.dedup ? nullptr : init, true, c);
      add_in_k_order<8>(
          acc, K,
          [&](int k, bool valid) { return valid ? rows[k * n16 + c] : make_uint4(0, 0, 0, 0); },
          [](int) { return 1.0f; });
      if (x.dedup) {
        const uint4 partial = acc.bf16();
        acc.start(init, true, c);
        acc.add(1.0f, partial);
      }
      out[c] = acc.bf16();
    }
  }
}

// d_a's epilogue: warpgroup wg's 64 rows of the tile's 256 columns (acc0: 0..127, acc1:
// 128..255, the m64n128 layout of swiglu_bwd_epilogue) as bf16, rows before the group's end.
// With peers the slot lies on the row's home rank (a store over NVLink).
__device__ __forceinline__ void fused_da_epilogue(const FusedBwdKernelArgs& f, const Ctx& c,
                                                  const float (&acc0)[64],
                                                  const float (&acc1)[64], int row0, int end,
                                                  int nb, int wg, int warp, int lane) {
  const int H = f.dh.hidden;
  const int32_t* slot_of = f.xfer.row_src;  // with transfers: the row's (token, k) slot
  uint16_t* out = slot_of == nullptr ? f.d_a : f.xfer.slots;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + wg * 64 + warp * 16 + lane / 4 + 8 * hr;
    if (row >= end) continue;
    const int dst = slot_of == nullptr ? row : slot_of[row];
    if (dst < 0) continue;  // a row without a token
    uint16_t* base = out;
    if (f.xfer.row_rank != nullptr) base = sym_rows(c, f.xfer.row_rank[row], c.p.off_slots);
    uint16_t* at = base + static_cast<int64_t>(dst) * H + nb * 256 + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(at + 8 * j) =
          pack_bf16x2(acc0[4 * j + 2 * hr], acc0[4 * j + 2 * hr + 1]);
      *reinterpret_cast<uint32_t*>(at + 128 + 8 * j) =
          pack_bf16x2(acc1[4 * j + 2 * hr], acc1[4 * j + 2 * hr + 1]);
    }
  }
}

// d_a's epilogue through kDaEpiStages stages the producer handed over empty (da_staged, no
// transfers): the same bf16 values as fused_da_epilogue, rows before the group's end, written by
// TMA from shared memory so the stores overlap the next tile's k-loop. Thread (warp, lane)'s
// word of row r = warp * 16 + lane / 4 (+ 8), columns 8j + 2 (lane % 4).. of the stage's 128
// goes to half j / 8, 16-byte unit (j % 8) ^ (r % 8) of row r: the eight rows of a warp
// instruction hit eight different units, so its 32 words hit 32 banks.
// Group ends need not be multiples of the 16-row box (gate_up_dgrad takes any).
__device__ __forceinline__ void fused_da_epilogue_staged(const FusedBwdKernelArgs& f,
                                                         const float (&acc0)[64],
                                                         const float (&acc1)[64], int row0,
                                                         int end, int nb, int wg, int tid,
                                                         int& stage, uint32_t& phase) {
  const int warp = tid / 32, lane = tid % 32;
  // warp w's rows are the warpgroup's box w; the box that crosses the group's end would write
  // rows of the next expert, so that warp stores its rows before the end itself (warp-uniform)
  const int box_row = row0 + wg * 64 + warp * kEpiStoreRows;
  const bool own = box_row < end && box_row + kEpiStoreRows > end;
#pragma unroll
  for (int q = 0; q < kDaEpiStages; ++q) {
    const float(&acc)[64] = q == 0 ? acc0 : acc1;
    mbar_wait(&bsh.full[stage], phase);
    uint8_t* out = bwd_stages() + stage * kStageBytes + wg * kDaEpiWgBytes;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = warp * 16 + lane / 4 + 8 * hr;
      uint16_t* direct = f.d_a + static_cast<int64_t>(row0 + wg * 64 + r) * f.dh.hidden +
                         nb * 256 + 128 * q + 2 * (lane % 4);
      const bool mine = own && row0 + wg * 64 + r < end;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t v = pack_bf16x2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
        if (own) {
          if (mine) *reinterpret_cast<uint32_t*>(direct + 8 * j) = v;
        } else {
          const int at =
              (j / 8) * kDaEpiHalf + r * 128 + (((j % 8) ^ (r % 8)) << 4) + 4 * (lane % 4);
          *reinterpret_cast<uint32_t*>(out + at) = v;
        }
      }
    }
    fence_proxy_async_shared();  // these writes before the TMA's reads
    named_sync(1 + wg, 128);
    if (tid == 0) {
      const int col = nb * 256 + 128 * q;
#pragma unroll
      for (int b = 0; b < 64 / kEpiStoreRows; ++b) {
        const int row = row0 + wg * 64 + b * kEpiStoreRows;
        if (row + kEpiStoreRows > end) break;  // whole boxes only (the crossing one: above)
        const int at = b * kEpiStoreRows * 128;
        tma_store_2d(&f.map_da_st, out + at, col, row);
        tma_store_2d(&f.map_da_st, out + kDaEpiHalf + at, col + 64, row);
      }
      bulk_commit();
      bulk_wait_read<0>();  // the stage read: the producer may fill it again
    }
    mbar_arrive(&bsh.empty[stage]);
    if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
  }
}

// Peers: the router-weight gradients of rows [row0, min(row0 + 128, end)) into this rank's
// symmetric row_grads region: each row's partials (one per 128 intermediate columns) summed in
// column order from the first (mok.experts' sum of the partials, the same bits); thread i of
// the two consumer warpgroups takes row row0 + i.
__device__ __forceinline__ void fused_stage_row_grads(const FusedBwdKernelArgs& f, const Ctx& c,
                                                      int row0, int end, int i) {
  const SwigluBwdKernelArgs& k = f.dh;
  const int row = row0 + i;
  if (i >= kTileM || row >= end || k.part == nullptr) return;
  float acc = k.part[row];
  for (int col = 1; col < k.inter / 128; ++col) acc += k.part[static_cast<int64_t>(col) * k.rows + row];
  reinterpret_cast<float*>(c.sym(c.p.rank, f.xfer.off_row_grads))[row] = acc;
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

template <int kOut, bool kWguT>
__device__ __forceinline__ void fused_consumer(const FusedBwdKernelArgs& f, const Ctx& c,
                                               int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const FusedCounters cnt(f);
  const bool peers = f.xfer.row_rank != nullptr;
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
    if (kind == kTaskCopy || kind == kTaskSum || kind == kTaskStage) {
      const int cw = wg * 4 + warp;
      if (kind == kTaskStage) {
        fused_stage_tokens(f, c, row0, cw, lane);
        __threadfence();  // before the publish task's release (it fences at system scope)
      } else if (kind == kTaskCopy) {
        if (peers) peers_acquire(c, kSigBwdStaged);  // the peers' staged rows
        fused_copy_rows(f, c, row0, end, cw, lane);
        // NOTE: the rows are read by other blocks' TMA (async proxy): fence the generic stores
        // against it before the release
        fence_proxy_async_global();
        __threadfence();
      } else {
        // the slots, stored by other blocks (the producer waited for them), with peers by
        // every rank's blocks
        if (peers) {
          peers_acquire(c, kSigBwdSlotsFilled);
        } else {
          (void)ld_acquire_gpu(cnt.da_done);
        }
        fused_sum_tokens(f, row0, cw, lane);
      }
      named_sync(3, 256);
      if (kind == kTaskCopy && threadIdx.x == 128) red_add_release_gpu(cnt.copied + rt, 1u);
      if (kind == kTaskStage && threadIdx.x == 128) red_add_release_gpu(cnt.staged, 1u);
      mbar_arrive(&bsh.empty[stage]);
      if (++stage == kFusedDgradStages) stage = 0, phase ^= 1;
      continue;
    }
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
        red_add_release_gpu(cnt.dh_rt + rt, 1u);
        red_add_release_gpu(cnt.dh_e + e, 1u);
      }
    } else if (f.da_staged && f.xfer.row_src == nullptr) {
      fused_da_epilogue_staged(f, acc0, acc1, row0, end, nb, wg, tid, stage, phase);
    } else {
      fused_da_epilogue(f, c, acc0, acc1, row0, end, nb, wg, warp, lane);
      if (peers && nb == 0) {  // the row tile's router-weight gradients (its dh tiles are done)
        (void)ld_acquire_gpu(cnt.dh_rt + rt);
        fused_stage_row_grads(f, c, row0, end, wg * 128 + tid);
      }
      if (f.xfer.row_src != nullptr) {  // the sums read these slots (generic loads)
        // NOTE: with peers some stores went over NVLink: each thread fences its own at system
        // scope before the release (the fill task's signal follows it)
        if (peers) {
          __threadfence_system();
        } else {
          __threadfence();
        }
        named_sync(3, 256);
        if (threadIdx.x == 128) red_add_release_gpu(cnt.da_done, 1u);
      }
    }
  }
  if (tid == 0) bulk_wait_all();  // the staged d_a stores complete before this block exits
  wgrad_consumer<kOut, false, kWguT ? kWgradTProb0 : kWgradTNone>(wg);
}

// kWguT: dW_gate_up computed as x^T dgu (wgrad[0]: A the input rows, B dgu) and stored
// transposed, in the weight's [L, 2I, H] layout; dW_down as it is.
template <int kOut, bool kWguT = false>
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
      wgrad_storer<kOut, kWguT ? kWgradTProb0 : kWgradTNone>(f.wgrad, warp - 1);
    }
  } else {
    setmaxnreg_inc<224>();
    fused_consumer<kOut, kWguT>(f, c, wg - 1);
  }
#endif
}

}  // namespace mok
