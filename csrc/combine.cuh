// Combine: expert outputs back to the token's home rank, then the fixed-order weighted sum.
//
//   push:       the expert owner stores row p into slot src_index[p] = token * num_topk + k of
//               home rank src_rank[p]; the home rank waits for every rank, then reduces;
//   dedup push: the owner first sums its rows of a token in k order (fp32, rounded to bf16) and
//               pushes one row per (token, rank) into slot token * num_topk + j;
//   pull:       the home rank reads the k rows of each token straight from the owners'
//               symmetric expert-output buffers while it reduces (no slots).
//   dedup pull: two kernels. dedup_partials_kernel (local, the expert stage's epilogue in the
//               fused layer): the owner sums its rows of each dedup row in k order (fp32,
//               rounded to bf16) into its symmetric partials buffer, row src_rank * N + token.
//               dedup_sum_kernel (the transfer, comparable with other libraries' combine): the
//               home rank bulk-loads its token's partial rows from every owner (ascending rank)
//               and sums them onto shared_y. Both run the tma.cuh reduce pipeline, or one
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

#include "dispatch.cuh"
#include "params.h"
#include "rows.cuh"
#include "sync.cuh"
#include "tma.cuh"

namespace mok {

// One warp: out[:] = bf16(init + sum_k w_k * src_k) over a row of `hidden` bf16 (n16 vectors).
// src_k / w_k come from the warp's shared slots (src 0: the term is w_k * 0). `init` is bf16 or
// fp32 (init_fp32) or null.
__device__ __forceinline__ void warp_weighted_sum(uint4* out, const void* init, bool init_fp32,
                                                  const uint64_t* s_src, const float* s_w, int n,
                                                  int n16, int lane) {
  for (int c = lane; c < n16; c += 32) {
    float acc[8];
    if (init == nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    } else if (init_fp32) {
      const float4 a = static_cast<const float4*>(init)[2 * c];
      const float4 b = static_cast<const float4*>(init)[2 * c + 1];
      acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
      acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
    } else {
      const uint4 v = static_cast<const uint4*>(init)[c];
      const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[2 * i] = bf16_lo(w4[i]), acc[2 * i + 1] = bf16_hi(w4[i]);
    }
    // Loads in flight per lane before the ordered adds: all 8 of a top-8 token at once (the
    // final sum of the fused layer ran at ~53% of the HBM rate with 4; the adds keep k order).
    constexpr int kGroup = 8;
    for (int k0 = 0; k0 < n; k0 += kGroup) {
      uint4 v[kGroup];
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        const uint64_t src = (k0 + u < n) ? s_src[k0 + u] : 0;
        v[u] = src ? reinterpret_cast<const uint4*>(src)[c] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        if (k0 + u >= n) break;
        const float w = s_w[k0 + u];
        const uint32_t w4[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, bf16_lo(w4[i])));
          acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, bf16_hi(w4[i])));
        }
      }
    }
    uint4 o;
    o.x = pack_bf16x2(acc[0], acc[1]);
    o.y = pack_bf16x2(acc[2], acc[3]);
    o.z = pack_bf16x2(acc[4], acc[5]);
    o.w = pack_bf16x2(acc[6], acc[7]);
    out[c] = o;
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
  const bool has_shared = (p.flags & kFlagHasShared) != 0;
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
    const void* init = nullptr;
    if (has_shared)
      init = static_cast<const uint8_t*>(p.in2) + t * row_bytes * (shared_fp32 ? 2 : 1);
    uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out0) + t * row_bytes);
    warp_weighted_sum(out, init, shared_fp32, terms.src[warp], terms.w[warp], K, n16, lane);
    __syncwarp();
  }
}

// in0: y [capacity, hidden] bf16 (expert outputs in schedule row order, local);
// in1: topk_weights [num_tokens, num_topk] fp32; in2: shared_y [num_tokens, hidden] or null;
// in3: topk_idx [num_tokens, num_topk] int32 (dedup); out0: out [num_tokens, hidden] bf16.
template <bool kDedup>
__global__ void __launch_bounds__(kCommThreads) combine_push_kernel(const Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  // NOTE: my slots are free once this kernel runs: the previous reduce that read them is an
  // earlier kernel on this stream.
  if (blockIdx.x == 0) block_signal_all(c, kSigSlotsFree);
  if (!block_wait_all(c, kSigSlotsFree, static_cast<uint64_t>(p.epoch))) return;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
  const int n16 = static_cast<int>(row_bytes / 16);
  const int K = p.num_topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + warp;
  const int nwarps = gridDim.x * kCommWarps;
  const uint8_t* y = static_cast<const uint8_t*>(p.in0);
  if (!kDedup) {
    const int32_t* src_rank = p.sched + p.o_src_rank;
    const int32_t* src_index = p.sched + p.o_src_index;
    const int num_rows = p.sched[p.o_meta + kMetaNumRows];
    for (int row = gwarp; row < num_rows; row += nwarps) {
      const int r = src_rank[row];
      if (r < 0) continue;
      uint8_t* slot = c.sym(r, p.off_slots) + src_index[row] * row_bytes;
      warp_copy_row(reinterpret_cast<int4*>(slot),
                    reinterpret_cast<const int4*>(y + row * row_bytes), n16, lane);
    }
  } else {
    __shared__ WarpTerms terms;
    const int32_t* d_src_rank = p.sched + p.o_dedup_src_rank;
    const int32_t* d_slot = p.sched + p.o_dedup_slot;
    const int32_t* fan_rows = p.sched + p.o_fan_rows;
    const float* fan_w = reinterpret_cast<const float*>(p.sched + p.o_fan_w);
    const int num_dedup = p.sched[p.o_meta + kMetaNumDedup];
    for (int row = gwarp; row < num_dedup; row += nwarps) {
      const int fr = lane < K ? fan_rows[row * K + lane] : -1;
      const int n = warp_list_length(fr);  // entries past the -1 terminator are stale
      if (lane < n) {
        terms.src[warp][lane] = reinterpret_cast<uint64_t>(y + fr * row_bytes);
        terms.w[warp][lane] = fan_w[row * K + lane];
      }
      __syncwarp();
      uint8_t* slot = c.sym(d_src_rank[row], p.off_slots) + d_slot[row] * row_bytes;
      warp_weighted_sum(reinterpret_cast<uint4*>(slot), nullptr, false, terms.src[warp],
                        terms.w[warp], n, n16, lane);
      __syncwarp();
    }
  }
  block_signal_all(c, kSigSlotsFilled);
  if (!block_wait_all(c, kSigSlotsFilled, static_cast<uint64_t>(p.epoch) * gridDim.x)) return;
  __shared__ WarpTerms terms;
  reduce_tokens(c, kDedup ? 1 : 0, terms);
}

// in0: y [capacity, hidden] bf16 (staged into the symmetric y buffer if kFlagStage, else y
// already lives there); in1, in2, out0 as combine_push_kernel.
__global__ void __launch_bounds__(kCommThreads) combine_pull_kernel(const Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  if (p.flags & kFlagStage) {
    if (!block_wait_all(c, kSigYConsumed, static_cast<uint64_t>(p.epoch - 1) * gridDim.x))
      return;
    const int num_rows = p.sched[p.o_meta + kMetaNumRows];
    grid_copy(c.sym(p.rank, p.off_y), p.in0, static_cast<int64_t>(num_rows) * p.hidden * 2);
    if (!grid_sync(c)) return;
  }
  if (blockIdx.x == 0) block_signal_all(c, kSigYReady);
  if (!block_wait_all(c, kSigYReady, static_cast<uint64_t>(p.epoch))) return;
  __shared__ WarpTerms terms;
  reduce_tokens(c, 2, terms);
  block_signal_all(c, kSigYConsumed);
}

}  // namespace mok

namespace mok {

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
    const int64_t prow = static_cast<int64_t>(p.sched[p.o_dedup_src_rank + row]) * p.max_tokens +
                         p.sched[p.o_dedup_src_token + row];
    init = 0;
    out = reinterpret_cast<uint64_t>(c->sym(p.rank, p.off_partials) + prow * rb);
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
    const int K = p.num_topk;
    const int32_t* dr = p.sched + p.o_dst_rank + static_cast<int64_t>(t) * K;
    uint32_t mask = 0;
    for (int k = 0; k < K; ++k) mask |= 1u << dr[k];
    int n = 0;
    const int64_t prow = static_cast<int64_t>(p.rank) * p.max_tokens + t;
    for (int d = 0; d < p.num_ranks; ++d) {
      if (!((mask >> d) & 1u)) continue;
      src[n] = reinterpret_cast<uint64_t>(c->sym(d, p.off_partials) + prow * rb);
      w[n] = 1.0f;
      ++n;
    }
    init = 0;
    if (p.flags & kFlagHasShared)
      init = reinterpret_cast<uint64_t>(static_cast<const uint8_t*>(p.in2) +
                                        t * rb * ((p.flags & kFlagSharedFp32) ? 2 : 1));
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
  float acc[kSegVecs][8];
  const int base = seg * 32 * kSegVecs + lane;
#pragma unroll
  for (int u = 0; u < kSegVecs; ++u) {
    const int c = base + 32 * u;
    if (init == nullptr || c >= n16) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    } else if (init_fp32) {
      const float4 a = reinterpret_cast<const float4*>(init)[2 * c];
      const float4 b = reinterpret_cast<const float4*>(init)[2 * c + 1];
      acc[u][0] = a.x, acc[u][1] = a.y, acc[u][2] = a.z, acc[u][3] = a.w;
      acc[u][4] = b.x, acc[u][5] = b.y, acc[u][6] = b.z, acc[u][7] = b.w;
    } else {
      const uint4 v = reinterpret_cast<const uint4*>(init)[c];
      const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc[u][2 * i] = bf16_lo(w4[i]), acc[u][2 * i + 1] = bf16_hi(w4[i]);
    }
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
      for (int u = 0; u < kSegVecs; ++u) {
        const uint32_t w4[4] = {v[g][u].x, v[g][u].y, v[g][u].z, v[g][u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[u][2 * i] = __fadd_rn(acc[u][2 * i], __fmul_rn(wk, bf16_lo(w4[i])));
          acc[u][2 * i + 1] = __fadd_rn(acc[u][2 * i + 1], __fmul_rn(wk, bf16_hi(w4[i])));
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kSegVecs; ++u) {
    const int c = base + 32 * u;
    if (c >= n16) continue;
    uint4 o;
    o.x = pack_bf16x2(acc[u][0], acc[u][1]);
    o.y = pack_bf16x2(acc[u][2], acc[u][3]);
    o.z = pack_bf16x2(acc[u][4], acc[u][5]);
    o.w = pack_bf16x2(acc[u][6], acc[u][7]);
    reinterpret_cast<uint4*>(out)[c] = o;
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

// in0: y [capacity, hidden] bf16 (local). Fills my partials buffer for this epoch (family
// "partials"), after every rank finished reading the previous epoch's partials.
__global__ void __launch_bounds__(kCommThreads) dedup_partials_kernel(const Params p) {
  const Ctx c(p);
  if (block_aborted(c)) return;
  if (!block_wait_all(c, kSigPartConsumed, static_cast<uint64_t>(p.epoch - 1))) return;
  const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
  const int slots = partials_slots(p.num_topk);
  const PartialsMeta meta{&c, static_cast<const uint8_t*>(p.in0)};
  const int num_dedup = p.sched[p.o_meta + kMetaNumDedup];
  if (p.flags & kFlagVector)
    warp_reduce_rows(meta, num_dedup, rb, false);
  else
    tma_reduce_rows(meta, num_dedup, rb, p.num_topk, false, false, reduce_stages(rb, slots),
                    dyn_smem);
  if (last_block(c)) block_store_all(c, kSigPartReady, static_cast<uint64_t>(p.epoch));
}

// ---- gather ring of dedup_sum ----------------------------------------------------------------
// Item = (token, chunk of 32 * U vectors of its row). Per warp a ring of kGatherStages stages;
// a stage holds, per slot (term 0..num_ranks-1, then 1 or 2 slots of shared_y), U vectors per
// lane, laid out [slot][u][lane] x 16 B (a warp's accesses are 512 contiguous bytes). Every
// lane copies and later reads only its own vectors, so cp.async.wait_group alone orders them.
constexpr int kGatherStages = 4;
constexpr int kGatherMaxU = 8;

__host__ __device__ constexpr int gather_slots(int num_ranks, bool has_shared, bool fp32) {
  return num_ranks + (has_shared ? (fp32 ? 2 : 1) : 0);
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

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Owner ranks (bit mask) of token t: the ranks of its top-k experts.
__device__ __forceinline__ uint32_t token_owner_mask(const Params& p, int t) {
  const int32_t* dr = p.sched + p.o_dst_rank + static_cast<int64_t>(t) * p.num_topk;
  uint32_t mask = 0;
  for (int k = 0; k < p.num_topk; ++k) mask |= 1u << dr[k];
  return mask;
}

__device__ __forceinline__ void gather_sum_rows(const Ctx& c, int U, int slots) {
  const Params& p = c.p;
  __shared__ uint32_t stage_mask[kCommWarps][kGatherStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + warp;
  const int nwarps = gridDim.x * kCommWarps;
  // NOTE: N counts this rank's tokens (the loop); partial rows are laid out by max_tokens.
  const int N = p.num_tokens, R = p.num_ranks;
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
  uint32_t lane_mask = 0;
  int batch = -1;
  auto issue = [&](int j) {
    if (j < items) {
      const int i = j / nch, ch = j % nch, s = j % kGatherStages;
      if (i / 32 != batch) {
        batch = i / 32;
        const int ti = batch * 32 + lane;
        lane_mask = ti < ntok ? token_owner_mask(p, gwarp + ti * nwarps) : 0;
      }
      const uint32_t mask = __shfl_sync(0xffffffffu, lane_mask, i % 32);
      const int t = gwarp + i * nwarps;
      if (lane == 0) stage_mask[warp][s] = mask;
      uint8_t* st = ring + s * stage_bytes + lane * 16;
      const int64_t prow = static_cast<int64_t>(p.rank) * p.max_tokens + t;
      int q = 0;
      for (int d = 0; d < R; ++d) {
        if (!((mask >> d) & 1u)) continue;
        const uint8_t* src = c.sym(d, p.off_partials) + prow * rb;
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
            cp_async16(st + (R * U + u) * 512, ip + v * 32);
            cp_async16(st + ((R + 1) * U + u) * 512, ip + v * 32 + 16);
          } else {
            cp_async16(st + (R * U + u) * 512, ip + v * 16);
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
    const int n = __popc(stage_mask[warp][s]);
    const uint8_t* st = ring + s * stage_bytes + lane * 16;
    for (int u = 0; u < U; ++u) {
      const int v = ch * per + u * 32 + lane;
      if (v >= n16) break;
      float acc[8];
      if (!has_shared) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
      } else if (fp32) {
        const float4 a = *reinterpret_cast<const float4*>(st + (R * U + u) * 512);
        const float4 b = *reinterpret_cast<const float4*>(st + ((R + 1) * U + u) * 512);
        acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
        acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
      } else {
        const uint4 x = *reinterpret_cast<const uint4*>(st + (R * U + u) * 512);
        const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[2 * e] = bf16_lo(w4[e]), acc[2 * e + 1] = bf16_hi(w4[e]);
      }
      // Same arithmetic as warp_sum_segment with w = 1 (ascending owner rank).
      for (int q = 0; q < n; ++q) {
        const uint4 x = *reinterpret_cast<const uint4*>(st + (q * U + u) * 512);
        const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[2 * e] = __fadd_rn(acc[2 * e], __fmul_rn(1.0f, bf16_lo(w4[e])));
          acc[2 * e + 1] = __fadd_rn(acc[2 * e + 1], __fmul_rn(1.0f, bf16_hi(w4[e])));
        }
      }
      uint4 o;
      o.x = pack_bf16x2(acc[0], acc[1]);
      o.y = pack_bf16x2(acc[2], acc[3]);
      o.z = pack_bf16x2(acc[4], acc[5]);
      o.w = pack_bf16x2(acc[6], acc[7]);
      reinterpret_cast<uint4*>(out + t * rb)[v] = o;
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

// Shared-memory bytes of one stage: a whole row per peer term.
__host__ __device__ constexpr int64_t sum_stage_bytes(int64_t row_bytes, int num_ranks) {
  return align128(row_bytes) * (num_ranks > 1 ? num_ranks - 1 : 1);
}
// Stages of the row ring (< kMinStages: it does not fit; the chunked pipeline runs instead).
__host__ __device__ constexpr int sum_stages(int64_t row_bytes, int num_ranks) {
  return kStageBudget / sum_stage_bytes(row_bytes, num_ranks) > kCommWarps - 1
             ? kCommWarps - 1
             : static_cast<int>(kStageBudget / sum_stage_bytes(row_bytes, num_ranks));
}

struct SumRing {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  uint64_t src[kMetaRing][kMaxRanks];  // term rows, ascending owner rank
  uint32_t peer[kMetaRing];            // bit q: term q is a peer's (it sits in the stage)
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
  const int64_t stage_bytes = sum_stage_bytes(rb, p.num_ranks);
  const int items = block_items(p.num_tokens);
  const bool has_shared = (p.flags & kFlagHasShared) != 0;
  const bool fp32 = (p.flags & kFlagSharedFp32) != 0;
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
        const uint32_t mask = token_owner_mask(p, t);
        const int64_t prow = static_cast<int64_t>(p.rank) * p.max_tokens + t;
        int n = 0;
        uint32_t peer = 0;
        for (int d = 0; d < p.num_ranks; ++d) {
          if (!((mask >> d) & 1u)) continue;
          ring.src[slot][n] = reinterpret_cast<uint64_t>(c.sym(d, p.off_partials) + prow * rb);
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
            bulk_prefetch_l2(reinterpret_cast<const void*>(ring.src[slot][k]),
                             static_cast<uint32_t>(rb));
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
            bulk_load(smem + s * stage_bytes + q * slot_bytes,
                      reinterpret_cast<const void*>(ring.src[slot][k]), static_cast<uint32_t>(rb),
                      &ring.full[s]);
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
      const uint8_t* init =
          has_shared ? static_cast<const uint8_t*>(p.in2) + t * rb * (fp32 ? 2 : 1) : nullptr;
      uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out0) + t * rb);
      // The local terms (at most one partial) are loaded before the adds of each step.
      const uint4* own = nullptr;
      int own_q = -1;
      for (int k = 0; k < n; ++k)
        if (!((peer >> k) & 1u)) own = reinterpret_cast<const uint4*>(ring.src[slot][k]), own_q = k;
      for (int c0 = 0; c0 < n16; c0 += 32 * kSumVecs) {
        float acc[kSumVecs][8];
        uint4 ov[kSumVecs];
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u) {
          const int v = c0 + 32 * u + lane;
          ov[u] = (own != nullptr && v < n16) ? own[v] : make_uint4(0, 0, 0, 0);
          if (init == nullptr || v >= n16) {
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
          } else if (fp32) {
            const float4 a = reinterpret_cast<const float4*>(init)[2 * v];
            const float4 b = reinterpret_cast<const float4*>(init)[2 * v + 1];
            acc[u][0] = a.x, acc[u][1] = a.y, acc[u][2] = a.z, acc[u][3] = a.w;
            acc[u][4] = b.x, acc[u][5] = b.y, acc[u][6] = b.z, acc[u][7] = b.w;
          } else {
            const uint4 x = reinterpret_cast<const uint4*>(init)[v];
            const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc[u][2 * e] = bf16_lo(w4[e]), acc[u][2 * e + 1] = bf16_hi(w4[e]);
          }
        }
        // Same arithmetic as warp_sum_segment with w = 1, terms in ascending owner rank.
        int q = 0;
        for (int k = 0; k < n; ++k) {
          const bool local = k == own_q;
#pragma unroll
          for (int u = 0; u < kSumVecs; ++u) {
            const int v = c0 + 32 * u + lane;
            if (v >= n16) break;
            const uint4 x =
                local ? ov[u] : reinterpret_cast<const uint4*>(st + q * slot_bytes)[v];
            const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[u][2 * e] = __fadd_rn(acc[u][2 * e], __fmul_rn(1.0f, bf16_lo(w4[e])));
              acc[u][2 * e + 1] = __fadd_rn(acc[u][2 * e + 1], __fmul_rn(1.0f, bf16_hi(w4[e])));
            }
          }
          if (!local) ++q;
        }
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u) {
          const int v = c0 + 32 * u + lane;
          if (v >= n16) continue;
          uint4 o;
          o.x = pack_bf16x2(acc[u][0], acc[u][1]);
          o.y = pack_bf16x2(acc[u][2], acc[u][3]);
          o.z = pack_bf16x2(acc[u][4], acc[u][5]);
          o.w = pack_bf16x2(acc[u][6], acc[u][7]);
          out[v] = o;
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[s]);
    }
  }
  __syncthreads();
}

// in2: shared_y [num_tokens, hidden] (bf16 or fp32) or null; out0: out [num_tokens, hidden] bf16.
// Reads every owner's partials of epoch p.epoch. NOTE: the owners may overwrite them once every
// rank said "consumed", so only the last sum of an epoch says it (the others carry kFlagKeep).
__global__ void __launch_bounds__(kCommThreads) dedup_sum_kernel(const Params p) {
  const Ctx c(p);
  stamp(p, 0);
  if (block_aborted(c)) return;
  if (!block_wait_all(c, kSigPartReady, static_cast<uint64_t>(p.epoch))) return;
  stamp(p, 1);
  const int64_t rb = static_cast<int64_t>(p.hidden) * 2;
  const bool has_shared = (p.flags & kFlagHasShared) != 0;
  const bool fp32 = (p.flags & kFlagSharedFp32) != 0;
  const int slots = reduce_slots(p.num_ranks, has_shared);
  const int gslots = gather_slots(p.num_ranks, has_shared, fp32);
  if ((p.flags & kFlagGather) && gather_units(gslots) > 0)
    gather_sum_rows(c, gather_units(gslots), gslots);
  else if (p.flags & (kFlagVector | kFlagGather))
    warp_reduce_rows(DedupSumMeta{&c}, p.num_tokens, rb, fp32);
  else if (sum_stages(rb, p.num_ranks) >= kMinStages)
    tma_sum_rows(c, sum_stages(rb, p.num_ranks), dyn_smem);
  else
    tma_reduce_rows(DedupSumMeta{&c}, p.num_tokens, rb, p.num_ranks, has_shared, fp32,
                    reduce_stages(rb, slots), dyn_smem);
  stamp(p, 2);
  if (last_block(c) && !(p.flags & kFlagKeep))
    block_store_all(c, kSigPartConsumed, static_cast<uint64_t>(p.epoch));
  stamp(p, 3);
}

}  // namespace mok
