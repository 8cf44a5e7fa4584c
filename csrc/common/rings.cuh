// Row rings on the bulk-copy (TMA, cp.async.bulk) engine, for the communication kernels.
//
// Two pipelines, both driven by warp 0 of the block, whose lane 0 issues every bulk copy:
//
//   tma_copy_rows:   item = one source row -> n destination rows (n <= kMaxTopk). The row is
//                    loaded once into a shared-memory stage (cp.async.bulk global -> shared,
//                    completing on the stage's mbarrier) and stored from there n times
//                    (cp.async.bulk shared -> global, bulk groups). No other warp takes part.
//   tma_reduce_rows: item = (output row, chunk of the row). The n source chunks (and an
//                    optional init chunk, bf16 or fp32) are bulk-loaded into a stage; one
//                    consumer warp (warps 1..) computes init + sum_k w_k * src_k in fp32 in
//                    the fixed order k = 0..n-1 (__fmul_rn / __fadd_rn) and stores the bf16 row
//                    chunk with 16-byte stores, then frees the stage (empty mbarrier).
//
// The per-item description (pointers, weights, counts) comes from a functor `Meta` and is
// loaded by the whole producer warp, one lane per item, a batch of kMetaBatch items at a time,
// into a shared-memory ring of two batches; the source rows of a peer are read straight from
// its symmetric buffer over NVLink. Items of the block are blockIdx.x + i * gridDim.x.
//
// NOTE: bytes in flight: a stage holds a whole row (copy) or a 4 KiB chunk of each term
// (reduce); up to kMaxStages stages of ~200 KiB of shared memory in total keep 100+ KiB of
// loads in flight per SM, which is what ~1 us of NVLink latency needs for ~15-45 GB/s per SM.
#pragma once

#include <cstdint>

#include "common/rows.cuh"
#include "params.h"
#include "ptx/tma.cuh"

namespace mok {

constexpr int kMaxStages = 16;
constexpr int kMetaBatch = 16;                 // >= kMaxStages (see the ring invariant below)
constexpr int kMetaRing = 2 * kMetaBatch;
constexpr int kStageBudget = 200 * 1024;       // dynamic shared memory for the stages
constexpr int kReduceChunk = 4096;             // max bytes of one bf16 chunk (reduce items)
constexpr int kStoreLag = 2;                   // bulk store groups allowed to read smem
constexpr int kMinStages = 3;

__host__ __device__ constexpr int64_t align128(int64_t v) { return (v + 127) / 128 * 128; }

// Stages of a copy pipeline moving rows of `row_bytes`; < kMinStages: use the vector path.
__host__ __device__ constexpr int copy_stages(int64_t row_bytes) {
  const int64_t s = kStageBudget / align128(row_bytes);
  return s > kMaxStages ? kMaxStages : static_cast<int>(s);
}

// Chunking of a bf16 row for the reduce pipeline: `slots` = chunk-sized slots of a stage (terms
// plus 2 for an fp32 init). Chunks shrink for many terms so that >= kMinStages + 1 stages fit.
__host__ __device__ constexpr int64_t reduce_chunk_cap(int slots) {
  return (kStageBudget / (kMinStages + 1) / slots) / 16 * 16 < kReduceChunk
             ? (kStageBudget / (kMinStages + 1) / slots) / 16 * 16
             : kReduceChunk;
}
__host__ __device__ constexpr int reduce_num_chunks(int64_t row_bytes, int slots) {
  return static_cast<int>((row_bytes + reduce_chunk_cap(slots) - 1) / reduce_chunk_cap(slots));
}
__host__ __device__ constexpr int64_t reduce_chunk_bytes(int64_t row_bytes, int slots) {
  return ((row_bytes + reduce_num_chunks(row_bytes, slots) - 1) /
              reduce_num_chunks(row_bytes, slots) +
          15) /
         16 * 16;
}
__host__ __device__ constexpr int reduce_slots(int max_terms, bool has_init) {
  return max_terms + (has_init ? 2 : 0);
}
__host__ __device__ constexpr int64_t reduce_stage_bytes(int64_t row_bytes, int slots) {
  return align128(reduce_chunk_bytes(row_bytes, slots) * slots);
}
__host__ __device__ constexpr int reduce_stages(int64_t row_bytes, int slots) {
  return kStageBudget / reduce_stage_bytes(row_bytes, slots) > kMaxStages
             ? kMaxStages
             : static_cast<int>(kStageBudget / reduce_stage_bytes(row_bytes, slots));
}

__device__ __forceinline__ int block_items(int total) {
  return total > static_cast<int>(blockIdx.x)
             ? (total - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                   static_cast<int>(gridDim.x)
             : 0;
}

// Thread 0 initialises the first `stages` full barriers of `ring` (and its empty barriers when
// kEmpty), one arrival each; every thread of the block must call it.
template <bool kEmpty, typename Ring>
__device__ __forceinline__ void ring_barriers_init(Ring& ring, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&ring.full[s], 1);
      if constexpr (kEmpty) mbar_init(&ring.empty[s], 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
}

// ---- copy pipeline --------------------------------------------------------------------------
struct CopyRing {
  uint64_t full[kMaxStages];
  uint64_t src[kMetaRing];
  int32_t n[kMetaRing];
  uint64_t dst[kMetaRing][kMaxTopk];
};

// Meta: __device__ void operator()(int row, uint64_t& src, int& n, uint64_t* dst) const for a
// row index (blockIdx.x + i * gridDim.x) < total; n = 0 skips the item (nothing moves).
// Must be called by every thread of the block; only warp 0 works. `smem`: the dynamic shared
// memory (stages * align128(row_bytes) bytes).
__device__ __forceinline__ void copy_ring_init(CopyRing& ring, int stages) {
  ring_barriers_init<false>(ring, stages);
}

// `base`: items this block already moved through `ring` in earlier calls (stage phases carry
// on); returns the new count. The ring must be initialised (copy_ring_init) once.
template <typename Meta>
__device__ __forceinline__ int tma_copy_rows(CopyRing& ring, int base, const Meta& meta,
                                             int total, int64_t row_bytes, int stages,
                                             uint8_t* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t stage_bytes = align128(row_bytes);
  const uint32_t bytes = static_cast<uint32_t>(row_bytes);
  const int items = block_items(total);
  if (warp == 0) {
    // Ring invariant: batch b (items [b * kMetaBatch, (b + 1) * kMetaBatch)) is loaded when the
    // first of its items is; it overwrites batch b - 2, whose items are all stored by then since
    // at most stages <= kMetaBatch items are loaded and not yet stored.
    auto ensure_meta = [&](int i) {
      if (i % kMetaBatch) return;
      __syncwarp();
      const int it = i + lane;
      if (lane < kMetaBatch) {
        const int slot = it % kMetaRing;
        uint64_t src = 0;
        int n = 0;
        if (it < items) meta(static_cast<int>(blockIdx.x) + it * static_cast<int>(gridDim.x), src,
                             n, ring.dst[slot]);
        ring.src[slot] = src;
        ring.n[slot] = n;
      }
      __syncwarp();
    };
    auto issue_load = [&](int i) {
      ensure_meta(i);
      if (lane == 0) {
        const int slot = i % kMetaRing, s = (base + i) % stages;
        if (ring.n[slot] > 0) {
          mbar_arrive_expect_tx(&ring.full[s], bytes);
          bulk_load(smem + s * stage_bytes, reinterpret_cast<const void*>(ring.src[slot]), bytes,
                    &ring.full[s]);
        } else {
          mbar_arrive(&ring.full[s]);
        }
      }
    };
    if (lane == 0) fence_proxy_async();
    for (int i = 0; i < items && i < stages; ++i) issue_load(i);
    for (int j = 0; j < items; ++j) {
      const int s = (base + j) % stages, slot = j % kMetaRing;
      if (lane == 0) {
        mbar_wait(&ring.full[s], static_cast<uint32_t>(((base + j) / stages) & 1));
        const int n = ring.n[slot];
        for (int k = 0; k < n; ++k)
          bulk_store(reinterpret_cast<void*>(ring.dst[slot][k]), smem + s * stage_bytes, bytes);
        bulk_commit();
        bulk_wait_read<kStoreLag>();
      }
      __syncwarp();
      // Stage of item j - kStoreLag has been read by its stores: refill it.
      const int next = j - kStoreLag + stages;
      if (j >= kStoreLag && next < items) issue_load(next);
    }
    if (lane == 0) {
      bulk_wait_all();
      fence_proxy_async();
    }
    __syncwarp();
  }
  __syncthreads();
  return base + items;
}

// ---- reduce pipeline ------------------------------------------------------------------------
struct ReduceRing {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  uint64_t src[kMetaRing][kMaxTopk];
  float w[kMetaRing][kMaxTopk];
  uint64_t init[kMetaRing];
  uint64_t out[kMetaRing];
  int32_t n[kMetaRing];
  int32_t bytes[kMetaRing];
};

// Meta: __device__ int operator()(int row, uint64_t* src, float* w, uint64_t& init,
// uint64_t& out) const -> number of terms (<= max_terms) of output row `row` (< total);
// src/init/out point at the start of the rows (init: fp32 if init_fp32 else bf16; 0: none).
// Must be called by every thread of the block (>= 2 warps).
template <typename Meta>
__device__ __forceinline__ void tma_reduce_rows(const Meta& meta, int total, int64_t row_bytes,
                                                int max_terms, bool has_init, bool init_fp32,
                                                int stages, uint8_t* smem) {
  __shared__ ReduceRing ring;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // NOTE: consumer warp c owns stage c and takes the items j = c (mod stages), so each full
  // barrier is waited on by one warp, phase after phase (a warp running more than one phase
  // ahead would read a parity that aliases an older phase).
  if (stages > static_cast<int>(blockDim.x / 32) - 1) stages = blockDim.x / 32 - 1;
  const int slots = reduce_slots(max_terms, has_init);
  const int nch = reduce_num_chunks(row_bytes, slots);
  const int64_t cb = reduce_chunk_bytes(row_bytes, slots);
  const int64_t stage_bytes = reduce_stage_bytes(row_bytes, slots);
  const int items = block_items(total) * nch;
  ring_barriers_init<true>(ring, stages);
  if (warp == 0) {
    // Same ring invariant as tma_copy_rows: an item's meta is read by its consumer before the
    // stage is freed, and at most `stages` items are between load and free.
    auto ensure_meta = [&](int i) {
      if (i % kMetaBatch) return;
      __syncwarp();
      const int it = i + lane;
      if (lane < kMetaBatch) {
        const int slot = it % kMetaRing;
        int n = 0;
        int64_t b = 0;
        uint64_t init = 0, out = 0;
        if (it < items) {
          const int row = static_cast<int>(blockIdx.x) + (it / nch) * static_cast<int>(gridDim.x);
          const int64_t c0 = (it % nch) * cb;
          b = row_bytes - c0 < cb ? row_bytes - c0 : cb;
          n = meta(row, ring.src[slot], ring.w[slot], init, out);
          for (int k = 0; k < n; ++k) ring.src[slot][k] += c0;
          if (init) init += c0 * (init_fp32 ? 2 : 1);
          out += c0;
        }
        ring.n[slot] = n;
        ring.bytes[slot] = static_cast<int32_t>(b);
        ring.init[slot] = init;
        ring.out[slot] = out;
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
        const int slot = i % kMetaRing, n = ring.n[slot];
        const uint32_t b = static_cast<uint32_t>(ring.bytes[slot]);
        const uint64_t init = ring.init[slot];
        const uint32_t ib = init ? b * (init_fp32 ? 2 : 1) : 0;
        uint8_t* st = smem + s * stage_bytes;
        mbar_arrive_expect_tx(&ring.full[s], b * n + ib);
        for (int k = 0; k < n; ++k)
          bulk_load(st + k * cb, reinterpret_cast<const void*>(ring.src[slot][k]), b,
                    &ring.full[s]);
        if (init)
          bulk_load(st + max_terms * cb, reinterpret_cast<const void*>(init), ib, &ring.full[s]);
      }
      __syncwarp();
    }
  } else {
    for (int j = warp - 1; warp - 1 < stages && j < items; j += stages) {
      const int s = j % stages, slot = j % kMetaRing;
      mbar_wait(&ring.full[s], static_cast<uint32_t>((j / stages) & 1));
      const int n = ring.n[slot];
      const int n16 = ring.bytes[slot] / 16;
      const uint8_t* st = smem + s * stage_bytes;
      const bool has = ring.init[slot] != 0;
      uint4* out = reinterpret_cast<uint4*>(ring.out[slot]);
      for (int c = lane; c < n16; c += 32) {
        OrderedSum8 acc;
        acc.start(has ? st + max_terms * cb : nullptr, init_fp32, c);
        for (int k = 0; k < n; ++k)
          acc.add(ring.w[slot][k], reinterpret_cast<const uint4*>(st + k * cb)[c]);
        out[c] = acc.bf16();
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[s]);
    }
  }
  __syncthreads();
}

}  // namespace mok
