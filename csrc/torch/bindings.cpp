// Thin torch bindings: raw pointers and the stream come from Python (mok/_ext.py packs Params
// with ctypes); all device work lives in the launchers (comm/launch.cu,
// layer/launch_sm90.cu, layer/launch_sm90_bwd.cu, probe/probe.cu).
#include <torch/extension.h>

#include <cstring>
#include <string>

#include "api.h"
#include "params.h"
#include "probe/probe.h"

namespace {

// NOTE: numbers go into TORCH_CHECK's messages as strings: streaming an int64_t there crashed
// the process (a segfault inside the message's ostream, torch 2.11 + this toolchain) instead of
// raising the error.
std::string shape_text(int64_t rows, int64_t hidden, int64_t inter, int64_t num_experts) {
  return std::to_string(rows) + " rows, hidden " + std::to_string(hidden) + ", intermediate " +
         std::to_string(inter) + ", " + std::to_string(num_experts) + " experts";
}

int64_t params_size() { return static_cast<int64_t>(sizeof(mok::Params)); }

// The kernels index per-rank arrays of kMaxRanks entries by rank (params.h).
void check_ranks(const mok::Params& p) {
  TORCH_CHECK(p.num_ranks >= 1 && p.num_ranks <= mok::kMaxRanks && p.rank >= 0 &&
                  p.rank < p.num_ranks,
              "mok: rank ", std::to_string(p.rank), " of ", std::to_string(p.num_ranks),
              " ranks; the kernels support 1 to ", std::to_string(mok::kMaxRanks),
              " ranks (one NVLink domain)");
}

void launch(int64_t kind, pybind11::bytes params_bytes, int64_t grid, int64_t stream) {
  const std::string raw = params_bytes;
  TORCH_CHECK(raw.size() == sizeof(mok::Params), "mok: Params is ", std::to_string(raw.size()),
              " bytes in Python but ", std::to_string(sizeof(mok::Params)),
              " bytes in csrc/params.h; mok/_ext.py and csrc/params.h disagree");
  mok::Params params;
  std::memcpy(&params, raw.data(), sizeof(params));
  check_ranks(params);
  const int err = mok::launch(static_cast<int>(kind), params, static_cast<int>(grid),
                              reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "mok: launching kernel ", kind, " with ", std::to_string(grid),
              " blocks failed: ", mok::error_string(err));
}

template <typename T>
T unpack(const pybind11::bytes& raw_bytes, const char* name) {
  const std::string raw = raw_bytes;
  TORCH_CHECK(raw.size() == sizeof(T), "mok: ", name, " is ", std::to_string(raw.size()),
              " bytes in Python but ", std::to_string(sizeof(T)),
              " bytes in csrc/params.h; mok/_ext.py and csrc/params.h disagree");
  T value;
  std::memcpy(&value, raw.data(), sizeof(T));
  return value;
}

int64_t layer_args_size() { return static_cast<int64_t>(sizeof(mok::LayerArgs)); }

void launch_layer(pybind11::bytes params_bytes, pybind11::bytes args_bytes, int64_t grid,
                  int64_t stream) {
  const auto params = unpack<mok::Params>(params_bytes, "Params");
  const auto args = unpack<mok::LayerArgs>(args_bytes, "LayerArgs");
  check_ranks(params);
  const int err =
      mok::launch_layer(params, args, static_cast<int>(grid), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "mok: launching the fused layer with ", std::to_string(grid),
              " blocks failed: ", mok::error_string(err));
}

int64_t layer_counters(pybind11::bytes params_bytes) {
  return mok::layer_counters(unpack<mok::Params>(params_bytes, "Params"));
}

// The experts' backward kernel (api.h SwigluBwdLaunch): raw device pointers (0: none) and sizes.
void launch_swiglu_bwd(int64_t a, int64_t dy, int64_t w_gate_up, int64_t w_down, int64_t ends,
                       int64_t row_w, int64_t hw, int64_t dgu, int64_t part, int64_t gu32,
                       int64_t next_tile, int64_t gather_x, int64_t gather_dy, int64_t gather_src,
                       int64_t gather_tokens, int64_t gather_topk, int64_t mode,
                       int64_t rows, int64_t hidden, int64_t inter,
                       int64_t num_experts, int64_t grid, int64_t stream) {
  mok::SwigluBwdLaunch l{};
  l.a = reinterpret_cast<const void*>(a);
  l.dy = reinterpret_cast<const void*>(dy);
  l.w_gate_up = reinterpret_cast<const void*>(w_gate_up);
  l.w_down = reinterpret_cast<const void*>(w_down);
  l.ends = reinterpret_cast<const int32_t*>(ends);
  l.row_w = reinterpret_cast<const float*>(row_w);
  l.hw = reinterpret_cast<void*>(hw);
  l.dgu = reinterpret_cast<void*>(dgu);
  l.part = reinterpret_cast<float*>(part);
  l.gu32 = reinterpret_cast<float*>(gu32);
  l.next_tile = reinterpret_cast<int32_t*>(next_tile);
  l.gather_x = reinterpret_cast<const void*>(gather_x);
  l.gather_dy = reinterpret_cast<const void*>(gather_dy);
  l.gather_src = reinterpret_cast<const int32_t*>(gather_src);
  l.gather_tokens = gather_tokens, l.gather_topk = gather_topk;
  l.mode = mode;
  l.rows = rows, l.hidden = hidden, l.inter = inter, l.num_experts = num_experts;
  const int err =
      mok::launch_swiglu_bwd(l, static_cast<int>(grid), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "mok: launching the experts' backward kernel (",
              shape_text(rows, hidden, inter, num_experts), ") failed: ", mok::error_string(err));
}

// The experts' weight gradients (api.h WgradLaunch).
void launch_wgrad(int64_t a, int64_t b, int64_t ends, int64_t c, int64_t rows, int64_t m,
                  int64_t n, int64_t num_experts, int64_t out, int64_t gather_rows,
                  int64_t gather_src, int64_t gather_tokens, int64_t gather_topk,
                  int64_t gather_operand, int64_t transposed, int64_t grid, int64_t stream) {
  mok::WgradLaunch l{};
  l.a = reinterpret_cast<const void*>(a);
  l.b = reinterpret_cast<const void*>(b);
  l.ends = reinterpret_cast<const int32_t*>(ends);
  l.c = reinterpret_cast<void*>(c);
  l.rows = rows, l.m = m, l.n = n, l.num_experts = num_experts, l.out = out;
  l.gather_rows = reinterpret_cast<const void*>(gather_rows);
  l.gather_src = reinterpret_cast<const int32_t*>(gather_src);
  l.gather_tokens = gather_tokens, l.gather_topk = gather_topk;
  l.gather_operand = gather_operand;
  l.transposed = transposed;
  const int err = mok::launch_wgrad(l, static_cast<int>(grid), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "mok: launching the weight-gradient kernel (", std::to_string(rows),
              " rows, ", std::to_string(m), " x ", std::to_string(n), ", ",
              std::to_string(num_experts), " experts",
              transposed != 0 ? ", stored transposed" : "", ") failed: ",
              mok::error_string(err));
}

// The experts' backward from saved g / u in one launch (api.h FusedBwdLaunch): Params (the
// error record), raw device pointers (0: none) and sizes.
void launch_bwd_fused(pybind11::bytes params_bytes, int64_t a, int64_t dy, int64_t w_gate_up,
                      int64_t w_down, int64_t ends, int64_t row_w, int64_t hw, int64_t dgu,
                      int64_t part, int64_t gu32, int64_t d_a, int64_t d_w_gate_up,
                      int64_t d_w_down, int64_t counters, int64_t counters_len, int64_t wgrad_out,
                      int64_t run, int64_t fault, int64_t rows, int64_t hidden, int64_t inter,
                      int64_t num_experts, int64_t grad_out, int64_t x, int64_t row_src,
                      int64_t slots, int64_t dx_shared, int64_t dx, int64_t num_tokens,
                      int64_t num_topk, int64_t dedup, int64_t copy_ahead, int64_t peers,
                      int64_t off_dy, int64_t off_row_grads, int64_t da_staged,
                      int64_t wgu_transposed, int64_t grid, int64_t stream) {
  const auto params = unpack<mok::Params>(params_bytes, "Params");
  mok::FusedBwdLaunch l{};
  l.grad_out = reinterpret_cast<const void*>(grad_out);
  l.x = reinterpret_cast<const void*>(x);
  l.row_src = reinterpret_cast<const int32_t*>(row_src);
  l.slots = reinterpret_cast<void*>(slots);
  l.dx_shared = reinterpret_cast<const float*>(dx_shared);
  l.dx = reinterpret_cast<void*>(dx);
  l.num_tokens = num_tokens, l.num_topk = num_topk, l.dedup = dedup;
  l.copy_ahead = copy_ahead;
  l.peers = peers, l.off_dy = off_dy, l.off_row_grads = off_row_grads;
  l.dh.a = reinterpret_cast<const void*>(a);
  l.dh.dy = reinterpret_cast<const void*>(dy);
  l.dh.w_gate_up = reinterpret_cast<const void*>(w_gate_up);
  l.dh.w_down = reinterpret_cast<const void*>(w_down);
  l.dh.ends = reinterpret_cast<const int32_t*>(ends);
  l.dh.row_w = reinterpret_cast<const float*>(row_w);
  l.dh.hw = reinterpret_cast<void*>(hw);
  l.dh.dgu = reinterpret_cast<void*>(dgu);
  l.dh.part = reinterpret_cast<float*>(part);
  l.dh.gu32 = reinterpret_cast<float*>(gu32);
  l.dh.rows = rows, l.dh.hidden = hidden, l.dh.inter = inter, l.dh.num_experts = num_experts;
  l.d_a = reinterpret_cast<void*>(d_a);
  l.d_w_gate_up = reinterpret_cast<void*>(d_w_gate_up);
  l.d_w_down = reinterpret_cast<void*>(d_w_down);
  l.counters = reinterpret_cast<uint32_t*>(counters);
  l.counters_len = counters_len, l.wgrad_out = wgrad_out, l.run = run, l.fault = fault;
  l.da_staged = da_staged;
  l.wgu_transposed = wgu_transposed;
  const int err =
      mok::launch_bwd_fused(params, l, static_cast<int>(grid), reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "mok: launching the fused experts' backward (",
              shape_text(rows, hidden, inter, num_experts), row_src != 0 ? ", with transfers" : "",
              ") failed: ", mok::error_string(err));
}

int64_t host_device_pointer(int64_t host_ptr) {
  int err = 0;
  const uint64_t dev = mok::host_device_pointer(reinterpret_cast<void*>(host_ptr), &err);
  TORCH_CHECK(err == 0, "mok: no device address for pinned host memory: ",
              mok::error_string(err));
  return static_cast<int64_t>(dev);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mok kernels (schedule, dispatch, combine, fused layer)";
  m.def("params_size", &params_size);
  m.def("launch", &launch, "launch(kind, params, grid, stream)");
  m.def("host_device_pointer", &host_device_pointer);
  m.def("layer_args_size", &layer_args_size);
  m.def("launch_layer", &launch_layer, "launch_layer(params, layer_args, grid, stream)");
  m.def("layer_smem_bytes", &mok::layer_smem_bytes);
  m.def("layer_counters", &layer_counters);
  m.def("launch_swiglu_bwd", &launch_swiglu_bwd);
  m.def("launch_wgrad", &launch_wgrad);
  m.def("launch_bwd_fused", &launch_bwd_fused);
  m.def("bwd_fused_counters", &mok::bwd_fused_counters);

  // Probe microbenchmarks (probe/probe.cu, mok/bench/probe.py): addresses and streams as ints,
  // each returns a cudaError_t value.
  m.def("probe_copy_vector", &mok::probe::copy_vector);
  m.def("probe_copy_tma", &mok::probe::copy_tma);
  m.def("probe_read_bandwidth", &mok::probe::read_bandwidth);
  m.def("probe_pingpong", &mok::probe::pingpong);
  m.def("probe_chase", &mok::probe::chase);
  m.def("probe_poll_flags", &mok::probe::poll_flags);
  m.def("probe_fence_cost", &mok::probe::fence_cost);
  m.def("probe_block_skew", &mok::probe::block_skew);
  m.def("probe_pingpong_samples", &mok::probe::pingpong_samples);
  m.def("probe_enable_peer_access", &mok::probe::enable_peer_access);
}
