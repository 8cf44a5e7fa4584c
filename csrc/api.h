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

// Device address of host-pinned memory (for the error record).
uint64_t host_device_pointer(void* host_ptr, int* err);

// Human-readable name of a CUDA error code.
const char* error_string(int err);

}  // namespace mok
