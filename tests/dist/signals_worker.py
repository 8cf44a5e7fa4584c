"""Worker of the signal-count test (tests/test_mok_shared_gpu.py): ``mok.bench signals`` on every
rank, which must finish (exit status 0); prints ``MOK-SIGNALS-OK rank=R``."""

from __future__ import annotations

import os
import sys

from mok.bench import signals


def main() -> int:
    rank = int(os.environ["RANK"])
    status = signals.main(sys.argv[1:])
    if status != 0:
        print(f"rank {rank}: signals exit status {status}", flush=True)
        return status
    print(f"MOK-SIGNALS-OK rank={rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
