"""Shared memory of the Hopper kernels: each kernel's static shared memory (ptxas) plus the
dynamic size its launcher asks for fits the per-block opt-in limit of sm_90, read at build time.

Past the limit ``cudaFuncSetAttribute`` refuses the launch, which only a GPU run shows, and at
every rank count: a 512-byte table added to the fused layer's static shared state once took it
240 B over. Needs nvcc (CI has it; skipped where it is missing).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.host_program import CSRC, NVCC, run_host_program

# sm_90 (H100 / H200): 228 KiB per SM, of which a block may opt in to 227 KiB.
MAX_SMEM_PER_BLOCK = 227 * 1024

pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (compiles csrc/ for sm_90a)")

# kernel name (as ptxas prints it, mangled prefix) -> the C++ expression of its dynamic bytes
DYNAMIC = {
    "_ZN3mok12layer_kernel": "mok::kLayerSmem",
    "_ZN3mok17swiglu_bwd_kernelILi0E": "mok::BwdPipe<0>::kSmem",
    "_ZN3mok17swiglu_bwd_kernelILi1E": "mok::BwdPipe<1>::kSmem",
    "_ZN3mok17swiglu_bwd_kernelILi2E": "mok::BwdPipe<2>::kSmem",
    "_ZN3mok17swiglu_bwd_kernelILi3E": "mok::BwdPipe<3>::kSmem",
    "_ZN3mok12wgrad_kernel": "mok::kWgradSmem",
    "_ZN3mok19wgrad_gather_kernel": "mok::kWgradSmem",
    "_ZN3mok16bwd_fused_kernel": "mok::kFusedSmem",
}
SOURCES = ("layer/launch_sm90.cu", "layer/launch_sm90_bwd.cu")


def _static_smem(tmp: Path) -> dict[str, int]:
    """Static shared memory per kernel entry, from ptxas -v."""
    out: dict[str, int] = {}
    for src in SOURCES:
        p = subprocess.run(
            [NVCC, "-std=c++17", "-O1", f"-I{CSRC}", "-gencode=arch=compute_90a,code=sm_90a",
             "-Xptxas", "-v", "-c", str(CSRC / src), "-o", str(tmp / "k.o")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        entry = None
        for line in p.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                entry = m.group(1)
            m = re.search(r"(\d+) bytes smem", line)
            if m and entry:
                out[entry] = int(m.group(1))
                entry = None
    return out


def _dynamic_smem(tmp: Path) -> dict[str, int]:
    """The launchers' dynamic sizes, printed by a host program built from the same headers."""
    lines = [f'  std::printf("%d\\n", static_cast<int>({e}));' for e in DYNAMIC.values()]
    source = (
        '#include <cstdio>\n#include "layer/sm90_fwd.cuh"\n#include "layer/sm90_bwd.cuh"\n'
        '#include "layer/sm90_bwd_fused.cuh"\nint main() {\n' + "\n".join(lines) + "\n}\n"
    )
    values = run_host_program(source, tmp, "sizes")
    return dict(zip(DYNAMIC, map(int, values.stdout.split()), strict=True))


def test_every_hopper_kernel_fits_the_shared_memory_of_a_block(tmp_path):
    static, dynamic = _static_smem(tmp_path), _dynamic_smem(tmp_path)
    checked, over = 0, []
    for entry, s in static.items():
        prefix = next((k for k in DYNAMIC if entry.startswith(k)), None)
        if prefix is None:
            continue
        checked += 1
        total = s + dynamic[prefix]
        if total > MAX_SMEM_PER_BLOCK:
            over.append(f"{entry}: {s} static + {dynamic[prefix]} dynamic = {total} B")
    assert not over, f"over {MAX_SMEM_PER_BLOCK} B per block:\n" + "\n".join(over)
    assert checked >= len(DYNAMIC), sorted(static)
