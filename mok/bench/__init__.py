"""Benchmarks, run as ``python -m mok.bench <name>`` (``comm``: dispatch/combine vs NCCL and
DeepEP, under torchrun)."""
