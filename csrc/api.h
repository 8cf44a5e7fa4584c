// Host entry points of the CUDA side, called by the torch bindings. No torch types here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "params.h"

namespace mok {

// Launches kernel `kind` (mok::Kernel) with `grid` blocks on `stream` (a cudaStream_t).
// Returns a cudaError_t value (0 on success).
int launch(int kind, const Params& params, int grid, void* stream);

// Launches the fused layer forward (layer/sm90_fwd.cuh) with `grid` blocks (one per SM) on
// `stream`.
// Returns a cudaError_t value (cudaErrorInvalidValue when a TMA descriptor cannot be built).
int launch_layer(const Params& params, const LayerArgs& args, int grid, void* stream);

// Dynamic shared memory of the fused layer per block, and its counter words for `params`.
int layer_smem_bytes();
int layer_counters(const Params& params);

// The experts' backward: the down dgrad and the gate/up recompute with the SwiGLU backward
// (layer/sm90_bwd.cuh): raw device pointers of bf16 a [rows, H], dy [rows, H], w_gate_up
// [L, 2I, H], w_down [L, H, I], hw [rows, I] (h x the row's weight), dgu [rows, 2I], int32
// group ends [L], fp32 row_w [rows] and part [I / 128, rows] (both may be null).
struct SwigluBwdLaunch {
  const void* a;
  const void* dy;
  const void* w_gate_up;
  const void* w_down;
  const int32_t* ends;
  const float* row_w;
  void* hw;
  void* dgu;
  float* part;
  // fp32 [rows, 2I] g | u: written by mode 1 (a forward that saves them: the gate/up GEMM only,
  // h = bf16(silu(g) u) into hw; null: h only), read by mode 2 (the backward from them: the dh
  // GEMM only); mode 0 recomputes them and needs none.
  float* gu32;
  // One int32 of device memory the launch uses to hand out tiles (the launcher zeroes it on the
  // stream before the kernel runs; one per launch in flight).
  int32_t* next_tile;
  // Modes 0 and 1: the gate / up GEMM's rows gathered from the tokens instead of read from `a`
  // (null: from `a`, which is then unused by the gate / up GEMM): bf16 [gather_tokens, hidden]
  // tokens and, per row, gather_src = token * gather_topk + k, or -1 for a padding row (zeros).
  const void* gather_x;
  // Modes 0 and 2: the dh GEMM's dy rows gathered from bf16 [gather_tokens, hidden] gather_dy
  // (null: from `dy`; mode 0 gathers them only with gather_x, mode 2 only these).
  const void* gather_dy;
  const int32_t* gather_src;
  int64_t gather_tokens, gather_topk;
  int64_t mode;
  int64_t rows, hidden, inter, num_experts;
};

// Launches it with `grid` blocks on `stream`. Returns a cudaError_t value
// (cudaErrorInvalidValue for a shape it does not support or a TMA descriptor it cannot build).
int launch_swiglu_bwd(const SwigluBwdLaunch& args, int grid, void* stream);

// The experts' weight gradients C[e] = A[e]^T B[e] (layer/sm90_bwd.cuh wgrad_kernel): raw
// device pointers of bf16 A [rows, m], B [rows, n], C [num_experts, m, n] (transposed:
// [num_experts, n, m]) and the int32 group ends [num_experts] (multiples of 16); m a multiple of
// 128, n of 256.
struct WgradLaunch {
  const void* a;
  const void* b;
  const int32_t* ends;
  void* c;
  int64_t rows, m, n, num_experts;
  // 0: C bf16; 1: C fp32; 2: fp32, added onto what C holds (WgradOut in layer/sm90_bwd.cuh).
  int64_t out;
  // Operand gather_operand (0: A, 1: B) gathered instead of read from a / b (which may then be
  // null): receive row r is row gather_src[r] / gather_topk of bf16 [gather_tokens, m or n]
  // gather_rows (-1: a padding row, zeros). gather_rows null: no gather.
  const void* gather_rows;
  const int32_t* gather_src;
  int64_t gather_tokens, gather_topk, gather_operand;
  // 1: C^T stored, C [num_experts, n, m] (the same sums; dW_gate_up computed as x^T dgu, stored
  // in the weight's [L, 2I, H] layout); with a gather only of operand 0. 0: C as above.
  int64_t transposed;
};

// Launches it with at most `grid` blocks on `stream`. Returns a cudaError_t value
// (cudaErrorInvalidValue for a shape it does not support or a TMA descriptor it cannot build).
int launch_wgrad(const WgradLaunch& args, int grid, void* stream);

// The experts' backward from saved g / u in one launch (layer/sm90_bwd_fused.cuh): the
// operands of SwigluBwdLaunch (its mode unused; its a [rows, H] the input of the weight
// gradient dW_gate_up = dgu^T a) plus d_a [rows, H] bf16 out (dgu @ w_gate_up), d_w_gate_up
// [L, 2I, H] and d_w_down [L, H, I] (bf16, or fp32 added onto: wgrad_out as WgradLaunch's out),
// and uint32 counters of counters_len >= bwd_fused_counters(rows, L) words (zeroed by the
// launcher). I and H multiples of 256, group ends multiples of 16. Params carries the error
// record, the abort word and the timeout of the cross-block waits.
struct FusedBwdLaunch {
  SwigluBwdLaunch dh;
  // The token transfers (one rank), all null without them: the launch copies each receive row's
  // grad_out / x row [num_tokens, H] (row_src [rows]: token * num_topk + k, -1 for a row without
  // a token) into dh.dy / dh.a, stores d_a by (token, k) into slots [num_tokens * num_topk, H]
  // instead of d_a, and sums them in k order onto dx_shared (fp32 [num_tokens, H], or null)
  // into dx [num_tokens, H] bf16 (dedup: as the dedup combine sums, a bf16 partial of the k
  // rows first). It then needs every task kind (run). copy_ahead (>= 1): the experts whose row
  // copies are handed out ahead of their dh tiles.
  const void* grad_out;
  const void* x;
  const int32_t* row_src;
  void* slots;
  const float* dx_shared;
  void* dx;
  int64_t num_tokens, num_topk, dedup, copy_ahead;
  // With peers (a workspace of several ranks in Params; dedup 0): the rows come from their
  // source ranks (Params' schedule src_rank, row_src the token * num_topk + k there) through
  // symmetric staging regions (x at Params::off_x, grad_out at off_dy, [max_tokens, H] each),
  // d_a goes into the source rank's slots (Params::off_slots; `slots` unused), and each
  // receive row's router-weight gradient (the partials summed in column order) into this
  // rank's symmetric [capacity] fp32 region at off_row_grads; Params::epoch is the call's
  // epoch of the backward's signals. num_tokens may be 0.
  int64_t peers, off_dy, off_row_grads;
  void* d_a;
  void* d_w_gate_up;
  void* d_w_down;
  uint32_t* counters;
  int64_t counters_len;
  int64_t wgrad_out;
  int64_t run;    // the task kinds (BwdRun in layer/sm90_bwd_fused.cuh)
  // 1: without transfers, d_a's epilogue is staged in shared memory and stored by TMA (the
  // same values); 0: each thread stores its words to d_a.
  int64_t da_staged;
  int64_t fault;  // tests only: the dh task that never reports done (-1: none)
  // 1: d_w_gate_up's tiles computed as dh.a^T dgu (the rows as the 128-column operand) and
  // stored transposed (WgradLaunch::transposed), in the same [L, 2I, H] layout; 0: dgu^T a.
  int64_t wgu_transposed;
};

// The counter words a launch of `rows` rows in `num_experts` groups needs: the next task, one
// per row tile and one per expert (dh tiles done), one per row tile (copied), one (d_a done) and
// one (staging tasks done).
int64_t bwd_fused_counters(int64_t rows, int64_t num_experts);

// Launches it with at most `grid` blocks on `stream`. Returns a cudaError_t value.
int launch_bwd_fused(const Params& params, const FusedBwdLaunch& args, int grid, void* stream);

// Device address of host-pinned memory (for the error record).
uint64_t host_device_pointer(void* host_ptr, int* err);

// Human-readable name of a CUDA error code.
const char* error_string(int err);

}  // namespace mok
