"""``python -m mok.bench comm|layer|sweep|probe|train|experts|lm|preflight [...]`` (launch
with torchrun, one process per GPU, or ``MOK_SHARED_GPU=1`` for every rank on one GPU;
``experts`` runs on one GPU).

comm: dispatch/combine vs NCCL and DeepEP. layer: the whole layer forward, fused vs unfused vs
NCCL. sweep: the fused layer over communication SMs x minibatch x mode. probe: the GPU
microbenchmarks behind ``mok-sim calibrate`` (also runs on one GPU, without the peer parts).
train: one training step (forward + backward) of the layer, mok vs the best torch layer under
autograd: on one GPU (the per-rank work of EP N), or at EP R under torchrun against torch-best
behind an NCCL all-to-all pipeline (a labelled smoke test on shared-GPU ranks). experts: the
routed experts' GEMM pieces of that step, each alone, mok's kernels vs torch's. lm: notebook
05's small MoE language model trained at EP = the torchrun world size (one CSV row of loss per
step; ``MOK_SHARED_GPU=1`` puts every rank on one GPU; runs on CPU too, through the reference
layer). preflight: every pair of ranks checked before a run (NVLink-reachable, copy bandwidth,
flag round trip; exit status 1 when a pair fails). signals: the flag operations one call of
each path sends between ranks, counted on the signal pad (EP2 .. EP64 on ranks sharing one GPU).
"""

from __future__ import annotations

import sys

from mok.ranks import SHARED_GPU_ENV, shared_gpu

COMMANDS = ("comm", "layer", "sweep", "probe", "train", "experts", "lm", "preflight", "signals")
# What runs on ranks that share a GPU (MOK_SHARED_GPU=1): train (a labelled smoke test), lm
# (losses), preflight (its checks; its timings labelled) and signals (its counts; its timings
# labelled). The others' rows are timings of
# NVLink or of a whole GPU, which shared ranks are not.
SHARED_GPU_COMMANDS = ("train", "lm", "preflight", "signals")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(
            "usage: torchrun --nproc-per-node=N -m mok.bench "
            "{comm,layer,sweep,probe,train,lm,preflight,signals} [--help]\n"
            "       python -m mok.bench {train,experts,lm} [--help]",
            file=sys.stderr,
        )
        return 2
    if shared_gpu() and argv[0] not in SHARED_GPU_COMMANDS:
        print(
            f"mok.bench {argv[0]}: refused with {SHARED_GPU_ENV}=1: ranks sharing one GPU "
            "time-slice it, so its timings would say nothing about NVLink or about a GPU of each "
            f"rank's own; run it with one GPU per rank (unset {SHARED_GPU_ENV}). On shared ranks: "
            f"{', '.join(SHARED_GPU_COMMANDS)} (labelled as such)",
            file=sys.stderr,
        )
        return 2
    if argv[0] in ("layer", "sweep"):
        from mok.bench import layer

        return layer.main(argv[1:], sweep=argv[0] == "sweep")
    if argv[0] == "probe":
        from mok.bench import probe

        return probe.main(argv[1:])
    if argv[0] == "train":
        from mok.bench import train

        return train.main(argv[1:])
    if argv[0] == "lm":
        from mok.bench import lm

        return lm.main(argv[1:])
    if argv[0] == "preflight":
        from mok.bench import preflight

        return preflight.main(argv[1:])
    if argv[0] == "signals":
        from mok.bench import signals

        return signals.main(argv[1:])
    if argv[0] == "experts":
        from mok.bench import experts

        return experts.main(argv[1:])
    from mok.bench import comm

    return comm.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
