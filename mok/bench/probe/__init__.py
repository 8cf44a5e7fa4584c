"""GPU microbenchmarks for the simulator's calibration: ``python -m mok.bench probe``.

``torchrun --nproc-per-node=2 -m mok.bench probe --out probe.json`` on two NVLink-connected GPUs
(ranks 0 and 1 are the measured pair; further ranks only take part in the collectives), or plain
``python -m mok.bench probe`` on one GPU, where the peer parts are skipped and the JSON says why.
``mok-sim calibrate probe.json`` fits a GPU profile from the result (sim/app/calibrate.py).

The JSON keeps the keys and units of ``mok/bench/results/h200x2-probe-2026-11-29.json``
(``what`` / ``methods`` / ``results``) and adds ``meta``, ``skipped`` and the results
``hbm_bandwidth``, ``signal_latency_gpu_scope``, ``copy_checks``, ``grouped_gemm_by_rows``,
``grouped_gemm_by_sms`` (and ``grouped_gemm_by_sms_green``), and the push-signalling results
``poll_cost``, ``fence_cost``, ``block_skew`` and ``signal_jitter``. Bandwidths and GEMM rates are
CUDA-event medians after warm-up, max over ranks (mok.bench.common's timer); latencies come from
%globaltimer inside the kernels (csrc/probe/probe.cu, loaded through mok._ext). The JSON is
rewritten after every section, so a failure late in the sweep keeps what was measured.
``--skip`` leaves sections out, ``--sections`` runs only those named: the push-signalling set on
one GPU, in seconds, is ``python -m mok.bench probe --sections
poll_cost,fence_cost,block_skew,signal_jitter --out signalling.json``, which
:func:`sim.app.signalling_fit.fit_signalling` turns into a profile's ``signalling`` values.

Modules, by what they measure:

- :mod:`~mok.bench.probe.hbm`: HBM copy / read / write bandwidth;
- :mod:`~mok.bench.probe.gemm`: the bf16 GEMM rate and grouped GEMMs by rows and by SM count
  (carveout, green contexts);
- :mod:`~mok.bench.probe.copies`: copy bandwidth by SM count (16-byte kernel, TMA, copy engine;
  local and peer, one and both directions; copy checks) and NCCL all_to_all;
- :mod:`~mok.bench.probe.latency`: flag ping-pong round trips and dependent-load latency;
- :mod:`~mok.bench.probe.signalling`: push signalling on one GPU: the cost of a poll sweep over K
  set flags (one warp, one thread, one thread per flag; GPU and system scope), the release fence
  after n SMs stored K bytes each (local, and a second GPU where one process sees two), the start
  skew of a persistent grid, and every round trip of the flag ping-pong (min / median / mean /
  p90 / p99 / max);

and around them :mod:`~mok.bench.probe.args` (flags, defaults, planned points),
:mod:`~mok.bench.probe.context` (state and helpers of every section, the JSON's meta),
:mod:`~mok.bench.probe.run` (the sections in order, :func:`main`) and
:mod:`~mok.bench.probe.results` (METHODS, the JSON / CSV writer, the table and the reader).
"""

from __future__ import annotations

from mok.bench.probe.args import build_parser, parse_args, plan_points
from mok.bench.probe.results import METHODS, SECTIONS, ProbeResults
from mok.bench.probe.run import main

__all__ = [
    "METHODS",
    "SECTIONS",
    "ProbeResults",
    "build_parser",
    "main",
    "parse_args",
    "plan_points",
]
