// Kernel parameters shared by the CUDA launchers (comm/launch.cu, layer/launch_sm90.cu) and the
// torch bindings (torch/bindings.cpp). Plain C++ only: mok/_ext.py mirrors this struct with
// ctypes, so any change here must be made there too (the bindings check the size on every
// launch).
#pragma once

#include <cstdint>

namespace mok {

constexpr int kMaxRanks = 72;   // one NVLink domain: an NVL72 rack (8 for Hopper HGX boxes)
constexpr int kMaxTopk = 32;    // one warp lane per (token, k) in the schedule walk
constexpr int kNumSignals = 20;

// Symmetric signal pad: sig[kind][peer] on rank d counts events that `peer` caused on d.
enum Signal : int {
  kSigRoute = 0,        // peer wrote its routing into my route buffer
  kSigXReady = 1,       // peer's x buffer holds this epoch's tokens
  kSigXConsumed = 2,    // peer finished reading my x buffer (its last block stores the epoch)
  kSigRecvFree = 3,     // peer's receive buffer may be pushed into
  kSigRecvFilled = 4,   // peer finished pushing into my receive buffer (epoch, last block)
  kSigSlotsFree = 5,    // peer's combine slots may be pushed into
  kSigSlotsFilled = 6,  // peer finished pushing into my combine slots (epoch, last block)
  kSigYReady = 7,       // peer's expert-output buffer holds this epoch's rows
  kSigYConsumed = 8,    // peer finished reading my expert-output buffer (epoch, last block)
  kSigPartReady = 9,    // peer's dedup partials buffer holds epoch <value> (stored, not added)
  kSigPartConsumed = 10,  // peer finished reading my partials of epoch <value> (stored)
  // The fused layer (layer/sm90_fwd.cuh) counts its own epochs, so it has its own signals.
  kSigLayerXReady = 11,      // peer's x buffer holds this layer call's tokens (once per call)
  kSigLayerXConsumed = 12,   // peer finished reading my x buffer (epoch x communication blocks)
  kSigLayerSlotsFree = 13,   // peer's combine slots may be pushed into (once per call)
  kSigLayerSlotsFilled = 14, // peer finished pushing into my combine slots (epoch, last block)
  // The fused backward with peers (layer/sm90_bwd_fused.cuh): stored epochs of its own family.
  kSigBwdStaged = 15,       // peer's x / dy staging regions hold this call's rows
  kSigBwdSlotsFree = 16,    // peer's slots may be pushed into (raised at its launch's start)
  kSigBwdSlotsFilled = 17,  // peer pushed every d_a row into its home slots (and finished
                            // reading my staged rows, and staged its router-weight gradients)
};

// Waits on local counters (signal waits use the Signal value as their id).
enum WaitId : int {
  kWaitGridBarrier = 100,
  kWaitLayerReady = 101,     // a GEMM tile waits for its minibatch's dispatched rows
  kWaitLayerGateUp = 102,    // a down tile waits for the gate/up tiles of its row block
  kWaitLayerRecvFree = 103,  // dispatch waits for the gate/up tiles that read its ring rows
  kWaitLayerHFree = 104,     // a gate/up tile waits for the down tiles that read its h rows
  kWaitLayerStaged = 105,    // communication blocks wait for each other's staging of x
  kWaitLayerPulled = 106,    // communication blocks wait for each other's dedup rows
  kWaitLayerPipeline = 107,  // a worker's TMA / MMA pipeline stage (a local deadlock)
  kWaitBwdDgrad = 108,       // a fused-backward task waits for the dh tiles it reads
  kWaitBwdCopy = 109,        // a fused-backward dh tile waits for its rows' copy
  kWaitBwdDa = 110,          // a fused-backward sum waits for every d_a tile
  kWaitBwdStaged = 111,      // the fused backward's publish waits for its staging tasks
};

enum ErrorCode : int {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrCapacity = 2,
  kErrBadExpert = 3,
  kErrDuplicateExpert = 4,
  kErrUnsupported = 5,  // the kernel was built without a path for this GPU
  kErrTooManyTokens = 6,  // a rank passed more tokens than the workspace holds
  kErrFault = 7,          // a fault injected for a test (kFlagFault)
};

// Words per (parity, rank) of the routing status every rank publishes with its routing:
// input error code, its detail (flat index of the first bad entry, or the token count), and
// the rank's token count in this call.
enum RouteStatus : int {
  kRouteCode = 0,
  kRouteDetail = 1,
  kRouteTokens = 2,
  kRouteStatusWords = 4,
};

// Fields of the host-visible error record (int64 each).
enum ErrorField : int {
  kErrFieldCode = 0,
  kErrFieldWait = 1,
  kErrFieldPeer = 2,
  kErrFieldObserved = 3,
  kErrFieldExpected = 4,
  kErrFieldRank = 5,
  kErrFieldEpoch = 6,
  kErrFieldExtra = 7,
  kErrFieldCount = 8,
};

// Words of the local meta area (int32) inside the schedule storage.
enum Meta : int {
  kMetaNumRows = 0,     // P: padded receive rows on this rank
  kMetaNumDedup = 1,    // D: dedup rows on this rank
  kMetaAbort = 2,       // sticky: a kernel of this workspace failed; later kernels return at once
  kMetaErrClaim = 3,    // first failing thread owns the error record
  kMetaBarCount = 4,    // grid barrier arrivals
  kMetaBarGen = 5,      // grid barrier generation
  kMetaBadInput = 6,    // routing error found in this schedule build (code)
  kMetaBadDetail = 7,   // flat (token * num_topk + k) index of the first bad entry
  kMetaLastCount = 8,   // blocks done in the running launch (last_block)
  kMetaWords = 16,
};

enum Kernel : int {
  kKernelSchedule = 0,
  kKernelDispatchPull = 1,
  kKernelDispatchDedupPull = 2,
  kKernelDispatchPush = 3,
  kKernelCombinePush = 4,
  kKernelCombineDedupPush = 5,
  kKernelCombinePull = 6,
  kKernelFanout = 7,
  kKernelDedupPartials = 8,
  kKernelDedupSum = 9,
  kKernelWaitXFree = 10,
  kKernelZeroPadding = 11,
};

enum Flags : int {
  kFlagStage = 1,          // copy in0 into the symmetric buffer first (x for pull, y for pull)
  kFlagSharedFp32 = 2,     // shared_y is fp32 (else bf16)
  kFlagHasShared = 4,
  kFlagVector = 8,         // row copies with 16-byte vector loads/stores instead of bulk copies
  kFlagNoFanout = 16,      // dedup dispatch: out0 is the dedup buffer, one row per dedup row
  kFlagSkipLocal = 32,     // dedup buffer without this rank's own rows (they stay in x)
  kFlagGather = 64,        // dedup_sum: cp.async gather ring (many loads in flight per warp)
  kFlagDedup = 128,        // fused layer: dedup pull (one NVLink row per token and rank)
  kFlagStamps = 256,       // dedup_pull dispatch, dedup_sum, schedule: in3 = phase stamps
  kFlagFault = 512,        // fused layer, tests only: the worker that claims tile (int)in3 fails
  kFlagKeep = 1024,        // dedup_sum: keep the partials (no "consumed" signal: more sums follow)
  kFlagSourceOrder = 2048,  // schedule: an expert's rows by source rank, then token (not in turns)
};

struct Params {
  // Shapes (identical on every rank, except num_tokens).
  int32_t rank;
  int32_t num_ranks;
  // NOTE: this rank's tokens in this call (0..max_tokens, may differ between ranks: the
  // schedule all-gathers every rank's count with its routing). Buffers indexed by token are
  // laid out for max_tokens rows per rank (the workspace's size; the last field).
  int32_t num_tokens;
  int32_t num_topk;
  int32_t num_experts;
  int32_t num_local_experts;
  int32_t row_tile;
  int32_t capacity;  // receive rows per rank (padding included)
  int32_t chunk_tokens;
  int32_t num_chunks;
  int32_t minibatch_rows;
  int32_t num_minibatches;
  int32_t hidden;
  int32_t flags;
  int64_t row_bytes;  // bytes of one dispatched row (multiple of 16)
  int64_t epoch;      // this op family's call count, starting at 1
  uint64_t timeout_ns;
  // Symmetric memory: base address of each rank's allocation and byte offsets inside it.
  uint64_t sym_base[kMaxRanks];
  int64_t off_signals;       // uint64 [kNumSignals][kMaxRanks]
  int64_t off_route_status;  // int32 [2][kMaxRanks][kRouteStatusWords]
  int64_t off_route_idx;     // int32 [2][num_ranks][max_tokens * num_topk]
  int64_t off_route_w;       // fp32  [2][num_ranks][max_tokens * num_topk]
  int64_t off_x;             // [max_tokens][row_bytes]
  int64_t off_recv;          // [capacity][row_bytes]
  int64_t off_slots;         // bf16 [max_tokens * num_topk][hidden]
  int64_t off_y;             // bf16 [capacity][hidden]
  int64_t off_partials;      // bf16 [partials_rows(p)][hidden], a row per dedup row, then int32
                             // [max_tokens * num_topk] (comm/combine.cuh: partials_index)
  // Local schedule storage (int32) and element offsets inside it.
  int32_t* sched;
  int64_t o_counts;           // [num_experts][num_ranks] (M, all experts)
  int64_t o_offsets;          // [num_ranks][num_local_experts + 1] (S of every rank)
  int64_t o_src_rank;         // [capacity]
  int64_t o_src_index;        // [capacity]
  int64_t o_dst_rank;         // [max_tokens * num_topk]
  int64_t o_dst_index;        // [max_tokens * num_topk]
  int64_t o_dedup_src_rank;   // [num_ranks * max_tokens]
  int64_t o_dedup_src_token;  // [num_ranks * max_tokens]
  int64_t o_dedup_slot;       // [num_ranks * max_tokens]
  int64_t o_fanout;           // [capacity]
  int64_t o_fan_rows;         // [num_ranks * max_tokens][num_topk], -1 terminated
  int64_t o_fan_w;            // fp32 bits [num_ranks * max_tokens][num_topk]
  int64_t o_hist;             // [num_ranks][num_chunks][num_experts]
  int64_t o_dhist;            // [num_ranks][num_chunks]
  int64_t o_dcount;           // [num_ranks]
  int64_t o_meta;             // [kMetaWords]
  int64_t o_ready;            // [num_minibatches] per-minibatch ready counters
  int64_t* error;             // host-mapped int64 [kErrFieldCount]
  // Op operands (see each kernel for meaning and shape).
  const void* in0;
  const void* in1;
  const void* in2;
  const void* in3;
  void* out0;
  // NOTE: appended last: fields added in the middle shift the layout the fused kernel reads
  // from its constant bank, and ptxas (nvcc 13.0) then serialises its wgmma pipeline.
  int32_t max_tokens;  // token rows per rank of every per-token buffer (the workspace's size)
  int32_t pad0;
};

// Operands of the fused layer (layer/sm90_fwd.cuh) beyond Params. Plain C++: mok/_ext.py
// mirrors it.
// Weights are bf16, row-major: w_gate/w_up [L, I, H], w_down [L, H, I], shared_w_gate/up
// [Is, H], shared_w_down [H, Is]. Params carries x (in0), topk_weights (in1), the shared
// output (in2, bf16 [N, H]), out0 (the layer output [N, H] bf16) and the workspace.
struct LayerArgs {
  int32_t inter;            // I: expert intermediate size
  int32_t shared_inter;     // Is: shared expert intermediate size (0: no shared expert)
  int32_t num_comm_blocks;  // blocks [0, num_comm_blocks) dispatch; the rest run GEMM tiles
  int32_t ring_rows;        // receive / h ring rows (a multiple of minibatch_rows)
  const void* w_gate;
  const void* w_up;
  const void* w_down;
  const void* shared_w_gate;
  const void* shared_w_up;
  const void* shared_w_down;
  void* h;          // bf16 [ring_rows, I]: SwiGLU output ring (local)
  void* shared_h;   // bf16 [N, Is]
  void* dedup;      // [num_ranks * N, H] dedup rows (kFlagDedup)
  uint32_t* counters;  // local tile counters, zeroed by the launcher (layer/sm90_fwd.cuh: Counters)
  int64_t counters_len;  // uint32 words
  // Optional event trace (null: off): per block, two regions (0: communication or producer
  // thread, 1: first consumer warpgroup) of trace_entries uint64 pairs each; pair 0 holds the
  // event count, then (globaltimer ns, packed event) pairs (layer/sm90_fwd.cuh: TraceEvent).
  uint64_t* trace;
  int64_t trace_entries;
  // Rows of w_gate (and of w_up) from one expert's first row to the next expert's: I for two
  // [L, I, H] tensors, 2I for the two halves of one [L, 2I, H] tensor (gate rows, then up rows).
  int64_t gate_up_stride;
  // Saving mode (the backward from kept activations; null: off): every gate/up tile's fp32
  // accumulators, g in columns [0, I) and u in [I, 2I), row r of gu32 [receive rows, 2I] being
  // receive row r (not its ring row); shared_gu32 [N, 2Is] the shared expert's, by token.
  float* gu32;
  float* shared_gu32;
};

}  // namespace mok
