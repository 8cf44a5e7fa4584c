// Combine: expert outputs back to the token's home rank, then the fixed-order weighted sum.
//
//   push:       the expert owner stores row p into slot src_index[p] = token * num_topk + k of
//               home rank src_rank[p]; the home rank waits for every rank, then reduces;
//   dedup push: the owner first sums its rows of a token in k order (fp32, rounded to bf16) and
//               pushes one row per (token, rank) into slot token * num_topk + j;
//   pull:       the home rank reads the k rows of each token straight from the owners'
//               symmetric expert-output buffers while it reduces (no slots).
//   dedup pull: two kernels. dedup_partials_kernel (the expert stage's epilogue in the fused
//               layer; one 4-byte NVLink store per dedup row, its index): the owner sums
//               its rows of each dedup row in k order (fp32, rounded to bf16) into its
//               symmetric partials buffer, one row per dedup row
//               (so the buffer is bounded by the receive capacity, not by R * N), and stores
//               that row's index into the home rank's partials index (slot token * K + j).
//               dedup_sum_kernel (the transfer, comparable with other libraries' combine): the
//               home rank bulk-loads its token's partial rows from every owner (ascending rank,
//               each row found through its own partials index)
//               and sums them onto shared_y. Both run the common/rings.cuh reduce pipeline, or one
//               warp per row with vector loads (kFlagVector); dedup_sum also has a gather
//               ring (kFlagGather): each warp keeps kGatherStages row chunks of every term
//               in flight with cp.async (16-byte async copies into its shared-memory ring),
//               then adds them in the same fixed order.
//
// The sum is acc = shared_y (or 0); acc = acc + w_k * y_k for k = 0..num_topk-1, each product
// and each sum rounded separately in fp32 (__fmul_rn / __fadd_rn: no FMA contraction), output
// rounded to bf16: bitwise what reference/moe.py::combine computes.
#pragma once

#include <cstdint>

#include "comm/dispatch.cuh"
#include "common/rank_mask.cuh"
#include "common/rings.cuh"
#include "common/rows.cuh"
#include "common/waits.cuh"
#include "params.h"
#include "ptx/cp_async.cuh"

namespace mok {

// Token t's shared-expert output row (in2: bf16, or fp32 with kFlagSharedFp32), the sum's
// starting value; null without a shared expert (kFlagHasShared).
__device__ __forceinline__ const void* shared_row(const Params& p, int64_t t, int64_t row_bytes) {
  if (!(p.flags & kFlagHasShared)) return nullptr;
  const int64_t width = (p.flags & kFlagSharedFp32) ? 2 : 1;  // fp32: twice a bf16 row's bytes
  return static_cast<const uint8_t*>(p.in2) + t * row_bytes * width;
}

// acc += w_k * src_k[c] for k = 0..n-1 in k order: vector c of each term's row (src_k / w_k
// from the warp's shared slots; src 0: the term is w_k * 0).
__device__ __forceinline__ void add_terms(OrderedSum8& acc, const uint64_t* s_src,
                                          const float* s_w, int n, int c) {
  // Loads in flight per lane before the ordered adds: all 8 of a top-8 token at once (the
  // final sum of the fused layer ran at ~53% of the HBM rate with 4; the adds keep k order).
  add_in_k_order<8>(
      acc, n,
      [&](int k, bool valid) {
        const uint64_t src = valid ? s_src[k] : 0;
        return src ? reinterpret_cast<const uint4*>(src)[c] : make_uint4(0, 0, 0, 0);
      },
      [&](int k) { return s_w[k]; });
}

// One warp: out[:] = bf16(init + sum_k w_k * src_k) over a row of `hidden` bf16 (n16 vectors).
// `init` is bf16 or fp32 (init_fp32) or null.
__device__ __forceinline__ void warp_weighted_sum(uint4* out, const void* init, bool init_fp32,
                                                  const uint64_t* s_src, const float* s_w, int n,
                                                  int n16, int lane) {
  for (int c = lane; c < n16; c += 32) {
    OrderedSum8 acc;
    acc.start(init, init_fp32, c);
    add_terms(acc, s_src, s_w, n, c);
    out[c] = acc.bf16();
  }
}

// One warp at one rank: the dedup push combine's two sums in one pass, the same bits.
// out[:] = bf16(init + 1 * bf16(sum_k w_k * src_k)): the token's partial (what the slot would
// hold: its rows' weighted sum in k order from zero, rounded to bf16) then added onto `init`
// as reduce_tokens adds the one partial of a one-rank token, without the slot's write and read.
__device__ __forceinline__ void warp_weighted_sum_one_rank(uint4* out, const void* init,
                                                           bool init_fp32, const uint64_t* s_src,
                                                           const float* s_w, int n, int n16,
                                                           int lane) {
  for (int c = lane; c < n16; c += 32) {
    OrderedSum8 part;
    part.start(nullptr, false, c);
    add_terms(part, s_src, s_w, n, c);
    OrderedSum8 acc;
    acc.start(init, init_fp32, c);
    acc.add(1.0f, part.bf16());
    out[c] = acc.bf16();
  }
}

struct WarpTerms {
  uint64_t src[kCommWarps][kMaxTopk];
  float w[kCommWarps][kMaxTopk];
};

// Home-rank reduce of every token: slots [num_tokens * num_topk, hidden] (local, or the
// owners' y rows for pull), topk_weights in1 [num_tokens, num_topk] fp32, shared_y in2,
// out0 [num_tokens, hidden] bf16. `mode`: 0 slots, 1 dedup slots, 2 pull from owners.
// `terms`: per-warp scratch (blocks of at most kCommWarps warps).
__device__ __forceinline__ void reduce_tokens(const Ctx& c, int mode, WarpTerms& terms) {
  const Params& p = c.p;
  const int K = p.num_topk, L = p.num_local_experts;
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * warps + warp;
  const int nwarps = gridDim.x * warps;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const float* topk_w = static_cast<const float*>(p.in1);
  const int32_t* topk_idx = static_cast<const int32_t*>(p.in3);
  const uint8_t* slots = c.sym(p.rank, p.off_slots);
  const int32_t* dst_rank = p.sched + p.o_dst_rank;
  const int32_t* dst_index = p.sched + p.o_dst_index;
  const bool shared_fp32 = (p.flags & kFlagSharedFp32) != 0;
  for (int t = gwarp; t < p.num_tokens; t += nwarps) {
    const int i = t * K + lane;
    uint64_t src = 0;
    float w = 0.0f;
    if (mode == 1) {
      // Slot j < number of distinct destination ranks holds an already weighted partial.
      const int d = lane < K ? topk_idx[i] / L : -1;
      const unsigned same = __match_any_sync(0xffffffffu, d);
      const bool first = lane < K && (same & ((1u << lane) - 1)) == 0;
      const int distinct = __popc(__ballot_sync(0xffffffffu, first));
      if (lane < distinct) {
        src = reinterpret_cast<uint64_t>(slots + i * row_bytes);
        w = 1.0f;
      }
    } else if (lane < K) {
      w = topk_w[i];
      src = mode == 0 ? reinterpret_cast<uint64_t>(slots + i * row_bytes)
                      : reinterpret_cast<uint64_t>(c.sym(dst_rank[i], p.off_y) +
                                                   dst_index[i] * row_bytes);
    }
    if (lane < K) {
      terms.src[warp][lane] = src;
      terms.w[warp][lane] = w;
    }
    __syncwarp();
    const void* init = shared_row(p, t, row_bytes);
    uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out0) + t * row_bytes);
    warp_weighted_sum(out, init, shared_fp32, terms.src[warp], terms.w[warp], K, n16, lane);
    __syncwarp();
  }
}

// Row, in the partials buffer of its j-th owner (ascending rank), of my token t's partial: the
// owner's dedup_partials stored it into my partials index before signalling partials ready.
// Rows of the dedup partials buffer: one per dedup row, so at most one per token of every rank
// and at most the receive rows (mok.sizing.dedup_rows); the partials index follows them.
__device__ __forceinline__ int64_t partials_rows(const Params& p) {
  return min(static_cast<int64_t>(p.num_ranks) * p.max_tokens, static_cast<int64_t>(p.capacity));
}
__device__ __forceinline__ int32_t* partials_index(const Ctx& c, int rank) {
  return reinterpret_cast<int32_t*>(c.sym(rank, c.p.off_partials) +
                                    partials_rows(c.p) * c.p.hidden * 2);
}
__device__ __forceinline__ int64_t partials_row(const Ctx& c, int t, int j) {
  return partials_index(c, c.p.rank)[static_cast<int64_t>(t) * c.p.num_topk + j];
}

// Partial row of dedup row `row`: sum over its fan-out rows (k order) of w * y.
struct PartialsMeta {
  const Ctx* c;
  const uint8_t* y;
  __device__ int operator()(int row, uint64_t* src, float* w, uint64_t& init,
                            uint64_t& out) const {
    const Params& p = c->p;
    const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
    const int K = p.num_topk;
    const int32_t* fan = p.sched + p.o_fan_rows + static_cast<int64_t>(row) * K;
    const float* fw = reinterpret_cast<const float*>(p.sched + p.o_fan_w) +
                      static_cast<int64_t>(row) * K;
    int n = 0;
    for (int j = 0; j < K; ++j) {
      const int fr = fan[j];
      if (fr < 0) break;
      src[j] = reinterpret_cast<uint64_t>(y + fr * rb);
      w[j] = fw[j];
      n = j + 1;
    }
    init = 0;
    out = reinterpret_cast<uint64_t>(c->sym(p.rank, p.off_partials) + row * rb);
    return n;
  }
};

// Output row of token `t`: shared_y + the owners' partials in ascending rank order.
struct DedupSumMeta {
  const Ctx* c;
  __device__ int operator()(int t, uint64_t* src, float* w, uint64_t& init,
                            uint64_t& out) const {
    const Params& p = c->p;
    const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
    const RankMask mask = token_owners(p, t);
    int n = 0;
    for (int d = 0; d < p.num_ranks; ++d) {
      if (!mask.has(d)) continue;
      src[n] = reinterpret_cast<uint64_t>(c->sym(d, p.off_partials) + partials_row(*c, t, n) * rb);
      w[n] = 1.0f;
      ++n;
    }
    init = reinterpret_cast<uint64_t>(shared_row(p, t, rb));
    out = reinterpret_cast<uint64_t>(static_cast<uint8_t*>(p.out0) + t * rb);
    return n;
  }
};

__host__ __device__ constexpr int partials_slots(int num_topk) {
  return reduce_slots(num_topk, false);
}

// Vector-load path of the two dedup pull steps: one warp per row, walked in segments of
// 32 * kSegVecs 16-byte vectors; each lane issues the loads of kSegGroup terms x kSegVecs
// vectors before the first add (8-16 KiB in flight per warp), then adds in term order.
constexpr int kSegVecs = 4;
constexpr int kSegGroup = 4;

__device__ __forceinline__ void warp_sum_segment(uint8_t* out, const uint8_t* init,
                                                 bool init_fp32, const uint64_t* src,
                                                 const float* w, int n, int seg, int n16,
                                                 int lane) {
  OrderedSum8 acc[kSegVecs];
  const int base = seg * 32 * kSegVecs + lane;
#pragma unroll
  for (int u = 0; u < kSegVecs; ++u) {
    const int c = base + 32 * u;
    if (c >= n16)
      acc[u].zero();
    else
      acc[u].start(init, init_fp32, c);
  }
  for (int k0 = 0; k0 < n; k0 += kSegGroup) {
    uint4 v[kSegGroup][kSegVecs];
#pragma unroll
    for (int g = 0; g < kSegGroup; ++g) {
      const uint4* sp = reinterpret_cast<const uint4*>(k0 + g < n ? src[k0 + g] : 0);
#pragma unroll
      for (int u = 0; u < kSegVecs; ++u) {
        const int c = base + 32 * u;
        v[g][u] = (k0 + g < n && c < n16) ? sp[c] : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int g = 0; g < kSegGroup; ++g) {
      if (k0 + g >= n) break;
      const float wk = w[k0 + g];
#pragma unroll
      for (int u = 0; u < kSegVecs; ++u) acc[u].add(wk, v[g][u]);
    }
  }
#pragma unroll
  for (int u = 0; u < kSegVecs; ++u) {
    const int c = base + 32 * u;
    if (c >= n16) continue;
    reinterpret_cast<uint4*>(out)[c] = acc[u].bf16();
  }
}

// Runs `meta` (PartialsMeta / DedupSumMeta) per row on one warp each (lane 0 reads the row's
// terms), then sums the row segment by segment.
template <typename Meta>
__device__ __forceinline__ void warp_reduce_rows(const Meta& meta, int total, int64_t row_bytes,
                                                 bool init_fp32) {
  __shared__ WarpTerms terms;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + warp;
  const int nwarps = gridDim.x * kCommWarps;
  const int n16 = static_cast<int>(row_bytes / 16);
  const int nseg = (n16 + 32 * kSegVecs - 1) / (32 * kSegVecs);
  for (int row = gwarp; row < total; row += nwarps) {
    int n = 0;
    uint64_t init = 0, out = 0;
    if (lane == 0) {
      n = meta(row, terms.src[warp], terms.w[warp], init, out);
    }
    n = __shfl_sync(0xffffffffu, n, 0);
    init = __shfl_sync(0xffffffffu, init, 0);
    out = __shfl_sync(0xffffffffu, out, 0);
    __syncwarp();
    for (int seg = 0; seg < nseg; ++seg)
      warp_sum_segment(reinterpret_cast<uint8_t*>(out), reinterpret_cast<const uint8_t*>(init),
                       init_fp32, terms.src[warp], terms.w[warp], n, seg, n16, lane);
    __syncwarp();
  }
}

// ---- gather ring of dedup_sum ----------------------------------------------------------------
// Item = (token, chunk of 32 * U vectors of its row). Per warp a ring of kGatherStages stages;
// a stage holds, per slot (term 0..max_owner_terms-1, then 1 or 2 slots of shared_y), U vectors per
// lane, laid out [slot][u][lane] x 16 B (a warp's accesses are 512 contiguous bytes). Every
// lane copies and later reads only its own vectors, so cp.async.wait_group alone orders them.
constexpr int kGatherStages = 4;
constexpr int kGatherMaxU = 8;

// Slots of a gather stage: one per owner term (max_owner_terms), then shared_y's.
__host__ __device__ constexpr int gather_slots(int terms, bool has_shared, bool fp32) {
  return terms + (has_shared ? (fp32 ? 2 : 1) : 0);
}
// Vectors per lane per item (0: the ring does not fit; the kernel uses the vector path).
__host__ __device__ constexpr int gather_units(int slots) {
  return kStageBudget / (kCommWarps * kGatherStages * slots * 512) > kGatherMaxU
             ? kGatherMaxU
             : kStageBudget / (kCommWarps * kGatherStages * slots * 512);
}
__host__ __device__ constexpr int64_t gather_smem(int slots) {
  return static_cast<int64_t>(kCommWarps) * kGatherStages * slots * gather_units(slots) * 512;
}

__device__ __forceinline__ void gather_sum_rows(const Ctx& c, int U, int slots) {
  const Params& p = c.p;
  __shared__ int32_t stage_terms[kCommWarps][kGatherStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + warp;
  const int nwarps = gridDim.x * kCommWarps;
  // NOTE: N counts this rank's tokens (the loop).
  const int N = p.num_tokens, R = p.num_ranks;
  const int T = max_owner_terms(R, p.num_topk);  // term slots of a stage, then shared_y's
  const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
  const int n16 = static_cast<int>(rb / 16);
  const int per = 32 * U;
  const int nch = (n16 + per - 1) / per;
  const int ntok = gwarp < N ? (N - gwarp + nwarps - 1) / nwarps : 0;
  const int items = ntok * nch;
  const bool has_shared = (p.flags & kFlagHasShared) != 0;
  const bool fp32 = (p.flags & kFlagSharedFp32) != 0;
  const uint8_t* shared_y = static_cast<const uint8_t*>(p.in2);
  uint8_t* out = static_cast<uint8_t*>(p.out0);
  const int stage_bytes = slots * U * 512;
  uint8_t* ring = dyn_smem + static_cast<int64_t>(warp) * kGatherStages * stage_bytes;
  // Owner masks of the warp's tokens, 32 at a time (lane l: token index batch * 32 + l); the
  // issue side walks the tokens in order, so each batch is loaded once.
  RankMask lane_mask;
  lane_mask.clear();
  int batch = -1;
  auto issue = [&](int j) {
    if (j < items) {
      const int i = j / nch, ch = j % nch, s = j % kGatherStages;
      if (i / 32 != batch) {
        batch = i / 32;
        const int ti = batch * 32 + lane;
        if (ti < ntok) {
          lane_mask = token_owners(p, gwarp + ti * nwarps);
        } else {
          lane_mask.clear();
        }
      }
      const RankMask mask = lane_mask.shfl(i % 32);
      const int t = gwarp + i * nwarps;
      if (lane == 0) stage_terms[warp][s] = mask.count();
      uint8_t* st = ring + s * stage_bytes + lane * 16;
      int q = 0;
      for (int d = 0; d < R; ++d) {
        if (!mask.has(d)) continue;
        const uint8_t* src = c.sym(d, p.off_partials) + partials_row(c, t, q) * rb;
        for (int u = 0; u < U; ++u) {
          const int v = ch * per + u * 32 + lane;
          if (v < n16) cp_async16(st + (q * U + u) * 512, src + v * 16);
        }
        ++q;
      }
      if (has_shared) {
        const uint8_t* ip = shared_y + t * rb * (fp32 ? 2 : 1);
        for (int u = 0; u < U; ++u) {
          const int v = ch * per + u * 32 + lane;
          if (v >= n16) continue;
          if (fp32) {
            cp_async16(st + (T * U + u) * 512, ip + v * 32);
            cp_async16(st + ((T + 1) * U + u) * 512, ip + v * 32 + 16);
          } else {
            cp_async16(st + (T * U + u) * 512, ip + v * 16);
          }
        }
      }
    }
    // NOTE: one group per item, empty past the end, so wait_group counts stay in step.
    cp_async_commit();
  };
  for (int j = 0; j < kGatherStages - 1; ++j) issue(j);
  for (int j = 0; j < items; ++j) {
    issue(j + kGatherStages - 1);
    cp_async_wait<kGatherStages - 1>();
    __syncwarp();
    const int i = j / nch, ch = j % nch, s = j % kGatherStages;
    const int t = gwarp + i * nwarps;
    const int n = stage_terms[warp][s];
    const uint8_t* st = ring + s * stage_bytes + lane * 16;
    for (int u = 0; u < U; ++u) {
      const int v = ch * per + u * 32 + lane;
      if (v >= n16) break;
      OrderedSum8 acc;
      if (!has_shared)
        acc.zero();
      else if (fp32)
        acc.start_fp32(*reinterpret_cast<const float4*>(st + (T * U + u) * 512),
                       *reinterpret_cast<const float4*>(st + ((T + 1) * U + u) * 512));
      else
        acc.start_bf16(*reinterpret_cast<const uint4*>(st + (T * U + u) * 512));
      // Weight 1, terms in ascending owner rank.
      for (int q = 0; q < n; ++q)
        acc.add(1.0f, *reinterpret_cast<const uint4*>(st + (q * U + u) * 512));
      reinterpret_cast<uint4*>(out + t * rb)[v] = acc.bf16();
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncwarp();
}

// ---- row ring of dedup_sum (engine "tma") ----------------------------------------------------
// Item = one output row (token t of this rank). Warp 0's lane 0 bulk-loads the peers' partial
// rows of t, whole rows, into the item's stage (one slot per peer term, ascending rank) and
// prefetches its local terms (my own partial, shared_y) into L2; the consumer warp of the
// stage reads the local terms with 16-byte loads and adds everything in the fixed order. Whole rows keep ~14 rows
// of peer data in flight per SM (the chunked tma_reduce_rows kept 4 KiB pieces of them).

// Peer terms of one token at most: one per top-k expert, on every rank but this one.
__host__ __device__ constexpr int max_peer_terms(int num_ranks, int num_topk) {
  return max_owner_terms(num_ranks > 1 ? num_ranks - 1 : 1, num_topk);
}
// Shared-memory bytes of one stage: a whole row per peer term.
__host__ __device__ constexpr int64_t sum_stage_bytes(int64_t row_bytes, int num_ranks,
                                                      int num_topk) {
  return align128(row_bytes) * max_peer_terms(num_ranks, num_topk);
}
// Stages of the row ring (< kMinStages: it does not fit; the chunked pipeline runs instead).
__host__ __device__ constexpr int sum_stages(int64_t row_bytes, int num_ranks, int num_topk) {
  return kStageBudget / sum_stage_bytes(row_bytes, num_ranks, num_topk) > kCommWarps - 1
             ? kCommWarps - 1
             : static_cast<int>(kStageBudget / sum_stage_bytes(row_bytes, num_ranks, num_topk));
}

struct SumRing {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  // Owner rank of each term, ascending (a token's owners, at most num_topk): the term's row is
  // that rank's partial of the token (8 bits each: 64-bit addresses for kMaxTopk terms would
  // push the block past its shared memory beside the stages).
  uint8_t owner[kMetaRing][kMaxTopk];
  uint32_t peer[kMetaRing];  // bit q: term q is a peer's (it sits in the stage)
  int32_t n[kMetaRing];
  int32_t token[kMetaRing];
};

constexpr int kSumVecs = 4;  // 16-byte vectors per lane per step of a consumer warp

__device__ __forceinline__ void tma_sum_rows(const Ctx& c, int stages, uint8_t* smem) {
  const Params& p = c.p;
  __shared__ SumRing ring;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
  const int64_t slot_bytes = align128(rb);
  const int64_t stage_bytes = sum_stage_bytes(rb, p.num_ranks, p.num_topk);
  const int items = block_items(p.num_tokens);
  const bool has_shared = (p.flags & kFlagHasShared) != 0;
  const bool fp32 = (p.flags & kFlagSharedFp32) != 0;
  static_assert(kMaxRanks <= 256, "SumRing::owner holds ranks in 8 bits");
  // Term k of ring slot `slot`: its owner's partial row of the slot's token.
  auto term_row = [&](int slot, int k) -> const uint8_t* {
    return c.sym(ring.owner[slot][k], p.off_partials) + partials_row(c, ring.token[slot], k) * rb;
  };
  ring_barriers_init<true>(ring, stages);
  if (warp == 0) {
    // Ring invariant as in tma_reduce_rows: batch b overwrites batch b - 2, whose items were
    // all consumed before the producer got past their empty barriers.
    auto ensure_meta = [&](int i) {
      if (i % kMetaBatch) return;
      __syncwarp();
      const int it = i + lane;
      if (lane < kMetaBatch && it < items) {
        const int slot = it % kMetaRing;
        const int t = static_cast<int>(blockIdx.x) + it * static_cast<int>(gridDim.x);
        const RankMask mask = token_owners(p, t);
        int n = 0;
        uint32_t peer = 0;  // n <= num_topk <= 32 terms
        for (int d = 0; d < p.num_ranks; ++d) {
          if (!mask.has(d)) continue;
          ring.owner[slot][n] = static_cast<uint8_t>(d);
          if (d != p.rank) peer |= 1u << n;
          ++n;
        }
        ring.n[slot] = n;
        ring.peer[slot] = peer;
        ring.token[slot] = t;
      }
      __syncwarp();
    };
    if (lane == 0) fence_proxy_async();
    for (int i = 0; i < items; ++i) {
      const int s = i % stages;
      if (i >= stages && lane == 0)
        mbar_wait(&ring.empty[s], static_cast<uint32_t>(((i / stages) + 1) & 1));
      ensure_meta(i);
      if (lane == 0) {
        const int slot = i % kMetaRing;
        const uint32_t peer = ring.peer[slot];
        // The local terms go to L2 now, so the consumer's loads of them do not wait on HBM.
        for (int k = 0; k < ring.n[slot]; ++k)
          if (!((peer >> k) & 1u))
            bulk_prefetch_l2(term_row(slot, k), static_cast<uint32_t>(rb));
        if (has_shared)
          bulk_prefetch_l2(static_cast<const uint8_t*>(p.in2) +
                               ring.token[slot] * rb * (fp32 ? 2 : 1),
                           static_cast<uint32_t>(rb * (fp32 ? 2 : 1)));
        if (peer == 0) {
          mbar_arrive(&ring.full[s]);
        } else {
          mbar_arrive_expect_tx(&ring.full[s], static_cast<uint32_t>(rb) * __popc(peer));
          int q = 0;
          for (int k = 0; k < ring.n[slot]; ++k) {
            if (!((peer >> k) & 1u)) continue;
            bulk_load(smem + s * stage_bytes + q * slot_bytes, term_row(slot, k),
                      static_cast<uint32_t>(rb), &ring.full[s]);
            ++q;
          }
        }
      }
      __syncwarp();
    }
  } else if (warp - 1 < stages) {
    const int n16 = static_cast<int>(rb / 16);
    for (int j = warp - 1; j < items; j += stages) {
      const int s = j % stages, slot = j % kMetaRing;
      mbar_wait(&ring.full[s], static_cast<uint32_t>((j / stages) & 1));
      const int n = ring.n[slot];
      const uint32_t peer = ring.peer[slot];
      const int t = ring.token[slot];
      const uint8_t* st = smem + s * stage_bytes;
      const auto* init = static_cast<const uint8_t*>(shared_row(p, t, rb));
      uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out0) + t * rb);
      // The local terms (at most one partial) are loaded before the adds of each step.
      const uint4* own = nullptr;
      int own_q = -1;
      for (int k = 0; k < n; ++k)
        if (!((peer >> k) & 1u)) own = reinterpret_cast<const uint4*>(term_row(slot, k)), own_q = k;
      for (int c0 = 0; c0 < n16; c0 += 32 * kSumVecs) {
        OrderedSum8 acc[kSumVecs];
        uint4 ov[kSumVecs];
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u) {
          const int v = c0 + 32 * u + lane;
          ov[u] = (own != nullptr && v < n16) ? own[v] : make_uint4(0, 0, 0, 0);
          if (v >= n16)
            acc[u].zero();
          else
            acc[u].start(init, fp32, v);
        }
        // Weight 1, terms in ascending owner rank.
        int q = 0;
        for (int k = 0; k < n; ++k) {
          const bool local = k == own_q;
#pragma unroll
          for (int u = 0; u < kSumVecs; ++u) {
            const int v = c0 + 32 * u + lane;
            if (v >= n16) break;
            const uint4* sv = reinterpret_cast<const uint4*>(st + q * slot_bytes);
            acc[u].add(1.0f, local ? ov[u] : sv[v]);
          }
          if (!local) ++q;
        }
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u) {
          const int v = c0 + 32 * u + lane;
          if (v >= n16) continue;
          out[v] = acc[u].bf16();
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[s]);
    }
  }
  __syncthreads();
}

}  // namespace mok
