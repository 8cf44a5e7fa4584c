// Combine: expert outputs back to the token's home rank, then the fixed-order weighted sum.
//
//   push:       the expert owner stores row p into slot src_index[p] = token * num_topk + k of
//               home rank src_rank[p]; the home rank waits for every rank, then reduces;
//   dedup push: the owner first sums its rows of a token in k order (fp32, rounded to bf16) and
//               pushes one row per (token, rank) into slot token * num_topk + j;
//   pull:       the home rank reads the k rows of each token straight from the owners'
//               symmetric expert-output buffers while it reduces (no slots).
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
    constexpr int kGroup = 4;  // loads in flight per lane before the ordered adds
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
__device__ __forceinline__ void reduce_tokens(const Ctx& c, int mode) {
  const Params& p = c.p;
  __shared__ WarpTerms terms;
  const int K = p.num_topk, L = p.num_local_experts;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * kCommWarps + warp;
  const int nwarps = gridDim.x * kCommWarps;
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
  if (c.aborted()) return;
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
  reduce_tokens(c, kDedup ? 1 : 0);
}

// in0: y [capacity, hidden] bf16 (staged into the symmetric y buffer if kFlagStage, else y
// already lives there); in1, in2, out0 as combine_push_kernel.
__global__ void __launch_bounds__(kCommThreads) combine_pull_kernel(const Params p) {
  const Ctx c(p);
  if (c.aborted()) return;
  if (p.flags & kFlagStage) {
    if (!block_wait_all(c, kSigYConsumed, static_cast<uint64_t>(p.epoch - 1) * gridDim.x))
      return;
    const int num_rows = p.sched[p.o_meta + kMetaNumRows];
    grid_copy(c.sym(p.rank, p.off_y), p.in0, static_cast<int64_t>(num_rows) * p.hidden * 2);
    if (!grid_sync(c)) return;
  }
  if (blockIdx.x == 0) block_signal_all(c, kSigYReady);
  if (!block_wait_all(c, kSigYReady, static_cast<uint64_t>(p.epoch))) return;
  reduce_tokens(c, 2);
  block_signal_all(c, kSigYConsumed);
}

}  // namespace mok
