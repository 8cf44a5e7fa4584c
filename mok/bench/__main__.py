"""``python -m mok.bench comm [...]`` (launch with torchrun, one process per GPU)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("comm",):
        print("usage: torchrun --nproc-per-node=N -m mok.bench comm [--help]", file=sys.stderr)
        return 2
    from mok.bench import comm

    return comm.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
