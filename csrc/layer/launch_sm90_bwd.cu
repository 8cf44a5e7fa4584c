// Host launcher of the experts' backward kernels for Hopper (sm_90a): TMA tensor maps of the
// operands and one launch. Includes only CUDA and csrc/ headers, so it compiles without torch.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "api.h"
#include "common/launch.cuh"
#include "common/tensor_map.h"
#include "layer/sm90_bwd.cuh"
#include "layer/sm90_bwd_fused.cuh"

namespace mok {

namespace {

template <int kMode, bool kGather = false>
int launch_swiglu_mode(const SwigluBwdKernelArgs& k, int grid, cudaStream_t stream) {
  return launch_with_smem(swiglu_bwd_kernel<kMode, kGather>, k, grid, kLayerThreads,
                          BwdPipe<kMode>::kSmem, stream);
}

}  // namespace

int launch_swiglu_bwd(const SwigluBwdLaunch& l, int grid, void* stream_ptr) {
  if (const int arch = require_sm90()) return arch;
  const int64_t H = l.hidden, I = l.inter, L = l.num_experts;
  if (l.rows <= 0 || H <= 0 || H % OperandBf16::kTileK != 0 || I <= 0 || I % 128 != 0 ||
      L < 1 || L > kBwdMaxExperts || grid < 1 || l.rows > INT32_MAX / 2 ||
      L * 2 * I > INT32_MAX || L * H > INT32_MAX || l.mode < kSwigluRecompute ||
      l.mode > kSwigluSaved || (l.mode == kSwigluSaved && l.gu32 == nullptr) ||
      l.next_tile == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  // gathered rows: x for gate / up (modes 0 and 1), dy for dh (modes 0 and 2; mode 2 needs it)
  const bool gather_x = l.gather_x != nullptr, gather_dy = l.gather_dy != nullptr;
  const bool gather = gather_x || gather_dy;
  if (gather &&
      ((l.mode == kSwigluSave && (!gather_x || gather_dy)) ||
       (l.mode == kSwigluSaved && (gather_x || !gather_dy)) ||
       (l.mode == kSwigluRecompute && !gather_x) || l.gather_src == nullptr ||
       l.gather_topk < 1 || l.gather_tokens < 1 || l.gather_tokens * l.gather_topk > INT32_MAX))
    return static_cast<int>(cudaErrorInvalidValue);
  SwigluBwdKernelArgs k{};
  constexpr int kK = OperandBf16::kTileK;
  // The operands of the k-loops this mode runs: gate/up (x rows, w_gate_up), dh (dy, w_down).
  const bool gate_up = l.mode != kSwigluSaved, down = l.mode != kSwigluSave;
  if ((gate_up && ((!gather_x && !encode_bf16_map(&k.map_a, l.a, l.rows, H, kTileM, kK)) ||
                   !encode_bf16_map(&k.map_w, l.w_gate_up, L * 2 * I, H, 128, kK))) ||
      (down && ((!gather_dy && !encode_bf16_map(&k.map_dy, l.dy, l.rows, H, kTileM, kK)) ||
                !encode_bf16_map(&k.map_wd, l.w_down, L * H, I, kK, 64))) ||
      (l.mode == kSwigluSave &&
       (!encode_bf16_map(&k.map_h_st, l.hw, l.rows, I, kEpiStoreRows, kEpiCols,
                         CU_TENSOR_MAP_SWIZZLE_64B) ||
        (l.gu32 != nullptr &&
         !encode_f32_map(&k.map_gu_st, l.gu32, l.rows, 2 * I, kEpiStoreRows, kEpiCols)))))
    return static_cast<int>(cudaErrorInvalidValue);
  k.ends = l.ends;
  k.row_w = l.row_w;
  k.hw = static_cast<uint16_t*>(l.hw);
  k.dgu = static_cast<uint16_t*>(l.dgu);
  k.part = l.part;
  k.gu32 = l.gu32;
  k.next_tile = l.next_tile;
  k.gather_x = static_cast<const uint16_t*>(l.gather_x);
  k.gather_dy = static_cast<const uint16_t*>(l.gather_dy);
  k.gather_src = l.gather_src;
  k.gather_topk = static_cast<int>(l.gather_topk);
  k.rows = static_cast<int>(l.rows);
  k.hidden = static_cast<int>(H);
  k.inter = static_cast<int>(I);
  k.num_experts = static_cast<int>(L);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const cudaError_t z = cudaMemsetAsync(l.next_tile, 0, sizeof(int32_t), stream);
  if (z != cudaSuccess) return finish_launch(z);
  switch (l.mode) {
    case kSwigluSave:
      if (gather) return launch_swiglu_mode<kSwigluSave, true>(k, grid, stream);
      return launch_swiglu_mode<kSwigluSave>(k, grid, stream);
    case kSwigluSaved:
      if (I % 256 == 0) {
        if (gather) return launch_swiglu_mode<kSwigluSavedWide, true>(k, grid, stream);
        return launch_swiglu_mode<kSwigluSavedWide>(k, grid, stream);
      }
      if (gather) return launch_swiglu_mode<kSwigluSaved, true>(k, grid, stream);
      return launch_swiglu_mode<kSwigluSaved>(k, grid, stream);
    default:
      if (gather) return launch_swiglu_mode<kSwigluRecompute, true>(k, grid, stream);
      return launch_swiglu_mode<kSwigluRecompute>(k, grid, stream);
  }
}

namespace {

template <int kValue>
using IntC = std::integral_constant<int, kValue>;
template <bool kValue>
using BoolC = std::integral_constant<bool, kValue>;

// Calls f with the weight gradient's output kind (kWgradBf16, kWgradF32, kWgradF32Add) as a
// compile-time constant: the one place the kinds meet the kernels' template arguments.
template <typename F>
int with_out_kind(int64_t out, F&& f) {
  if (out == kWgradF32) return f(IntC<kWgradF32>{});
  if (out == kWgradF32Add) return f(IntC<kWgradF32Add>{});
  return f(IntC<kWgradBf16>{});
}

// Calls f with `on` as a compile-time constant.
template <typename F>
int with_flag(bool on, F&& f) {
  return on ? f(BoolC<true>{}) : f(BoolC<false>{});
}

}  // namespace

int launch_wgrad(const WgradLaunch& l, int grid, void* stream_ptr) {
  if (const int arch = require_sm90()) return arch;
  const int64_t M = l.m, N = l.n, L = l.num_experts;
  // transposed: C^T [L * N, M] stored (its rows index the kernel's N)
  const bool tr = l.transposed == 1;
  if (l.rows <= 0 || M <= 0 || M % kTileM != 0 || N <= 0 || N % kTileN != 0 || L < 1 ||
      grid < 1 || l.rows > INT32_MAX || L * M > INT32_MAX || l.out < kWgradBf16 ||
      l.out > kWgradF32Add || (l.transposed != 0 && !tr) || (tr && L * N > INT32_MAX))
    return static_cast<int>(cudaErrorInvalidValue);
  const bool gather = l.gather_rows != nullptr;
  const int64_t g_op = gather ? l.gather_operand : -1;
  if (gather && ((g_op != 0 && g_op != 1) || (tr && g_op != 0) || l.gather_src == nullptr ||
                 l.gather_topk < 1 || l.gather_tokens < 1 ||
                 l.gather_tokens * l.gather_topk > INT32_MAX))
    return static_cast<int>(cudaErrorInvalidValue);
  WgradKernelArgs k{};
  const int64_t c_rows = tr ? L * N : L * M, c_cols = tr ? M : N;
  if ((g_op != 0 && !encode_bf16_map(&k.map_a, l.a, l.rows, M, 64, 64)) ||
      (g_op != 1 && !encode_bf16_map(&k.map_b, l.b, l.rows, N, 64, 64)) ||
      !(l.out == kWgradBf16 ? encode_bf16_map(&k.map_c, l.c, c_rows, c_cols, 64, 64)
                            : encode_f32_map(&k.map_c, l.c, c_rows, c_cols, 64, 32)))
    return static_cast<int>(cudaErrorInvalidValue);
  k.ends = l.ends;
  k.m = static_cast<int>(M);
  k.n = static_cast<int>(N);
  k.num_experts = static_cast<int>(L);
  const int64_t tiles = L * (M / kTileM) * (N / kTileN);
  if (tiles < grid) grid = static_cast<int>(tiles);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (gather) {
    WgradGatherKernelArgs a{};
    a.k = k;
    a.g.rows = static_cast<const uint16_t*>(l.gather_rows);
    a.g.src = l.gather_src;
    a.g.topk = static_cast<int>(l.gather_topk);
    a.g.cols = static_cast<int>(g_op == 0 ? M : N);
    // the gathered operand (0: A, 1: B) and the layout; the transposed form gathers only A
    const auto go = [&](auto op, auto t) {
      return with_out_kind(l.out, [&](auto o) {
        return launch_with_smem(
            wgrad_gather_kernel<decltype(o)::value, decltype(op)::value, decltype(t)::value>, a,
            grid, kLayerThreads, kWgradSmem, stream);
      });
    };
    if (tr) return go(IntC<0>{}, BoolC<true>{});
    return g_op == 0 ? go(IntC<0>{}, BoolC<false>{}) : go(IntC<1>{}, BoolC<false>{});
  }
  return with_flag(tr, [&](auto t) {
    return with_out_kind(l.out, [&](auto o) {
      return launch_with_smem(wgrad_kernel<decltype(o)::value, decltype(t)::value>, k, grid,
                              kLayerThreads, kWgradSmem, stream);
    });
  });
}

namespace {

// Row tiles a launch of `rows` rows in `num_experts` groups can have (each group's last tile may
// be partial): the length of the per-row-tile counters.
int64_t max_row_tiles(int64_t rows, int64_t num_experts) {
  return (rows + kTileM - 1) / kTileM + num_experts;
}

}  // namespace

int64_t bwd_fused_counters(int64_t rows, int64_t num_experts) {
  return 1 + 2 * max_row_tiles(rows, num_experts) + num_experts + 2;
}

int launch_bwd_fused(const Params& p, const FusedBwdLaunch& l, int grid, void* stream_ptr) {
  if (const int arch = require_sm90()) return arch;
  const SwigluBwdLaunch& d = l.dh;
  const int64_t H = d.hidden, I = d.inter, L = d.num_experts, R = d.rows;
  const int64_t n_counters = bwd_fused_counters(R, L);
  if (R <= 0 || H <= 0 || H % 256 != 0 || I <= 0 || I % 256 != 0 || L < 1 ||
      L > kBwdMaxExperts || grid < 1 || R > INT32_MAX / 2 || L * 2 * I > INT32_MAX ||
      L * H > INT32_MAX || l.counters == nullptr || l.counters_len < n_counters ||
      l.wgrad_out < kWgradBf16 || l.wgrad_out > kWgradF32Add || l.run < 1 || l.run > kBwdRunAll ||
      l.wgu_transposed < 0 || l.wgu_transposed > 1)
    return static_cast<int>(cudaErrorInvalidValue);
  const bool xfer = l.row_src != nullptr;
  // With peers a rank without tokens takes part (its experts get the peers' rows).
  const bool tokens = l.num_tokens > 0;
  if (xfer && (l.run != kBwdRunAll || (tokens && (l.grad_out == nullptr || l.x == nullptr ||
                                                  l.dx == nullptr)) ||
               (!l.peers && (l.slots == nullptr || !tokens)) || d.dy == nullptr ||
               d.a == nullptr || l.num_tokens < 0 || l.num_tokens > INT32_MAX / 32 ||
               l.num_topk < 1 || l.num_topk > kMaxTopk || l.copy_ahead < 1))
    return static_cast<int>(cudaErrorInvalidValue);
  if (l.peers && (!xfer || l.dedup != 0 || p.num_ranks < 1 || p.num_ranks > kMaxRanks ||
                  p.rank < 0 || p.rank >= p.num_ranks || p.sched == nullptr ||
                  l.num_tokens > p.max_tokens || p.hidden != H || p.row_bytes != 2 * H ||
                  l.off_dy <= 0 || l.off_row_grads <= 0 || p.epoch < 1))
    return static_cast<int>(cudaErrorInvalidValue);
  FusedBwdKernelArgs k{};
  k.p = p;
  constexpr int kK = OperandBf16::kTileK;
  SwigluBwdKernelArgs& b = k.dh;
  const bool f32 = l.wgrad_out != kWgradBf16;
  // The operands of the task kinds this launch runs: dh (dy rows, w_down N-major; g / u in, hw
  // / dgu out by TMA), d_a
  // (dgu rows, w_gate_up N-major), the weight gradients (64-row boxes of both operands, C by TMA
  // stores).
  bool ok = true;
  if (l.run & kBwdRunDh)
    ok = d.gu32 != nullptr && encode_bf16_map(&b.map_dy, d.dy, R, H, kTileM, kK) &&
         encode_bf16_map(&b.map_wd, d.w_down, L * H, I, kK, 64) &&
         encode_f32_map(&k.map_gu, d.gu32, R, 2 * I, kTileM, kEpiCols) &&
         encode_bf16_map(&b.map_h_st, d.hw, R, I, kEpiStoreRows, kEpiCols,
                         CU_TENSOR_MAP_SWIZZLE_64B) &&
         encode_bf16_map(&k.map_dgu_st, d.dgu, R, 2 * I, kEpiStoreRows, kEpiCols,
                         CU_TENSOR_MAP_SWIZZLE_64B);
  if (ok && (l.run & kBwdRunDa))
    ok = (xfer || l.d_a != nullptr) && encode_bf16_map(&k.map_dgu, d.dgu, R, 2 * I, kTileM, kK) &&
         encode_bf16_map(&k.map_wgu, d.w_gate_up, L * 2 * I, H, kK, 64);
  // d_a's staged epilogue (without transfers): its TMA store map
  k.da_staged = l.da_staged != 0 && !xfer && (l.run & kBwdRunDa);
  if (ok && k.da_staged) ok = encode_bf16_map(&k.map_da_st, l.d_a, R, H, kEpiStoreRows, 64);
  // dW_gate_up as a^T dgu stored transposed: a is its A, dgu its B; C^T's map [L * 2I, H] is the
  // map of C = dgu^T a
  const bool wgu_t = l.wgu_transposed != 0 && (l.run & kBwdRunWgrad);
  if (ok && (l.run & kBwdRunWgrad)) {
    ok = encode_bf16_map(&k.wgrad[0].map_a, wgu_t ? d.a : d.dgu, R, wgu_t ? H : 2 * I, 64, 64) &&
         encode_bf16_map(&k.wgrad[0].map_b, wgu_t ? d.dgu : d.a, R, wgu_t ? 2 * I : H, 64, 64) &&
         encode_bf16_map(&k.wgrad[1].map_a, d.dy, R, H, 64, 64) &&
         encode_bf16_map(&k.wgrad[1].map_b, d.hw, R, I, 64, 64);
    if (ok && !f32)
      ok = encode_bf16_map(&k.wgrad[0].map_c, l.d_w_gate_up, L * 2 * I, H, 64, 64) &&
           encode_bf16_map(&k.wgrad[1].map_c, l.d_w_down, L * H, I, 64, 64);
    if (ok && f32)
      ok = encode_f32_map(&k.wgrad[0].map_c, l.d_w_gate_up, L * 2 * I, H, 64, 32) &&
           encode_f32_map(&k.wgrad[1].map_c, l.d_w_down, L * H, I, 64, 32);
  }
  if (!ok) return static_cast<int>(cudaErrorInvalidValue);
  b.ends = d.ends;
  b.row_w = d.row_w;
  b.hw = static_cast<uint16_t*>(d.hw);
  b.dgu = static_cast<uint16_t*>(d.dgu);
  b.part = d.part;
  b.gu32 = d.gu32;
  b.rows = static_cast<int>(R);
  b.hidden = static_cast<int>(H);
  b.inter = static_cast<int>(I);
  b.num_experts = static_cast<int>(L);
  k.d_a = static_cast<uint16_t*>(l.d_a);
  if (xfer) {
    BwdTransfers& x = k.xfer;
    x.grad_out = static_cast<const uint16_t*>(l.grad_out);
    x.x = static_cast<const uint16_t*>(l.x);
    x.row_src = l.row_src;
    // NOTE: with the transfers dh.dy and dh.a are outputs too (api.h): the copies write them
    x.dy_rows = static_cast<uint16_t*>(const_cast<void*>(d.dy));
    x.a_rows = static_cast<uint16_t*>(const_cast<void*>(d.a));
    x.slots = static_cast<uint16_t*>(l.slots);
    x.dx_shared = l.dx_shared;
    x.dx = static_cast<uint16_t*>(l.dx);
    x.num_tokens = static_cast<int>(l.num_tokens);
    x.num_topk = static_cast<int>(l.num_topk);
    x.dedup = l.dedup != 0;
    x.copy_ahead = static_cast<int>(l.copy_ahead);
    if (l.peers) {
      x.row_rank = p.sched + p.o_src_rank;
      x.off_dy = l.off_dy;
      x.off_row_grads = l.off_row_grads;
      x.slots = reinterpret_cast<uint16_t*>(p.sym_base[p.rank] + p.off_slots);
    }
  }
  k.wgrad[0].ends = k.wgrad[1].ends = d.ends;
  k.wgrad[0].m = static_cast<int>(wgu_t ? H : 2 * I);
  k.wgrad[0].n = static_cast<int>(wgu_t ? 2 * I : H);
  k.wgrad[1].m = static_cast<int>(H), k.wgrad[1].n = static_cast<int>(I);
  k.wgrad[0].num_experts = k.wgrad[1].num_experts = static_cast<int>(L);
  k.counters = l.counters;
  k.max_row_tiles = static_cast<int>(max_row_tiles(R, L));
  k.run = static_cast<int>(l.run);
  k.fault = l.fault;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const cudaError_t z =
      cudaMemsetAsync(l.counters, 0, sizeof(uint32_t) * n_counters, stream);
  if (z != cudaSuccess) return finish_launch(z);
  return with_flag(wgu_t, [&](auto t) {
    return with_out_kind(l.wgrad_out, [&](auto o) {
      return launch_with_smem(bwd_fused_kernel<decltype(o)::value, decltype(t)::value>, k, grid,
                              kLayerThreads, kFusedSmem, stream);
    });
  });
}

}  // namespace mok
