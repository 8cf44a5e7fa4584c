// Row movement with 16-byte vector loads and stores, one warp per row.
//
// NOTE: loads from a peer's symmetric buffer are plain (weak) global loads: they are ordered
// after the peer's release by the block's acquire + __syncthreads (common/waits.cuh), and the
// source
// rows do not change while the kernel runs. Stores to a peer are weak too; the block publishes
// them with a system fence before it raises the peer's counter.
#pragma once

#include <cstdint>

namespace mok {

// Vectors in flight per lane: 8 x 16 B x 32 lanes = 4 KiB per warp, 64 KiB per 16-warp block,
// enough outstanding bytes to cover the ~1 us NVLink load latency from a few dozen SMs.
constexpr int kUnroll = 8;

// One row by one warp: steps of kUnroll 16-byte chunks per lane, the last step predicated so
// that all of its loads are in flight at once (a row shorter than 32 x kUnroll chunks, 4 KiB,
// e.g. hidden 1536 in bf16, is one step, not one load round trip per chunk).
__device__ __forceinline__ void warp_copy_row(int4* __restrict__ dst, const int4* __restrict__ src,
                                              int n16, int lane) {
  for (int i = lane; i < n16; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < n16) v[u] = src[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + 32 * u < n16) dst[i + 32 * u] = v[u];
  }
}

// warp_copy_row with the rest of the row after the full steps copied one chunk per lane at a
// time (one load round trip each): fewer registers. The fused forward kernel stages x and pulls
// dedup rows with it (the predicated tail there as well makes ptxas serialise the consumers'
// wgmma, C7511), and the fused backward's producer warpgroup, which runs on 56 registers
// (with the predicated tail its spills grow from 8 / 16 to 324 / 408 bytes).
__device__ __forceinline__ void warp_copy_row_lean(int4* __restrict__ dst,
                                                   const int4* __restrict__ src, int n16,
                                                   int lane) {
  int i = lane;
  for (; i + 32 * (kUnroll - 1) < n16; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + 32 * u] = v[u];
  }
  for (; i < n16; i += 32) dst[i] = src[i];
}

// One source row to `n` destination rows (n <= 32): lane j holds destination j in `lane_dst`
// (a register, broadcast by shuffles, so no per-thread pointer array spills to local memory).
__device__ __forceinline__ void warp_fan_row(uint64_t lane_dst, int n, const int4* __restrict__ src,
                                             int n16, int lane) {
  // NOTE: the loop bounds are warp-uniform (the shuffles need every lane); each lane guards its
  // own elements.
  for (int base = 0; base < n16; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + 32 * u + lane;
      if (i < n16) v[u] = src[i];
    }
    for (int j = 0; j < n; ++j) {
      int4* d = reinterpret_cast<int4*>(__shfl_sync(0xffffffffu, lane_dst, j));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + 32 * u + lane;
        if (i < n16) d[i] = v[u];
      }
    }
  }
}

// Length of a -1 terminated list held one entry per lane (lanes past the list hold -1 or junk).
__device__ __forceinline__ int warp_list_length(int entry) {
  const unsigned term = __ballot_sync(0xffffffffu, entry < 0);
  return term ? __ffs(term) - 1 : 32;
}

// Block-wide copy of `bytes` (multiple of 16) split over the grid.
__device__ __forceinline__ void grid_copy(void* dst, const void* src, int64_t bytes) {
  const int64_t n16 = bytes / 16;
  int4* d = static_cast<int4*>(dst);
  const int4* s = static_cast<const int4*>(src);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

// bf16 <-> fp32 by bit manipulation (round to nearest even, NaN kept quiet), so no header
// macros of the build can change the rounding.
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// One cvt instruction (round to nearest even; the same bits as f32_to_bf16_bits except NaN
// payloads).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
  return v;
}


// The fixed-order sum of bf16 rows that bitwise determinism rests on, for 8 elements (one
// 16-byte vector) per lane: an fp32 accumulator, optionally started from an fp32 or bf16 row,
// and terms added one at a time as acc = round(acc + round(w * term)) (__fmul_rn, __fadd_rn:
// no fused multiply-add, whatever the compiler's contraction setting), in the caller's term
// order; the result is rounded to bf16 once, at the end. Every combine, reduce and final sum
// uses this one helper, so their bits agree with each other and with the reference.
struct OrderedSum8 {
  float v[8];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
  }
  __device__ __forceinline__ void start_bf16(uint4 x) {
    const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[2 * i] = bf16_lo(w4[i]), v[2 * i + 1] = bf16_hi(w4[i]);
  }
  __device__ __forceinline__ void start_fp32(float4 a, float4 b) {
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
  // Vector c of a row: nothing (zero), fp32 (two float4 at 2c) or bf16 (one uint4 at c).
  __device__ __forceinline__ void start(const void* init, bool init_fp32, int c) {
    if (init == nullptr) {
      zero();
    } else if (init_fp32) {
      const float4* f = static_cast<const float4*>(init);
      start_fp32(f[2 * c], f[2 * c + 1]);
    } else {
      start_bf16(static_cast<const uint4*>(init)[c]);
    }
  }
  __device__ __forceinline__ void add(float w, uint4 x) {
    const uint32_t w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __fadd_rn(v[2 * i], __fmul_rn(w, bf16_lo(w4[i])));
      v[2 * i + 1] = __fadd_rn(v[2 * i + 1], __fmul_rn(w, bf16_hi(w4[i])));
    }
  }
  __device__ __forceinline__ uint4 bf16() const {
    uint4 o;
    o.x = pack_bf16x2(v[0], v[1]);
    o.y = pack_bf16x2(v[2], v[3]);
    o.z = pack_bf16x2(v[4], v[5]);
    o.w = pack_bf16x2(v[6], v[7]);
    return o;
  }
};

// acc += weight(k) * load(k, true) for k = 0 .. n-1 in that order (load(k, valid): one bf16x8
// vector of term k, zeros where !valid), kGroup loads in flight per lane before their adds.
template <int kGroup, class Load, class Weight>
__device__ __forceinline__ void add_in_k_order(OrderedSum8& acc, int n, Load load,
                                               Weight weight) {
  for (int k0 = 0; k0 < n; k0 += kGroup) {
    uint4 v[kGroup];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) v[u] = load(k0 + u, k0 + u < n);
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      if (k0 + u >= n) break;
      acc.add(weight(k0 + u), v[u]);
    }
  }
}

}  // namespace mok
