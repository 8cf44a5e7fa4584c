// Thin torch bindings: raw pointers and the stream come from Python (mok/_ext.py packs Params
// with ctypes); all device work lives in kernels.cu.
#include <torch/extension.h>

#include <cstring>
#include <string>

#include "api.h"
#include "params.h"

namespace {

int64_t params_size() { return static_cast<int64_t>(sizeof(mok::Params)); }

void launch(int64_t kind, pybind11::bytes params_bytes, int64_t grid, int64_t stream) {
  const std::string raw = params_bytes;
  TORCH_CHECK(raw.size() == sizeof(mok::Params), "mok: Params is ", raw.size(),
              " bytes in Python but ", sizeof(mok::Params),
              " bytes in csrc/params.h; mok/_ext.py and csrc/params.h disagree");
  mok::Params params;
  std::memcpy(&params, raw.data(), sizeof(params));
  const int err = mok::launch(static_cast<int>(kind), params, static_cast<int>(grid),
                              reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "mok: launching kernel ", kind, " with ", grid,
              " blocks failed: ", mok::error_string(err));
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
  m.doc() = "mok communication kernels (schedule, dispatch, combine)";
  m.def("params_size", &params_size);
  m.def("launch", &launch, "launch(kind, params, grid, stream)");
  m.def("host_device_pointer", &host_device_pointer);
}
