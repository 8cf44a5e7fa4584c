"""``python -m mok.bench comm|layer|sweep|probe [...]`` (launch with torchrun, one process per
GPU).

comm: dispatch/combine vs NCCL and DeepEP. layer: the whole layer forward, fused vs unfused vs
NCCL. sweep: the fused layer over communication SMs x minibatch x mode. probe: the GPU
microbenchmarks behind ``mok-sim calibrate`` (also runs on one GPU, without the peer parts).
"""

from __future__ import annotations

import sys

COMMANDS = ("comm", "layer", "sweep", "probe")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(
            "usage: torchrun --nproc-per-node=N -m mok.bench {comm,layer,sweep,probe} [--help]",
            file=sys.stderr,
        )
        return 2
    if argv[0] in ("layer", "sweep"):
        from mok.bench import layer

        return layer.main(argv[1:], sweep=argv[0] == "sweep")
    if argv[0] == "probe":
        from mok.bench import probe

        return probe.main(argv[1:])
    from mok.bench import comm

    return comm.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
