"""Discrete-event simulator of push vs pull MoE dispatch/combine on NVLink topologies.

What it answers: for a topology, model shape, EP size and routing skew, how long one MoE layer
forward takes in the MoK-style megakernel under each transfer policy, and which kernel config
(pull or push per transfer, dedup or not, communication SMs, minibatch, ring size) is fastest.
``mok-sim`` is the command line (:mod:`sim.app.cli`); :func:`simulate` the library entry point.

Layout: subpackages that import one way, ``core`` <- ``config`` / ``measured`` <- ``comm`` <-
``layer`` <- ``fused`` <- ``app`` (a module imports only from its own level and those below;
tests/test_sim_imports.py checks it):

* :mod:`sim.core`: GPU profiles as validated data (:mod:`sim.core.hardware`, ``sim/profiles/
  *.json``: ``h200.json`` fitted by :mod:`sim.app.calibrate` from our H200 probe, H100, B200,
  GB200 and GB300 datasheet leads scaled from it, each assumption listed in the profile),
  topologies (h200x2, hgx-h200/h100/b200, gb200-nvl72, gb300-nvl72 and ``<preset>xN``: N NVLink
  domains joined by one scale-out NIC per GPU) and their flow-network resources
  (:mod:`sim.core.topology`), max-min fair sharing (:mod:`sim.core.flows`, numba progressive
  filling), the task graph and its lean event loop (:mod:`sim.core.engine`, numba;
  :mod:`sim.core.simpy_engine` runs the same graph with SimPy for cross-checks), grouped-GEMM
  tiles and waves (:mod:`sim.core.gemm`) and the one transfer builder (:mod:`sim.core.transfer`);
* :mod:`sim.config`: what to simulate (:class:`Workload`, :class:`SimConfig`; no file I/O);
  :mod:`sim.measured`: where the measured files are (``mok/bench/results``), their readers and
  the fit / validation split of every fit;
* :mod:`sim.comm`: the standalone comm kernels against measurements (``mok-sim validate``): what
  each mok kernel moves (:mod:`sim.comm.catalog`), how it walks its rows (:mod:`sim.comm.rows`),
  its comm-engine rate law (:mod:`sim.comm.rates`, shared with the layer model's opt-in kernel
  profile), the fitted knobs (:mod:`sim.comm.profile`, ``sim/profiles/mok-comm-h200x2.json``),
  the kernels as task graphs and the benchmark's host floor (:mod:`sim.comm.model`), the fit
  (:mod:`sim.comm.fit`); DeepEP's dispatch / combine as a rate law fitted on our measured rows
  (:mod:`sim.comm.deepep`);
* :mod:`sim.layer`: the layer: MoK's receive layout (expert regions padded to the row tile,
  sources interleaved round-robin) reduced to rows per (destination, round, source)
  (:mod:`sim.layer.plan`), push / pull / dedup-pull dispatch and push / pull combine
  (:mod:`sim.layer.policies`), the layer's task graph (:mod:`sim.layer.model`; the backward's:
  :mod:`sim.layer.backward`), records, CSV and
  breakdown (:mod:`sim.layer.results`), grids, sweeps, comparison and tuner
  (:mod:`sim.layer.sweep`); the DeepEP + torch-best training step that ``compare --pass both``
  prints beside mok's rows (:mod:`sim.layer.baseline`);
* :mod:`sim.fused`: the fused layer kernel against measurements (``mok-sim validate`` on layer
  CSVs): its knobs (:mod:`sim.fused.profile`, ``sim/profiles/mok-fused-h200x2.json``), the GEMM
  tile order as a list schedule over the compute SMs (:mod:`sim.fused.tiles`), comm blocks and
  the final sum (:mod:`sim.fused.model`), the fit (:mod:`sim.fused.fit`) and the tuner
  (:mod:`sim.fused.tune`, ``mok-sim tune --fused``);
* :mod:`sim.app`: the command line, validation report (errors, Spearman, chosen-vs-best gap),
  calibration, ``mok-config/1`` writer, figures, Chrome trace and speed benchmark.

This package itself offers the few entry points the notebooks use (:data:`__all__`), each loaded
on first use, so that importing one module (say :mod:`sim.measured`) does not load the models.

The model, per layer forward:

1. a schedule phase (counts all-gather + prefix sums; ``schedule_base_us`` + two all-rank
   handshakes);
2. each rank's compute SMs run, in order, the shared expert (overlapping the first dispatch), the
   expert FFN of each minibatch (gate+up GEMM with fused SwiGLU, GPU-scope handoff, down GEMM;
   128 x N tiles, ``ceil(tiles / compute SMs)`` waves, partial waves cost full ones), and the
   final weighted sum of the k combine rows of each token (memory bound);
3. its communication SMs move minibatches: a transfer is a latency followed by flows whose rates
   come from max-min fair sharing of (a) the issuing GPU's comm engine, with a payload rate
   ``bw(num_comm_sms)`` per mechanism fitted from the probe, and (b) per-direction NVLink ports
   (and NICs, and an aggregate switch) carrying payload times protocol overhead on the data
   direction and the acks / read requests on the reverse direction;
4. signalling: pull completes locally (mbarrier, then a GPU-scope flag to the compute SMs);
   push needs a fence and a remote flag per round and the destination waits for every sender;
   ring slot reuse needs a remote credit for push dispatch and a remote "done reading" flag for
   pull combine;
5. the receive ring holds ``macrobatch_size / minibatch_size`` minibatches; dispatch of round m
   waits until round ``m - slots`` was combined (back-pressure). Combine of round m overlaps
   later dispatches and GEMMs.

Units: time in microseconds (``*_us``), bandwidth in GB/s (``*_gbps``, 1e9 bytes/s) in profiles
and bytes per microsecond inside the flow network, sizes in bytes, rates in TFLOP/s.

Main assumptions (also in each profile's ``assumptions``): protocol bytes per payload byte are
the one-tile measurement for every message size and for both copy mechanisms; the NVLink wire
efficiency fitted on NV18 holds for NVSwitch ports and NVLink5; per-SM comm rates fall with
``remote latency / (remote latency + switch hop)`` behind a switch; grouped GEMM tiles reach
``gemm_efficiency`` (0.9) of the measured dense rate; the scale-out NIC's DMA engine moves
inter-domain bytes at no comm-SM cost over a non-blocking fabric; a transfer of a minibatch is
one flow whose bytes split over the peers in proportion to their rows (``flow_granularity=
"round"``; ``"peer"`` gives one flow per peer: slower, used to check the aggregate); dedup
combine folds rank-local rows into an fp32 partial (``dedup_accumulate_bytes_per_elem``). The
forward is the default pass; ``SimConfig(direction="backward")`` builds the backward instead
(:mod:`sim.layer.backward`: pull reverse combine, dgrad rounds, push reverse dispatch, weight
gradients at the end; :data:`sim.layer.model.PASSES`), at the forward's rates; ``mok-sim
validate`` on a ``mok.bench train`` CSV compares it with mok's backward as it runs today (one
piece after another, not this overlapped design).
"""

from importlib import import_module

# name -> the module that defines it
_ENTRY_POINTS = {
    "Workload": "sim.config",
    "SimConfig": "sim.config",
    "simulate": "sim.layer.model",
    "compare": "sim.layer.sweep",
    "tune": "sim.layer.sweep",
    "fused_layer": "sim.fused.model",
    "fused_row": "sim.fused.model",
    "load_fused_profile": "sim.fused.profile",
    "tune_fused": "sim.fused.tune",
    "read_rows": "sim.measured",
    "read_measured": "sim.measured",
    "measured_path": "sim.measured",
}
__all__ = list(_ENTRY_POINTS)


def __getattr__(name: str):
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'sim' has no attribute {name!r}")
    value = getattr(import_module(_ENTRY_POINTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
