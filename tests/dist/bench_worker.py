"""Worker of the shared-GPU benchmark tests (tests/test_mok_shared_gpu.py): ``mok.bench
<command> [args]`` on every rank, which must finish with exit status 0; prints
``MOK-BENCH-OK rank=R``."""

from __future__ import annotations

import os
import sys

from mok.bench.__main__ import main as bench


def main() -> int:
    rank = int(os.environ["RANK"])
    status = bench(sys.argv[1:])
    if status != 0:
        print(f"rank {rank}: mok.bench {sys.argv[1]} exit status {status}", flush=True)
        return status
    print(f"MOK-BENCH-OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
