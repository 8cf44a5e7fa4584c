"""Discrete-event simulator of push vs pull MoE dispatch/combine on NVLink topologies.

What it answers: for a topology, model shape, EP size and routing skew, how long one MoE layer
forward takes in the MoK-style megakernel under each transfer policy, and which kernel config
(pull or push per transfer, dedup or not, communication SMs, minibatch, ring size) is fastest.
``mok-sim`` is the command line; :func:`sim.model.simulate` the library entry point.

Layout (one concept per module):

* :mod:`sim.hardware` / ``sim/profiles/*.json``: GPU profiles as validated data. ``h200.json`` is
  fitted by :mod:`sim.calibrate` from our H200 probe (copied to ``sim/profiles``); H100, B200,
  GB200 and GB300 are datasheet leads scaled from it, each assumption listed in the profile.
* :mod:`sim.topology`: h200x2, hgx-h200/h100/b200, gb200-nvl72, gb300-nvl72 and ``<preset>xN``
  (N NVLink domains joined by one scale-out NIC per GPU) as data, and the flow-network resources.
* :mod:`sim.flows`: max-min fair bandwidth sharing (numba progressive filling).
* :mod:`sim.engine`: task graph + lean event loop (numba); :mod:`sim.simpy_engine` runs the same
  graph with SimPy for cross-checks.
* :mod:`sim.schedule`: MoK's receive layout (expert regions padded to the row tile, sources
  interleaved round-robin) reduced to rows per (destination, round, source).
* :mod:`sim.gemm`: grouped-GEMM tiles and waves. :mod:`sim.policies`: push / pull / dedup-pull
  dispatch, push / pull combine. :mod:`sim.model`: the layer. :mod:`sim.results`: records, CSV,
  breakdown. :mod:`sim.trace`: Chrome trace. :mod:`sim.plots`: figures. :mod:`sim.sweep`: grids,
  sweeps, comparison, tuner. :mod:`sim.cli`, :mod:`sim.bench`.
* Standalone comm kernels against measurements (``mok-sim validate``): :mod:`sim.kernel_specs`
  (what each mok kernel moves, its phases and entry points, as data), :mod:`sim.phases` (those
  kernels as task graphs, and the benchmark's host floor), :mod:`sim.kernel_rates` (the comm
  rates of a measured kernel, shared with the layer model's opt-in kernel profile),
  :mod:`sim.kernel_rows` (how the kernels walk their rows: padded receive layout, busiest warp,
  copy-ring items, warp row rounds), :mod:`sim.kernel_profile` (the fitted knobs as data,
  ``sim/profiles/mok-comm-h200x2.json``), :mod:`sim.kernel_fit` (the fit) and
  :mod:`sim.validate` (errors, Spearman, chosen-vs-best gap, report).
* Measured rows (both fits and ``mok-sim validate``): :mod:`sim.measured` (the measured-CSV
  readers and the fit / validation split of every fit).
* The fused layer kernel against measurements (``mok-sim validate`` on layer CSVs):
  :mod:`sim.fused` (comm blocks, the GEMM tile order as a list schedule over the compute SMs,
  the final sum; knobs in ``sim/profiles/mok-fused-h200x2.json``), :mod:`sim.fused_fit` and
  :mod:`sim.fused_tune` (``mok-sim tune --fused``).

The model, per layer forward:

1. a schedule phase (counts all-gather + prefix sums; ``schedule_base_us`` + two remote flags);
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
combine folds rank-local rows into an fp32 partial (``dedup_accumulate_bytes_per_elem``); only
the forward pass is modelled (:data:`sim.model.PASSES`).
"""
