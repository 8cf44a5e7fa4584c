"""Benchmarks, run as ``python -m mok.bench <name>`` (usually under torchrun, one process per GPU).

- :mod:`mok.bench.comm`: dispatch / combine vs NCCL and DeepEP (``comm``);
- :mod:`mok.bench.layer`: the whole layer forward, fused vs unfused vs NCCL / DeepEP (``layer``),
  and the fused layer's sweep the simulator is validated against (``sweep``);
- :mod:`mok.bench.probe`: the GPU microbenchmarks behind ``mok-sim calibrate`` (``probe``);
- :mod:`mok.bench.train`: one training step of the layer on one GPU, mok vs the best torch layer
  under autograd (``train``);
- :mod:`mok.bench.common`: what they share (process group, CUDA-event timer, CSV recorder and
  provenance columns, max over ranks, routing draw); :mod:`mok.bench.env`: NVLink multicast off.
"""
