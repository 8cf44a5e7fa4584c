"""Host programs built from csrc/'s headers with nvcc (sm_90a), for the CPU tests that check
what the kernels' constants and address functions compute."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc")


def run_host_program(source: str, tmp: Path, name: str) -> subprocess.CompletedProcess:
    """Writes ``source`` to ``tmp/name.cu``, builds it (asserting the build succeeds) and runs
    it; the run's completed process (stdout as text)."""
    (tmp / f"{name}.cu").write_text(source)
    build = subprocess.run(
        [NVCC, "-std=c++17", f"-I{CSRC}", "-gencode=arch=compute_90a,code=sm_90a",
         str(tmp / f"{name}.cu"), "-o", str(tmp / name)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    return subprocess.run([str(tmp / name)], capture_output=True, text=True, timeout=60)
