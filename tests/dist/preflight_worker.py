"""Worker of the pre-flight test (tests/test_mok_shared_gpu.py): ``mok.bench preflight`` on
every rank, which must pass (exit status 0); prints ``MOK-PREFLIGHT-OK rank=R``."""

from __future__ import annotations

import os
import sys

from mok.bench import preflight


def main() -> int:
    rank = int(os.environ["RANK"])
    status = preflight.main(sys.argv[1:])
    if status != 0:
        print(f"rank {rank}: preflight exit status {status}", flush=True)
        return status
    print(f"MOK-PREFLIGHT-OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
