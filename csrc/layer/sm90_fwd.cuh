// The fused MoE layer forward: one persistent cooperative launch per call.
//
// Roles (by block index):
//   blocks [0, C)      communication: stage x into the symmetric x buffer, then pull dispatch
//                      minibatch by minibatch into the receive ring (one warp per row), raising
//                      ready[mb] per block;
//   blocks [C, grid)   compute workers: GEMM tiles of 128 rows x 256 columns in one fixed global
//                      order, each worker claiming the next tile from one counter (next_tile);
//                      warpgroup 0 holds the TMA producer (one thread) and two store warps,
//                      warpgroups 1 and 2 each run wgmma on 64 of the 128 rows and stage
//                      their bf16 output in shared memory for their store warp, which writes
//                      it out and publishes the tile while the warpgroup starts the next one.
// Tile order: shared gate/up, shared down, then GU(0), [GU(m), DN(m-1)] for m = 1.., DN(last)
// (GU(0), DN(0), GU(1), DN(1), ... when the ring has one minibatch slot). A gate/up tile holds
// 128 gate and 128 up columns of one expert; its epilogue writes h = bf16(silu(g) * u) and, in
// the saving mode (LayerArgs::gu32 / shared_gu32 set), the fp32 g and u themselves, each thread
// straight from its accumulators to the tile's receive rows (not ring rows). A down
// tile's epilogue pushes each real row into the home rank's combine slot token * k + j
// (padding rows are dropped there). With expert regions padded to 64 rows (row_tile 64), a
// routed 128-row block whose halves belong to two experts (or whose upper half lies past the
// received rows) runs as 64-row sub-tiles, one per half, each against its own expert's weights:
// both warpgroups work on the sub-tile's 64 rows, each on half of the columns (routed_halves).
// Roles talk only through local counters (release/acquire, GPU scope), all zeroed by the
// launcher:
//   ready[mb]   +1 per communication block when its rows of minibatch mb are in the ring;
//   gu_mb[mb]   +1 per warpgroup per gate/up tile of mb (its ring rows may be overwritten);
//   dn_mb[mb]   +1 per warpgroup per down tile of mb (its h rows may be overwritten);
//   gu_rb[rb]   +1 per warpgroup per gate/up tile of receive row block rb;
//   sh_rb[rb]   same for the shared expert's row blocks;
//   staged      +1 per communication block after its share of the x staging;
//   pulled      +1 per communication block after its share of the dedup rows (dedup pull).
// Dedup pull (kFlagDedup): the communication blocks first pull one row per (token, this rank)
// from the other ranks into the dedup buffer, then fill each minibatch's ring rows locally
// (from the dedup buffer, or from the x buffer for this rank's own tokens). All NVLink traffic
// then precedes the first routed tile; the shared expert's tiles overlap it.
// Every wait is bounded (common/waits.cuh). Dependencies point backwards in the tile order or at
// the
// communication blocks, whose own waits point backwards too, and tiles are claimed in order, so
// every tile a claimed tile waits for is claimed already: the order cannot deadlock.
// After its work every block counts itself done; the last one stores the call's epoch into every
// rank's slots-filled signal; then all blocks wait for every rank's and run the fixed-order
// weighted sum of the combine (comm/combine.cuh reduce_tokens).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "comm/combine.cuh"
#include "common/rings.cuh"
#include "common/rows.cuh"
#include "common/waits.cuh"
#include "layer/comm_blocks.cuh"
#include "layer/counters.cuh"
#include "layer/sm90_gemm.cuh"
#include "layer/tile_order.cuh"
#include "layer/trace.cuh"
#include "params.h"
#include "ptx/wgmma_sm90.cuh"

namespace mok {

// The operand type the layer runs (bf16 tokens and weights) and its k-block depth.
using Operand = OperandBf16;
constexpr int kTileK = Operand::kTileK;
// Local experts per rank the fused layer supports (their region starts live in shared memory).
constexpr int kMaxLocalExperts = 384;
// Dynamic shared memory: 1 KiB alignment slack, the stages, the two epilogue chunks.
constexpr int kLayerSmem = 1024 + kStages * kStageBytes + 2 * kEpiBuffers * kEpiBytes;

enum LayerMap : int {
  kMapX = 0,        // x [N, H]
  kMapRecv,         // receive ring [ring rows, H]
  kMapH,            // h ring [ring rows, I]
  kMapSharedH,      // shared h [N, Is]
  kMapGate,         // w_gate: L experts of I rows, gate_up_stride rows apart, H columns
  kMapUp,           // w_up: likewise
  kMapDown,         // w_down [L * H, I] (256-row boxes)
  kMapSharedGate,   // [Is, H]
  kMapSharedUp,     // [Is, H]
  kMapSharedDown,   // [H, Is] (256-row boxes)
  kNumMaps,
};

struct LayerKernelArgs {
  CUtensorMap maps[kNumMaps];
  Params p;
  LayerArgs a;
};

// A worker's shared state at fixed shared-memory addresses: the consumers name it directly, as
// pointers to it would each hold two registers beside their 128 accumulators (ptxas serialises
// their wgmma when it runs short).
struct WorkerShared {
  uint64_t full[kStages], empty[kStages];  // pipeline stages: data in, consumed
  uint64_t epi_full[2][kEpiBuffers], epi_empty[2][kEpiBuffers];  // epilogue buffers
  int stage_tile[kStages];         // tile index of the stage holding a tile's first k-block
  int stage_halves[kStages];       // and the tile's sub-tiles (tile_halves)
  int jobs[2][kEpiBuffers * 9];    // an EpiJob per epilogue buffer
  int next_tile[2];                // the consumer warpgroups' current tiles (store-warp hints)
  int stop[2];
  int abort_flag;
  // This rank's expert region starts (S), read once: the tile lookups search them on every
  // tile, and a search through global memory costs the producer and the consumers several
  // dependent L2 round trips per tile.
  int offsets[kMaxLocalExperts + 1];
};
static __shared__ __align__(8) WorkerShared wsh;
extern __shared__ uint8_t layer_smem[];

// Local expert owning receive row `row` (binary search on S, which layer_worker copies into
// shared memory).
__device__ __forceinline__ int expert_of_row(const Params& p, int row) {
  int lo = 0, hi = p.num_local_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (wsh.offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Sub-tiles of the routed 128-row block starting at receive row `row0` (of `num_rows`, regions
// padded to 64 or 128): 0 = one 128-row tile of one expert; else bit h says rows 64h..64h+63
// form a 64-row sub-tile of their own expert (a region boundary at row0 + 64, or the upper half
// past the last row). Regions padded to 128 rows always give 0.
__device__ __forceinline__ int routed_halves(const Params& p, int num_rows, int row0) {
  if (row0 + 64 >= num_rows) return 1;
  return expert_of_row(p, row0) == expert_of_row(p, row0 + 64) ? 0 : 3;
}

__device__ __forceinline__ int tile_halves(const Params& p, const TileOrder& o, const Tile& t) {
  return t.kind == kTileGU || t.kind == kTileDN ? routed_halves(p, o.num_rows, t.rb * kTileM) : 0;
}

// The pipeline stages (1 KiB aligned for the 128-byte swizzle), then the epilogue buffers.
__device__ __forceinline__ uint8_t* stage_memory() {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(layer_smem) + 1023) &
                                    ~static_cast<uintptr_t>(1023));
}
__device__ __forceinline__ uint8_t* epi_memory(int wg) {
  return stage_memory() + kStages * kStageBytes + wg * kEpiBuffers * kEpiBytes;
}

// ---- compute workers -----------------------------------------------------------------------

struct TileGeom {
  const CUtensorMap* map_a;
  const CUtensorMap* map_b0;
  const CUtensorMap* map_b1;  // null: one 256-row box from map_b0
  int a_row;                  // first row of the A box
  int b_row;                  // first row of the B box(es)
  int k_blocks;
};

// K blocks of a tile of this kind (its reduction length / kTileK).
__device__ __forceinline__ int tile_k_blocks(const LayerKernelArgs& k, int kind) {
  switch (kind) {
    case kTileSharedDN:
      return k.a.shared_inter / kTileK;
    case kTileDN:
      return k.a.inter / kTileK;
    default:
      return k.p.hidden / kTileK;
  }
}

// `sub_row`: 64 for the upper 64-row sub-tile of a split block (its expert's weights), else 0.
__device__ __forceinline__ TileGeom tile_geom(const LayerKernelArgs& k, const Tile& t,
                                              int sub_row = 0) {
  const Params& p = k.p;
  const LayerArgs& a = k.a;
  TileGeom g;
  switch (t.kind) {
    case kTileSharedGU:
      g = TileGeom{&k.maps[kMapX], &k.maps[kMapSharedGate], &k.maps[kMapSharedUp],
                   t.rb * kTileM, t.nb * 128, tile_k_blocks(k, t.kind)};
      break;
    case kTileSharedDN:
      g = TileGeom{&k.maps[kMapSharedH], &k.maps[kMapSharedDown], nullptr, t.rb * kTileM,
                   t.nb * kTileN, tile_k_blocks(k, t.kind)};
      break;
    case kTileGU: {
      const int row = t.rb * kTileM;
      const int e = expert_of_row(p, row + sub_row);
      g = TileGeom{&k.maps[kMapRecv], &k.maps[kMapGate], &k.maps[kMapUp], row % a.ring_rows,
                   e * static_cast<int>(a.gate_up_stride) + t.nb * 128,
                   tile_k_blocks(k, t.kind)};
      break;
    }
    default: {
      const int row = t.rb * kTileM;
      const int e = expert_of_row(p, row + sub_row);
      g = TileGeom{&k.maps[kMapH], &k.maps[kMapDown], nullptr, row % a.ring_rows,
                   e * p.hidden + t.nb * kTileN, tile_k_blocks(k, t.kind)};
      break;
    }
  }
  return g;
}

// The producer's wait before loading tile t's A operand.
__device__ __forceinline__ bool tile_ready(const Ctx& c, const LayerArgs& a, const TileOrder& o,
                                           int slots, const Tile& t) {
  const Counters cnt(c.p);
  const uint32_t* n = a.counters;
  switch (t.kind) {
    case kTileSharedGU:
      return true;
    case kTileSharedDN:
      return wait_count(c, n + cnt.sh_rb + t.rb, 2u * o.n_shared_gu, kWaitLayerGateUp, t.rb);
    case kTileGU:
      if (!wait_count(c, n + cnt.ready + t.mb, a.num_comm_blocks, kWaitLayerReady, t.mb))
        return false;
      if (t.mb >= slots)
        return wait_count(c, n + cnt.dn_mb + t.mb - slots,
                          2u * o.mb_row_blocks(t.mb - slots) * o.n_dn, kWaitLayerHFree, t.mb);
      return true;
    default:
      return wait_count(c, n + cnt.gu_rb + t.rb, 2u * o.n_gu, kWaitLayerGateUp, t.rb);
  }
}

// Destination of row `r` (0..127) of tile t's output, from column `col` of the tile's output
// columns on: null drops the row.
__device__ __forceinline__ uint8_t* tile_dst(const Ctx& c, const LayerKernelArgs& k,
                                             const Tile& t, int r, int col) {
  const Params& p = c.p;
  const LayerArgs& a = k.a;
  const int row = t.rb * kTileM + r;
  switch (t.kind) {
    case kTileSharedGU:
      if (row >= p.num_tokens) return nullptr;
      return static_cast<uint8_t*>(a.shared_h) +
             (static_cast<int64_t>(row) * a.shared_inter + t.nb * 128 + col) * 2;
    case kTileSharedDN:
      if (row >= p.num_tokens) return nullptr;
      return static_cast<uint8_t*>(const_cast<void*>(p.in2)) +
             (static_cast<int64_t>(row) * p.hidden + t.nb * kTileN + col) * 2;
    case kTileGU:
      return static_cast<uint8_t*>(a.h) +
             (static_cast<int64_t>(row % a.ring_rows) * a.inter + t.nb * 128 + col) * 2;
    default: {
      const int src = p.sched[p.o_src_rank + row];
      if (src < 0) return nullptr;
      const int64_t slot = p.sched[p.o_src_index + row];
      return c.sym(src, p.off_slots) + (slot * p.hidden + t.nb * kTileN + col) * 2;
    }
  }
}

__device__ __forceinline__ void layer_producer(const Ctx& c, const LayerKernelArgs& k,
                                               const TileOrder& o, int slots, uint8_t* stages,
                                               uint64_t* full, uint64_t* empty,
                                               volatile int* stage_tile,
                                               volatile int* abort_flag) {
  Tracer tr(k.a, 0);
  uint32_t* next_tile = k.a.counters + Counters(k.p).next_tile;
  TileCursor cur(o);
  Tile t;
  int stage = 0;
  uint32_t phase = 0;
  // NOTE: how the producer stops. The consumers' stage waits are plain spins (no branch may
  // leave their MMA loop while a wgmma group is in flight), so they must never be left inside a
  // tile: once the producer has published a tile's first stage it completes every stage of that
  // tile, without data after an abort (drain waits, which only the timeout ends), and the
  // consumers stop at the tile's end on the abort flag. Between tiles it publishes the end
  // marker instead.
  for (;;) {
    // Tiles are claimed in order, one at a time, by whichever worker is free: every tile's
    // dependencies come earlier in the order and are claimed already, so claims cannot
    // deadlock, and which SM computes a tile does not change its bits. (Claiming one tile ahead
    // hides the claim's round trip but takes the tile from an idle worker: measured slower.)
    const int i = *abort_flag ? -1 : static_cast<int>(atom_add_relaxed_gpu(next_tile, 1u));
    if (i < 0 || !cur.find(i, t)) {
      // End of work (or an abort between tiles): one stage carries the end marker.
      if (pipe_wait(c, &empty[stage], phase ^ 1, abort_flag, -1, true)) {
        stage_tile[stage] = -1;
        mbar_arrive(&full[stage]);
      }
      return;
    }
    const int halves = tile_halves(k.p, o, t);
    tr.add(kEvDepWait, t.kind, i);
    bool ready = tile_ready(c, k.a, o, slots, t);
    tr.add(kEvDepDone, t.kind, i);
    // Tests only (kFlagFault, in3 = 2 * tile + mode): at that tile, mode 0 fails its dependency
    // wait (as a timeout would), mode 1 its wait for the tile's second stage (as an abort seen
    // there would).
    const int64_t fault = (k.p.flags & kFlagFault) ? reinterpret_cast<intptr_t>(k.p.in3) : -1;
    int fault_stage = fault == 2 * i + 1 ? 1 : -1;
    if (fault == 2 * i) {
      record_error(c, kErrFault, 0, k.p.rank, i, 0, i);
      ready = false;
    }
    if (!ready) *abort_flag = 1;
    fence_proxy_async_global();
    // A split block's sub-tiles follow each other, each with the whole 128-row A box (the
    // consumers take its half) and its own expert's B.
    bool first = true;
    for (int h = 0; h < 2; ++h) {
      if (halves == 0 ? h > 0 : ((halves >> h) & 1) == 0) continue;
      const TileGeom g = tile_geom(k, t, halves == 0 ? 0 : 64 * h);
      for (int kb = 0; kb < g.k_blocks; ++kb) {
        const bool fail = fault_stage-- == 0;  // tests only; no memory read on this path
        if (fail) record_error(c, kErrFault, 1, k.p.rank, i, 0, i);
        if (fail || !pipe_wait(c, &empty[stage], phase ^ 1, abort_flag, i, !ready)) {
          if (!ready) return;  // a drain wait timed out (recorded): nothing left to do
          ready = false;
          *abort_flag = 1;
          if (first) {
            // Nothing of this tile is published yet: the end marker instead.
            if (pipe_wait(c, &empty[stage], phase ^ 1, abort_flag, i, true)) {
              stage_tile[stage] = -1;
              mbar_arrive(&full[stage]);
            }
            return;
          }
          if (!pipe_wait(c, &empty[stage], phase ^ 1, abort_flag, i, true)) return;
        }
        if (first) {  // published by the arrive below
          stage_tile[stage] = i;
          vol(wsh.stage_halves[stage]) = halves;
        }
        first = false;
        if (!ready) {
          mbar_arrive(&full[stage]);  // a stage without data: the tile runs out, then stops
          if (++stage == kStages) stage = 0, phase ^= 1;
          continue;
        }
        uint8_t* sa = stages + stage * kStageBytes;
        mbar_arrive_expect_tx(&full[stage], kStageBytes);
        tma_load_2d(sa, g.map_a, &full[stage], kb * kTileK, g.a_row);
        tma_load_2d(sa + kStageA, g.map_b0, &full[stage], kb * kTileK, g.b_row);
        if (g.map_b1 != nullptr)
          tma_load_2d(sa + kStageA + kStageA, g.map_b1, &full[stage], kb * kTileK, g.b_row);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    if (!ready) return;
  }
}

// An output chunk handed from a consumer warpgroup to its store warp: 64 staged rows of
// `chunks` 16-byte chunks, for tile rows row0.. from output column `col` on. `last`: the tile's
// last chunk of this warpgroup (the store warp then publishes the tile). index -1: no more.
struct EpiJob {
  int index, kind, mb, rb, nb, row0, col, chunks, last;
};

// One store warp per consumer warpgroup (warps 1 and 2 of the producer warpgroup): takes the
// warpgroup's staged chunks in order, stores them, frees the buffer, and after a tile's last
// chunk publishes the tile's counters. The consumers go on with their next tile meanwhile.
// NOTE: __noinline__ keeps its registers apart from the kernel's: inlined, it adds spills there,
// and at the consumers' margin ptxas (nvcc 13.0) then serialises their wgmma.
static __device__ __noinline__ void layer_storer(const Ctx& c, const LayerKernelArgs& k,
                                                 const TileOrder& o, int wg, const uint8_t* epis,
                                                 uint64_t* epi_full, uint64_t* epi_empty,
                                                 const volatile int* jobs,
                                                 const volatile int* next_tile,
                                                 volatile int* abort_flag) {
  const int lane = threadIdx.x % 32;
  const Counters cnt(k.p);
  int n = 0;  // jobs taken: buffer n % kEpiBuffers, phase (n / kEpiBuffers) & 1
  // The destinations of chunk rows (tile rows_at..): a down tile's second chunk reuses its
  // first's, and the rows of the warpgroup's next full tile are looked up during its k-loop
  // (next_tile: the tile the warpgroup is working on, -1 once it is done), so that the
  // schedule reads of the lookup do not delay freeing the buffer.
  int rows_of = -1, rows_at = -1, last = -1;
  uint8_t *lo = nullptr, *hi = nullptr;
  TileCursor cur(o);
  for (;;) {
    for (int h = *next_tile; h != -1; h = *next_tile) {
      if (h != last) {
        Tile t;
        if (h != rows_of && cur.find(h, t) && tile_halves(k.p, o, t) == 0) {
          lo = tile_dst(c, k, t, wg * 64 + lane, 0);
          hi = tile_dst(c, k, t, wg * 64 + 32 + lane, 0);
          rows_of = h, rows_at = wg * 64;
        }
        break;
      }
      __nanosleep(64);
    }
    // NOTE: the consumers always post a last job (index -1), also when they stop on an abort,
    // so this wait ends; the timeout is a guard against a bug, not a path.
    const int b = n % kEpiBuffers;
    const uint32_t phase = (n / kEpiBuffers) & 1;
    ++n;
    if (!pipe_wait(c, &epi_full[b], phase, abort_flag, -2, true)) return;
    const volatile int* job_words = jobs + 9 * b;
    const uint8_t* epi = epis + b * kEpiBytes;
    EpiJob j;
    j.index = job_words[0], j.kind = job_words[1], j.mb = job_words[2], j.rb = job_words[3];
    j.nb = job_words[4], j.row0 = job_words[5], j.col = job_words[6], j.chunks = job_words[7];
    j.last = job_words[8];
    if (j.index < 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&epi_empty[b]);
      return;
    }
    const Tile t{j.kind, j.mb, j.rb, j.nb};
    if (j.index != rows_of || j.row0 != rows_at) {
      lo = tile_dst(c, k, t, j.row0 + lane, 0);
      hi = tile_dst(c, k, t, j.row0 + 32 + lane, 0);
      rows_of = j.index, rows_at = j.row0;
    }
    if (j.chunks == 16) {
      copy_chunk<16>(lo, hi, j.col, epi, lane);
    } else {
      copy_chunk<8>(lo, hi, j.col, epi, lane);
    }
    // The buffer is read (the loads above completed into registers): the warpgroup may stage
    // its next chunk while the stores drain.
    __syncwarp();
    if (lane == 0) mbar_arrive(&epi_empty[b]);
    if (!j.last) continue;
    last = j.index;
    // Publish. Gate/up rows (h) are read by other workers' TMA (async proxy): each writer
    // fences its stores into the async proxy, and one release after the warp's barrier covers
    // the warp's stores (cumulativity). Down rows need no fence here: the counter only says
    // this tile's h rows were read (their TMA loads completed), and the pushed rows are fenced
    // at system scope by every thread before the final barrier.
    const bool gate_up = t.kind == kTileGU || t.kind == kTileSharedGU;
    if (gate_up) fence_proxy_async_global();
    __syncwarp();
    if (lane == 0) {
      uint32_t* n = k.a.counters;
      switch (t.kind) {
        case kTileSharedGU:
          red_add_release_gpu(n + cnt.sh_rb + t.rb, 1u);
          break;
        // NOTE: the per-minibatch counts let the communication blocks overwrite this tile's
        // ring rows (gu_mb) and later gate/up tiles its h rows (dn_mb). Relaxed is enough:
        // those rows were read by TMA loads that completed (the full barrier's transaction
        // count) and were consumed by the MMAs before the chunk was staged, so no later write
        // can reach them; a release here would also wait for the stores (NVLink ones
        // included) of every tile.
        case kTileGU:
          red_add_release_gpu(n + cnt.gu_rb + t.rb, 1u);
          red_add_relaxed_gpu(n + cnt.gu_mb + t.mb, 1u);
          break;
        case kTileDN:
          red_add_relaxed_gpu(n + cnt.dn_mb + t.mb, 1u);
          break;
        default:
          break;
      }
    }
  }
}

// Hands the warpgroup's staged chunk to its store warp (after the warpgroup's barrier, so all
// of its shared-memory writes come before the arrive).
__device__ __forceinline__ void post_chunk(uint64_t* epi_full, volatile int* job_words, int wg,
                                           int tid, int index, const Tile& t, int row0, int col,
                                           int chunks, int last) {
  named_sync(1 + wg, 128);
  if (tid == 0) {
    job_words[0] = index, job_words[1] = t.kind, job_words[2] = t.mb, job_words[3] = t.rb;
    job_words[4] = t.nb, job_words[5] = row0, job_words[6] = col, job_words[7] = chunks;
    job_words[8] = last;
    mbar_arrive(epi_full);
  }
}

// Saving mode: a warpgroup's fp32 gate / up accumulators (an m64n128 or m64n64 layout, kJ
// 8-column groups: g in d, the matching up columns in u) into gu [rows, 2 * half]: row row0 +
// warp * 16 + lane / 4 (+ 8), g from column col0 on, u from half + col0 on; rows at or past
// `rows` are dropped. Each lane writes 8-byte pairs, four lanes one 32-byte sector of a row.
template <int kJ>
__device__ __forceinline__ void save_gate_up(const float* d, const float* u, float* gu,
                                             int64_t half, int row0, int rows, int64_t col0,
                                             int warp, int lane) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row0 + warp * 16 + lane / 4 + 8 * hr;
    if (row >= rows) continue;
    float* g = gu + static_cast<int64_t>(row) * 2 * half + col0 + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      *reinterpret_cast<float2*>(g + 8 * j) = make_float2(d[4 * j + 2 * hr], d[4 * j + 2 * hr + 1]);
      *reinterpret_cast<float2*>(g + half + 8 * j) =
          make_float2(u[4 * j + 2 * hr], u[4 * j + 2 * hr + 1]);
    }
  }
}

// Consumer warpgroup `wg` (0 or 1): rows wg * 64.. of every full tile of this worker. Its
// epilogue stages bf16 rows in its shared-memory buffer and hands them to its store warp
// (layer_storer); it waits only for that warp to have read the previous chunk.
__device__ __forceinline__ void layer_consumer(const Ctx& c, const LayerKernelArgs& k,
                                               const TileOrder& o, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  TileCursor cur(o);
  Tile t;
  int stage = 0, prev_stage = 0;
  uint32_t phase = 0;
  int chunks = 0;  // chunks staged: buffer chunks % kEpiBuffers
  float acc0[64], acc1[64];
  Tracer tr(k.a, 1);
  const bool writer = wg == 0 && tid == 0;
  // The next buffer (its index), once the store warp has read its previous chunk.
  auto buffer_free = [&]() {
    const int b = chunks % kEpiBuffers;
    mbar_wait(&wsh.epi_empty[wg][b], ((chunks / kEpiBuffers) & 1) ^ 1);
    ++chunks;
    return b;
  };
  for (;;) {
    const uint64_t t_start = writer ? tr.now() : 0;
    // The first stage of the next tile says which tile it is (or that the work is done).
    // NOTE: waiting twice for a completed phase is harmless (it cannot move on before this
    // stage is released).
    mbar_wait(&wsh.full[stage], phase);
    const int i = vol(wsh.stage_tile[stage]);
    if (i < 0 || !cur.find(i, t)) break;
    if (tid == 0) vol(wsh.next_tile[wg]) = i;  // a hint for the store warp (layer_storer)
    // The producer's answers for the tile: the consumers look nothing up in the schedule.
    const int halves = vol(wsh.stage_halves[stage]);
    const int k_blocks = tile_k_blocks(k, t.kind);
    if (writer) {
      tr.add_at(t_start, kEvTileStart, t.kind, i);
      tr.add(kEvFirstStage, t.kind, i);
    }
    int b;
    if (halves == 0) {
      mma_kloop<Operand, kFull>(acc0, acc1, stage_memory(), wsh.full, wsh.empty, k_blocks, 0, wg, stage, prev_stage,
                       phase);
      if (writer) tr.add(kEvMainDone, t.kind, i);
      // Epilogue: registers -> bf16 chunk in shared memory -> the store warp.
      b = buffer_free();
      if (t.kind == kTileGU || t.kind == kTileSharedGU) {
        stage_chunk<true>(acc0, acc1, epi_memory(wg) + b * kEpiBytes, warp, lane);
        // NOTE: one call for both kinds, after the staging: a call per kind, or the save before
        // stage_chunk, makes ptxas (nvcc 13.0) serialise the consumers' wgmma (C7511).
        const bool routed = t.kind == kTileGU;
        float* gu = routed ? k.a.gu32 : k.a.shared_gu32;
        if (gu != nullptr) {
          save_gate_up<16>(acc0, acc1, gu, routed ? k.a.inter : k.a.shared_inter,
                           t.rb * kTileM + wg * 64, routed ? o.num_rows : k.p.num_tokens,
                           t.nb * 128, warp, lane);
        }
        if (writer) tr.add(kEvEpiStaged, t.kind, i);
        post_chunk(&wsh.epi_full[wg][b], wsh.jobs[wg] + 9 * b, wg, tid, i, t, wg * 64, 0, 16, 1);
      } else {
        stage_chunk<false>(acc0, acc0, epi_memory(wg) + b * kEpiBytes, warp, lane);
        if (writer) tr.add(kEvEpiStaged, t.kind, i);
        post_chunk(&wsh.epi_full[wg][b], wsh.jobs[wg] + 9 * b, wg, tid, i, t, wg * 64, 0, 16, 0);
        b = buffer_free();
        stage_chunk<false>(acc1, acc1, epi_memory(wg) + b * kEpiBytes, warp, lane);
        post_chunk(&wsh.epi_full[wg][b], wsh.jobs[wg] + 9 * b, wg, tid, i, t, wg * 64, 128, 16, 1);
      }
    } else {
      // A split block: its 64-row sub-tiles one after the other, each with its own epilogue.
      for (int h = 0; h < 2; ++h) {
        if (((halves >> h) & 1) == 0) continue;
        const bool last = h == 1 || halves == 1;
        if (t.kind == kTileGU) {
          mma_kloop<Operand, kHalfGateUp>(acc0, acc1, stage_memory(), wsh.full, wsh.empty, k_blocks, h, wg, stage,
                                 prev_stage, phase);
          if (writer && last) tr.add(kEvMainDone, t.kind, i);
          b = buffer_free();
          stage_chunk<true, 8>(acc0, acc0 + 32, epi_memory(wg) + b * kEpiBytes, warp, lane);
          if (k.a.gu32 != nullptr) {
            save_gate_up<8>(acc0, acc0 + 32, k.a.gu32, k.a.inter, t.rb * kTileM + 64 * h,
                            o.num_rows, t.nb * 128 + wg * 64, warp, lane);
          }
          if (writer && last) tr.add(kEvEpiStaged, t.kind, i);
          post_chunk(&wsh.epi_full[wg][b], wsh.jobs[wg] + 9 * b, wg, tid, i, t, 64 * h, wg * 64, 8, last);
        } else {
          mma_kloop<Operand, kHalfDown>(acc0, acc1, stage_memory(), wsh.full, wsh.empty, k_blocks, h, wg, stage,
                               prev_stage, phase);
          if (writer && last) tr.add(kEvMainDone, t.kind, i);
          b = buffer_free();
          stage_chunk<false>(acc0, acc0, epi_memory(wg) + b * kEpiBytes, warp, lane);
          if (writer && last) tr.add(kEvEpiStaged, t.kind, i);
          post_chunk(&wsh.epi_full[wg][b], wsh.jobs[wg] + 9 * b, wg, tid, i, t, 64 * h, wg * 128, 16, last);
        }
      }
    }
    if (writer) tr.add(kEvEpiStored, t.kind, i);
    if (tid == 0) {
      wsh.stop[wg] = vol(wsh.abort_flag);
      if (writer) tr.add(kEvEpiDone, t.kind, i);
    }
    // Warpgroup-uniform abort check at the tile's end (no MMA in flight here).
    named_sync(1 + wg, 128);
    if (vol(wsh.stop[wg])) break;
  }
  // The store warp's last job: it stops once it has stored everything before it.
  if (tid == 0) vol(wsh.next_tile[wg]) = -1;
  const int b = buffer_free();
  post_chunk(&wsh.epi_full[wg][b], wsh.jobs[wg] + 9 * b, wg, tid, -1, t, 0, 0, 0, 0);
}

__device__ __forceinline__ bool layer_worker(const Ctx& c, const LayerKernelArgs& k,
                                             const TileOrder& o, int slots) {
  const Params& p = k.p;
  const int32_t* offsets = p.sched + p.o_offsets + p.rank * (p.num_local_experts + 1);
  for (int e = threadIdx.x; e <= p.num_local_experts; e += blockDim.x) wsh.offsets[e] = offsets[e];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&wsh.full[s], 1);
      mbar_init(&wsh.empty[s], 2 * 128);  // every thread of both consumer warpgroups
    }
    for (int w = 0; w < 2; ++w) {
      for (int b = 0; b < kEpiBuffers; ++b) {
        mbar_init(&wsh.epi_full[w][b], 1);   // the consumer warpgroup's thread 0
        mbar_init(&wsh.epi_empty[w][b], 1);  // the store warp's lane 0
      }
    }
    wsh.abort_flag = 0;
    wsh.next_tile[0] = wsh.next_tile[1] = -2;  // none yet
    mbar_init_fence();
  }
  __syncthreads();
  // Registers: the producer warpgroup needs few, the consumers hold 128 fp32 accumulators each;
  // everyone returns to the launch budget of 168 for the combine afterwards.
  // NOTE: the increments must fit in what the decrement frees from the block's launch
  // allocation (384 x 168): 128 x 56 + 256 x 224 <= 384 x 168, else setmaxnreg.inc never returns.
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
      layer_producer(c, k, o, slots, stage_memory(), wsh.full, wsh.empty, wsh.stage_tile,
                     &wsh.abort_flag);
    } else if (warp == 1 || warp == 2) {
      layer_storer(c, k, o, warp - 1, epi_memory(warp - 1), wsh.epi_full[warp - 1],
                   wsh.epi_empty[warp - 1], wsh.jobs[warp - 1], &wsh.next_tile[warp - 1],
                   &wsh.abort_flag);
    }
    __syncwarp();
    setmaxnreg_inc<168>();
  } else {
    setmaxnreg_inc<224>();
    layer_consumer(c, k, o, wg - 1);
    setmaxnreg_dec<168>();
  }
  // NOTE: one read of the abort word for the block, so every thread returns the same answer.
  if (threadIdx.x == 0 && c.aborted()) wsh.abort_flag = 1;
  __syncthreads();
  return vol(wsh.abort_flag) == 0;
}

// ---- the kernel ----------------------------------------------------------------------------

__global__ void __launch_bounds__(kLayerThreads, 1)
    layer_kernel(const __grid_constant__ LayerKernelArgs k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const Params& p = k.p;
  const LayerArgs& a = k.a;
  const Ctx c(p);
  // NOTE: a per-thread read can only split the block if another block aborts right now, and
  // in this cooperative launch no block can abort before every block has started (aborts come
  // from waits that time out, and from earlier kernels). block_aborted() here, or at the end
  // below, makes ptxas (nvcc 13.0) serialise the consumers' wgmma: the roles return shared
  // answers instead.
  if (c.aborted()) return;
  TileOrder o;
  o.num_rows = p.sched[p.o_meta + kMetaNumRows];
  o.mb_rows = p.minibatch_rows;
  o.num_mbs = (o.num_rows + o.mb_rows - 1) / o.mb_rows;
  o.shared_rbs = a.shared_inter > 0 ? (p.num_tokens + kTileM - 1) / kTileM : 0;
  o.n_shared_gu = a.shared_inter / 128;
  o.n_gu = a.inter / 128;
  o.n_dn = p.hidden / kTileN;
  const int slots = a.ring_rows / p.minibatch_rows;
  o.interleave = slots >= 2;

  if (blockIdx.x == 0) block_signal_all(c, kSigLayerSlotsFree);
  bool ok = true;
  if (static_cast<int>(blockIdx.x) < a.num_comm_blocks) {
    ok = layer_comm(c, a, o, slots);
  } else {
    // Pushes into a peer's slots wait until its previous call's sum has read them.
    ok = block_wait_all(c, kSigLayerSlotsFree, static_cast<uint64_t>(p.epoch));
    if (ok) {
      if (threadIdx.x == 0) {
        for (int m = 0; m < kNumMaps; ++m) tma_prefetch_map(&k.maps[m]);
      }
      ok = layer_worker(c, k, o, slots);
    }
  }
  if (!ok) return;
  {
    // The last block done stores the call's epoch into every rank's slots-filled signal (one
    // remote store per rank and call, not one per block): each thread fences its pushes before
    // the count, the last block after it (common/waits.cuh last_block's rule). NOTE: written out
    // here: last_block / grid_signal_all, or a different wait target in layer_comm, make ptxas
    // (nvcc 13.0) serialise the consumers' wgmma (C7511).
    __threadfence_system();
    uint32_t* count = reinterpret_cast<uint32_t*>(c.meta() + kMetaLastCount);
    const int last = __syncthreads_or(threadIdx.x == 0 && atomicAdd(count, 1u) + 1 == gridDim.x);
    if (last) {
      if (threadIdx.x == 0) atomicExch(count, 0u);
      __threadfence_system();
      for (int r = threadIdx.x; r < p.num_ranks; r += blockDim.x)
        st_release_sys(c.peer_signal(r, kSigLayerSlotsFilled), static_cast<uint64_t>(p.epoch));
    }
  }
  if (!block_wait_all(c, kSigLayerSlotsFilled, static_cast<uint64_t>(p.epoch))) return;
  Tracer tr(a, 0);
  if (threadIdx.x == 0) tr.add(kEvSumStart, 0, 0);
  reduce_tokens(c, 0, *reinterpret_cast<WarpTerms*>(layer_smem));
  if (threadIdx.x == 0) tr.add(kEvSumDone, 0, 0);
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const Ctx c(k.p);
    record_error(c, kErrUnsupported, 0, k.p.rank, 0, 0, 0);
  }
#endif
}

}  // namespace mok
