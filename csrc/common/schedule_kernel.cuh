// The schedule kernel: routing all-gather and the schedule table (common/schedule.cuh describes
// the table). Included by the communication launcher only.
#pragma once

#include <cstdint>

#include "common/schedule.cuh"
#include "params.h"

namespace mok {

// Phase 0 of the schedule: my routing (n entries of ids and weights) into my slot of every rank's
// route buffers (parity p.epoch & 1). 16-byte stores where the operands allow (the row stride
// N * K a multiple of 4, the inputs 16-byte aligned): a quarter of the remote stores of one per
// entry, which grow with the rank count. A warp writes 512 contiguous bytes into one rank, and
// the ranks are visited starting after mine, so the ranks' first stores go to different peers.
__device__ __forceinline__ void all_gather_routing(const Ctx& c, const int32_t* idx, const float* w,
                                                   int n) {
  const Params& p = c.p;
  const int R = p.num_ranks, NK = p.max_tokens * p.num_topk, me = p.rank;
  const int gtid = blockIdx.x * blockDim.x + threadIdx.x;
  const int gthreads = gridDim.x * blockDim.x;
  const int64_t slot = static_cast<int64_t>((p.epoch & 1) * R + me) * NK;
  const bool vec = NK % 4 == 0 && (reinterpret_cast<uintptr_t>(idx) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(w) & 15) == 0;
  const int units = vec ? n / 4 : 0;
  for (int q = gtid; q < R * units; q += gthreads) {
    const int r = (me + 1 + q / units) % R, u = q % units;
    reinterpret_cast<int4*>(reinterpret_cast<int32_t*>(c.sym(r, p.off_route_idx)) + slot)[u] =
        reinterpret_cast<const int4*>(idx)[u];
    reinterpret_cast<int4*>(reinterpret_cast<float*>(c.sym(r, p.off_route_w)) + slot)[u] =
        reinterpret_cast<const int4*>(w)[u];
  }
  const int rest = n - 4 * units;  // the entries past the last whole unit (all when not vec)
  for (int q = gtid; q < R * rest; q += gthreads) {
    const int r = (me + 1 + q / rest) % R, i = 4 * units + q % rest;
    reinterpret_cast<int32_t*>(c.sym(r, p.off_route_idx))[slot + i] = idx[i];
    reinterpret_cast<float*>(c.sym(r, p.off_route_w))[slot + i] = w[i];
  }
}

// in0: topk_idx [num_tokens, num_topk] int32; in1: topk_weights [num_tokens, num_topk] fp32.
// num_tokens may exceed max_tokens: then nothing is read and every rank reports the count.
// Dynamic shared memory: schedule_smem_bytes(num_experts) (common/schedule.cuh).
__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(const __grid_constant__ Params p) {
  extern __shared__ int32_t smem[];
  const Ctx c(p);
  if (block_aborted(c)) return;
  stamp(p, 0);  // phase stamps (kFlagStamps): entry, routing exchanged, tables, exit
  // NOTE: NK is the stride of a rank's routing in the route buffer (max_tokens rows); every
  // loop over a rank's tokens stops at that rank's own count.
  const int R = p.num_ranks, N = p.max_tokens, K = p.num_topk, E = p.num_experts;
  const int L = p.num_local_experts, me = p.rank, NK = N * K;
  const bool too_many = p.num_tokens > N;
  const int my_nk = too_many ? 0 : p.num_tokens * K;
  const int par = static_cast<int>(p.epoch & 1);
  const int gtid = blockIdx.x * blockDim.x + threadIdx.x;
  const int gthreads = gridDim.x * blockDim.x;
  int32_t* s = p.sched;
  int32_t* meta = c.meta();

  // ---- phase 0: validate and all-gather the routing --------------------------------------
  const int32_t* topk_idx = static_cast<const int32_t*>(p.in0);
  const float* topk_w = static_cast<const float*>(p.in1);
  for (int i = gtid; i < my_nk; i += gthreads) {
    const int32_t e = topk_idx[i];
    int bad = (e < 0 || e >= E) ? kErrBadExpert : kErrNone;
    const int k = i % K;
    for (int q = 0; q < k && !bad; ++q) bad = (topk_idx[i - k + q] == e) ? kErrDuplicateExpert : 0;
    if (bad) {
      // Lowest flat index wins, so every run reports the same entry.
      atomicMin(meta + kMetaBadDetail, i);
      atomicMax(meta + kMetaBadInput, bad);
    }
  }
  all_gather_routing(c, topk_idx, topk_w, my_nk);
  if (!grid_sync(c)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int bad = too_many ? kErrTooManyTokens : meta[kMetaBadInput];
    const int detail = too_many ? p.num_tokens : meta[kMetaBadDetail];
    meta[kMetaBadInput] = 0;
    meta[kMetaBadDetail] = 0x7fffffff;
    for (int r = 0; r < R; ++r) {
      int32_t* st = reinterpret_cast<int32_t*>(c.sym(r, p.off_route_status)) +
                    (par * kMaxRanks + me) * kRouteStatusWords;
      st[kRouteCode] = bad;
      st[kRouteDetail] = detail;
      st[kRouteTokens] = too_many ? 0 : p.num_tokens;
    }
  }
  // NOTE: one signal per rank and epoch (block 0 only): the wait target is the epoch.
  if (blockIdx.x == 0) block_signal_all(c, kSigRoute);
  if (!block_wait_all(c, kSigRoute, static_cast<uint64_t>(p.epoch))) return;
  stamp(p, 1);
  const int32_t* status =
      reinterpret_cast<const int32_t*>(c.sym(me, p.off_route_status)) + par * kMaxRanks * kRouteStatusWords;
  for (int r = 0; r < R; ++r) {
    const int32_t* st = status + r * kRouteStatusWords;
    const int bad = st[kRouteCode];
    if (bad) {
      if (threadIdx.x == 0) {
        const int detail = st[kRouteDetail];
        if (bad == kErrTooManyTokens) {
          record_error(c, bad, 0, r, detail, N, 0);
        } else {
          const int32_t* ri = reinterpret_cast<const int32_t*>(c.sym(me, p.off_route_idx));
          record_error(c, bad, 0, r, ri[(par * R + r) * NK + detail], E, detail);
        }
      }
      return;
    }
  }
  // Tokens of rank r in this call (the status and the routing came with its signal).
  auto tokens_of = [&](int r) { return status[r * kRouteStatusWords + kRouteTokens]; };
  const int32_t* route = reinterpret_cast<const int32_t*>(c.sym(me, p.off_route_idx)) + par * R * NK;
  const float* route_w = reinterpret_cast<const float*>(c.sym(me, p.off_route_w)) + par * R * NK;

  // ---- phase 1: per-chunk histograms ---------------------------------------------------
  int32_t* hist = s + p.o_hist;
  int32_t* dhist = s + p.o_dhist;
  const int C = p.chunk_tokens, NC = p.num_chunks;
  for (int q = blockIdx.x; q < R * NC; q += gridDim.x) {
    const int r = q / NC, ch = q % NC;
    const int t0 = ch * C, t1 = min(tokens_of(r), t0 + C);
    for (int e = threadIdx.x; e < E; e += blockDim.x) smem[e] = 0;
    __shared__ int dedup_rows;
    if (threadIdx.x == 0) dedup_rows = 0;
    __syncthreads();
    for (int i = t0 * K + threadIdx.x; i < t1 * K; i += blockDim.x)
      atomicAdd(smem + route[r * NK + i], 1);
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      bool here = false;
      for (int k = 0; k < K; ++k) here |= route[r * NK + t * K + k] / L == me;
      if (here) atomicAdd(&dedup_rows, 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[(r * NC + ch) * E + e] = smem[e];
    if (threadIdx.x == 0) dhist[r * NC + ch] = dedup_rows;
    __syncthreads();
  }
  if (!grid_sync(c)) return;

  // ---- phase 2: scans over chunks ------------------------------------------------------
  int32_t* counts = s + p.o_counts;
  int32_t* dcount = s + p.o_dcount;
  if (NC < 32) {  // one thread per column ((expert, rank) of hist, then rank of dhist)
    for (int i = gtid; i < E * R + R; i += gthreads) {
      const bool d = i >= E * R;
      const int e = d ? 0 : i / R, r = d ? i - E * R : i % R;
      int run = 0;
      for (int ch = 0; ch < NC; ++ch) {
        int32_t* at = d ? dhist + r * NC + ch : hist + static_cast<int64_t>(r * NC + ch) * E + e;
        const int h = *at;
        *at = run;
        run += h;
      }
      if (d)
        dcount[r] = run;
      else
        counts[e * R + r] = run;
    }
  } else {
    // One warp per column, 32 chunks a step: each lane loads one chunk's count, a warp scan
    // gives the exclusive prefix (integer sums: the same table in any order). One thread per
    // column walking the chunks one after another was a chain of dependent L2 round trips (NC
    // of them: 384 at 24576 tokens); with few chunks (many ranks, few tokens) that chain is
    // short and the columns many, so a thread per column stays.
    const int gwarp = gtid / 32, nwarps = gthreads / 32, lane = threadIdx.x % 32;
    for (int q = gwarp; q < E * R + R; q += nwarps) {
      const bool d = q >= E * R;
      const int e = d ? 0 : q / R, r = d ? q - E * R : q % R;
      int run = 0;
      for (int ch0 = 0; ch0 < NC; ch0 += 32) {
        const int ch = ch0 + lane;
        int32_t* at = d ? dhist + r * NC + ch : hist + static_cast<int64_t>(r * NC + ch) * E + e;
        const int h = ch < NC ? *at : 0;
        int incl = h;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        if (ch < NC) *at = run + incl - h;
        run += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) {
        if (d)
          dcount[r] = run;
        else
          counts[e * R + r] = run;
      }
    }
  }
  if (!grid_sync(c)) return;
  int32_t* offsets = s + p.o_offsets;
  static_assert(kMaxRanks < kScheduleThreads, "block 0 takes one rank per thread, then one more");
  if (blockIdx.x == 0) {
    // Rank d's region starts, for every rank: a block-wide scan of the padded expert sizes in
    // (rank, local expert) order, kScheduleThreads entries a pass, then each rank's start taken
    // off its entries. (One thread per rank summing its experts one after another was a chain
    // of L2 loads, one per local expert: ~20 us at 128 experts on one rank.)
    __shared__ int warp_sum[kScheduleWarps];
    __shared__ int rank_base[kMaxRanks];
    __shared__ int over_at[kMaxRanks];
    __shared__ int lowest_over;
    const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, RL = R * L;
    int carry = 0;  // the padded sizes of the passes before
    for (int f0 = 0; f0 < RL; f0 += kScheduleThreads) {
      const int f = f0 + tid;  // entry (rank f / L, local expert f % L)
      int v = 0;
      if (f < RL) {
        int t = 0;
        for (int r = 0; r < R; ++r) t += counts[f * R + r];
        v = (t + p.row_tile - 1) / p.row_tile * p.row_tile;
      }
      int incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      if (lane == 31) warp_sum[w] = incl;
      __syncthreads();
      int before = carry, pass = 0;
      for (int q = 0; q < kScheduleWarps; ++q) {
        if (q < w) before += warp_sum[q];
        pass += warp_sum[q];
      }
      if (f < RL) offsets[f / L * (L + 1) + f % L + 1] = before + incl;
      carry += pass;
      __syncthreads();  // warp_sum read by every thread before the next pass writes it
    }
    if (tid < R) {
      rank_base[tid] = tid == 0 ? 0 : offsets[(tid - 1) * (L + 1) + L];  // the ranks before
      over_at[tid] = -1;
    }
    if (tid == 0) lowest_over = R;
    __syncthreads();
    for (int f = tid; f < RL; f += kScheduleThreads) offsets[f / L * (L + 1) + f % L + 1] -= rank_base[f / L];
    if (tid < R) offsets[tid * (L + 1)] = 0;
    __syncthreads();
    // Rank d's first expert whose region ends past the capacity (the ends only grow).
    for (int f = tid; f < RL; f += kScheduleThreads) {
      const int at = f / L * (L + 1) + f % L;
      if (offsets[at + 1] > p.capacity && offsets[at] <= p.capacity) {
        over_at[f / L] = f;
        atomicMin(&lowest_over, f / L);
      }
    }
    __syncthreads();
    const int d = tid;
    if (d < R) {
      const int run = offsets[d * (L + 1) + L];
      if (d == me) meta[kMetaNumRows] = run;
      // NOTE: every rank checks every rank's capacity, so all ranks fail the same way instead
      // of one rank stopping and the others timing out; the lowest overflowing rank reports
      // (the first recorded error wins).
      if (over_at[d] >= 0 && d == lowest_over)
        record_error(c, kErrCapacity, 0, d, run, p.capacity, over_at[d]);
    } else if (d == R) {  // the dedup total
      int total = 0;
      for (int r = 0; r < R; ++r) total += dcount[r];
      meta[kMetaNumDedup] = total;
    }
  }
  if (!grid_sync(c)) return;
  stamp(p, 2);

  // ---- phase 3: positions --------------------------------------------------------------
  int32_t* src_rank = s + p.o_src_rank;
  int32_t* src_index = s + p.o_src_index;
  int32_t* fanout = s + p.o_fanout;
  const int32_t* my_off = offsets + me * (L + 1);
  const bool source_order = (p.flags & kFlagSourceOrder) != 0;
  // Padding rows of each local expert region hold -1.
  for (int l = blockIdx.x; l < L; l += gridDim.x) {
    int t = 0;
    for (int r = 0; r < R; ++r) t += counts[(me * L + l) * R + r];
    for (int row = my_off[l] + t + threadIdx.x; row < my_off[l + 1]; row += blockDim.x) {
      src_rank[row] = -1;
      src_index[row] = -1;
      fanout[row] = -1;
    }
  }
  int32_t* dst_rank = s + p.o_dst_rank;
  int32_t* dst_index = s + p.o_dst_index;
  int32_t* d_src_rank = s + p.o_dedup_src_rank;
  int32_t* d_src_token = s + p.o_dedup_src_token;
  int32_t* d_slot = s + p.o_dedup_slot;
  int32_t* fan_rows = s + p.o_fan_rows;
  float* fan_w = reinterpret_cast<float*>(s + p.o_fan_w);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* running = smem + warp * E;
  // The walk takes kT = 32 / K tokens a step, token g of the step on lanes [g K, g K + K) (lane
  // order is the (token, k) order of the sequential walk). Entries of one step that share an
  // expert take their places in lane order; the dedup rows of the step's tokens that have rows
  // here follow in token order. The same tables as one token a step (eight lanes of 32 at top-8,
  // a chain of dependent steps four times as long).
  const int kT = 32 / K;
  const int g = lane / K, kk = lane % K;
  const bool lane_used = g < kT;
  const unsigned group_mask = lane_used ? (K == 32 ? ~0u : ((1u << K) - 1u) << (g * K)) : 0u;
  const unsigned lt_mask = (1u << lane) - 1;
  const unsigned before_token = (1u << (g * K)) - 1;  // the lanes of the step's earlier tokens
  // this warp's routing window: the ids, then the weights, of win_tokens tokens (whole steps)
  int32_t* win_e = smem + kScheduleWarps * E + warp * 2 * kRouteWindow;
  float* win_w = reinterpret_cast<float*>(win_e + kRouteWindow);
  const int win_tokens = kRouteWindow / K / kT * kT;
  for (int q = blockIdx.x * kScheduleWarps + warp; q < R * NC; q += gridDim.x * kScheduleWarps) {
    const int r = q / NC, ch = q % NC;
    const int t0 = ch * C, t1 = min(tokens_of(r), t0 + C);
    for (int e = lane; e < E; e += 32) running[e] = hist[(r * NC + ch) * E + e];
    int drun = dhist[r * NC + ch];
    __syncwarp();
    for (int ts = t0; ts < t1; ts += kT) {
      if ((ts - t0) % win_tokens == 0) {  // the next window of the chunk's routing
        __syncwarp();  // the last window's reads done
        const int n = min(t1 - ts, win_tokens) * K;
        for (int j = lane; j < n; j += 32) {
          win_e[j] = route[r * NK + ts * K + j];
          win_w[j] = route_w[r * NK + ts * K + j];
        }
        __syncwarp();
      }
      const int t = ts + g;
      const bool active = lane_used && t < t1;
      const int wi = (ts - t0) % win_tokens * K + lane;  // this lane's entry in the window
      const int i = t * K + kk;
      const int e = active ? win_e[wi] : 0;
      const int d = e / L;
      // occupancy: this chunk's earlier entries of expert e, the step's lower lanes included
      const unsigned same_e = __match_any_sync(0xffffffffu, active ? e : -1 - lane);
      int occ = 0;
      if (active) occ = running[e] + __popc(same_e & lt_mask);
      __syncwarp();
      if (active && (same_e >> lane) == 1u) running[e] = occ + 1;  // the expert's last lane
      __syncwarp();
      const bool mine_dst = active && d == me;
      const unsigned here_all = __ballot_sync(0xffffffffu, mine_dst);
      if (r != me && here_all == 0) continue;
      const unsigned here = here_all & group_mask;  // my token's entries with rows here
      // NOTE: the sources take turns in each expert region (a minibatch draws rows from every
      // peer) unless kFlagSourceOrder asks for source-major order (the same row order, so the
      // same sums, at any number of ranks).
      const int in_group = source_order ? source_order_pos(counts + e * R, occ, r)
                                        : round_robin_pos(counts + e * R, R, occ, r);
      const int pos = active ? offsets[d * (L + 1) + e % L] + in_group : 0;
      if (mine_dst) {
        src_rank[pos] = r;
        src_index[pos] = i;
      }
      if (active && r == me) {
        dst_rank[i] = d;
        dst_index[i] = pos;
      }
      // Ordinal of this rank among the token's distinct destination ranks (ascending).
      const unsigned same = __match_any_sync(0xffffffffu, active ? g * (kMaxRanks + 1) + d : -1 - lane);
      const bool first = active && (same & lt_mask) == 0;
      const int ordinal = __popc(__ballot_sync(0xffffffffu, first && d < me) & group_mask);
      // The step's tokens with rows here (one bit each, at their first lane), in token order.
      const unsigned tokens_here = __ballot_sync(0xffffffffu, kk == 0 && here != 0);
      if (here != 0) {
        const int dpos = round_robin_pos(dcount, R, drun + __popc(tokens_here & before_token), r);
        const int n_here = __popc(here);
        if (kk == 0) {
          d_src_rank[dpos] = r;
          d_src_token[dpos] = t;
          d_slot[dpos] = t * K + ordinal;
        }
        if (mine_dst) {
          // Fan-out list in k order: the order the dedup combine sums the rows in.
          const int j = __popc(here & lt_mask);
          fan_rows[dpos * K + j] = pos;
          fan_w[dpos * K + j] = win_w[wi];
          fanout[pos] = dpos;
        }
        if (kk == n_here && n_here < K) fan_rows[dpos * K + n_here] = -1;
      }
      drun += __popc(tokens_here);
    }
    __syncwarp();
  }
  __syncthreads();  // every warp's walk done before the block's exit stamp
  stamp(p, 3);
}

}  // namespace mok
