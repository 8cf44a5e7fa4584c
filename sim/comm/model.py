"""Standalone communication-kernel phases of mok (schedule, dispatch, combine) as task graphs.

``mok-sim validate`` predicts every row of a measured kernel sweep (``mok.bench comm``) with this
module: one kernel launch on the ``h200x2`` topology (``num_ranks`` ranks run it at once), its
``sms`` blocks all moving rows (no GEMMs), built with the transfer builder the layer model uses
too (:class:`sim.core.transfer.TransferBuilder`: max-min sharing of the issuing GPU's comm engine
and of the per-direction NVLink ports, protocol bytes on the data and the reverse direction).

What each kernel moves, per rank, in rows of ``hidden * 2`` bytes (:data:`sim.comm.catalog.
KERNELS`; csrc/dispatch.cuh, csrc/combine.cuh; N = rows received, D = dedup rows = distinct
(token, destination) pairs, T = tokens per rank, K = top-k; "self" = rows whose source and
destination are the same rank):

=========================== =============================================================
dispatch pull               NVLink in: remote N; local: read self N, write N
dispatch dedup_pull         NVLink in: remote D; local: read self D, write D (no fan-out)
dispatch fanout             local: read D, write N
dispatch dedup_pull+fanout  NVLink in: remote D; local: read self D, write N
dispatch push               NVLink out: remote rows sent; local: read T, write self rows
combine push                owner: read N y rows, NVLink out remote rows, write self rows;
                            all-ranks barrier; reduce: read T*K slot rows, write T
combine pull                reduce: NVLink in remote (token, k) rows, read self rows, write T
combine dedup_push          owner: read N y rows, NVLink out remote D, write self D; barrier;
                            reduce: read the home's D slot rows, write T
combine dedup_partials      read N y rows, write D partial rows; NVLink out one 4-byte index per row
combine dedup_pull_sum      NVLink in: remote partials of my tokens; read self partials; write T
combine dedup_pull          dedup_partials, then dedup_pull_sum (two launches, no new knob);
                            mok.bench comm's end-to-end row runs the vector partials and
                            dedup_sum's default engine "auto" (:func:`kernel_key`)
dispatch dedup_pull_remote  NVLink in: remote D; local: write remote D (own rows stay in x)
dispatch fanout_remote      as fanout (own rows read from x): knob shared with fanout
combine dedup_pull_sum      gather engine (16-byte cp.async ring): vector curves, own knob
=========================== =============================================================

dedup_sum's ``tma`` engine is a row ring (csrc/combine.cuh ``tma_sum_rows``): one item per output
row; one producer thread bulk-loads the peers' partial rows of the item, whole, into a
shared-memory stage (14 stages of 14 KiB rows per SM for DeepSeek-V3, 15 of 4 KiB for Qwen3)
and prefetches the local partial into L2; the stage's consumer warp reads the local terms with
16-byte loads, adds in rank order and stores the output row. So its NVLink bytes are the peer
rows, its local bytes the own partial read and the output written.

Comm-engine cost (the rate law: :func:`sim.comm.rates.phase_rates`): remote bytes use the calibrated
per-SM curve of the mechanism (``pull_ld`` / ``push_st`` for the 16-byte ``vector`` path,
``pull_tma`` / ``push_tma`` for bulk copies), local bytes the ``local_*`` curve counted as bytes
copied ((reads + writes) / 2, the unit of the probe's local copy). The probe kernel keeps 1024
threads x 16 B in flight per SM; mok's kernels run 512 threads, one warp per row (or one elected TMA
thread per block), and their loads are dependent on schedule lookups, so their per-SM rate differs
per kernel. Each kernel therefore has one dimensionless **in-flight factor** ``f`` (its per-SM rate
/ the probe's), and all kernels share one **congestion** constant ``sm_congestion_sms``: the loaded
latency grows with the number of issuing SMs, per-SM rate x ``1 / (1 + n / sm_congestion_sms)``.
Rates are capped by the curve's ceiling (the probe's saturation), the NVLink ports by the wire rate
(both directions busy: the protocol bytes of the other GPU's traffic share each port, the
bidirectional ceiling).

Work granularity and row size (what the byte flows alone miss):

* **Busiest warp** (16-byte path, :func:`busiest_share`): grid-stride loops give row i to warp
  i mod nwarps. Walking the padded receive buffer (pull dispatch, push combine's owner copy)
  with nwarps a multiple of the 128-row tile, the warps at small tile offsets get a row from
  every tile and the rest only padding: the phase runs as if on ``sms / share`` SMs (share 4 for
  DeepSeek-V3 at 512 tokens, 1.06 at 16384). Token / dedup-row loops add the ceil() of their
  last round (1.5 for 512 tokens on 384 warps).
* **Bulk-copy ring** (tma.cuh, :func:`ring_split`): one thread per block walks its items at
  ``tma_item_us`` each, plus ``tma_store_us`` per further store of a fan-out; the phase ends at
  the later of that and its byte flows. The per-item cost is row-size independent, which is why
  bulk copies of Qwen3's 4 KiB rows run at a quarter of the bytes per second of DeepSeek-V3's
  14 KiB rows. A ring over the padded receive buffer (pull dispatch) also walks the padding
  items, in runs (the tail of each expert region) that every block reaches together: no bytes
  move meanwhile, so they add ``tma_pad_us`` each after the rows' time instead of overlapping it.
* **Row ring of dedup_sum** (:func:`sum_ring_turns`): a block keeps ``stages`` output rows in
  flight and a stage frees only when its peer rows have arrived and its consumer warp has
  summed them, so the block retires ``stages`` rows per ``sum_ring_turn_us``; the phase ends at
  the later of that and its byte flows (DeepSeek-V3: NVLink-bound; Qwen3's 4 KiB rows:
  turnover-bound).
* **Warp row rounds** (:func:`warp_row_scale`): a warp copies a row in latency rounds of 4 KiB
  (8 x 16 B per lane); warp_copy_row ends with a tail loop of one vector per lane per round (7
  rounds for 14 KiB rows, 1 for 4 KiB), and every row starts with ``warp_lookup_rounds`` of
  index loads. The per-SM rate scales with bytes per round, relative to 16 KiB rows.

Fixed costs and host floor (:class:`KernelProfile`): every kernel call pays ``call_fixed_us``
(launch, pipeline fill/drain, final fence + signal), every cross-GPU wait the probed flag latency
plus ``handshake_us``; the schedule kernel is that plus ``schedule_fixed_us`` (its grid barriers
and 64-token chunk walk) and ``schedule_load_us`` per dependent load of its two one-thread scans
(one per 64-token chunk, one per expert: :func:`schedule_serial_loads`). The benchmark times
back-to-back Python calls with CUDA events: the start event sits right behind the previous kernel,
so a run measures max(host time of its calls, device time), the host time per call depending on the
Python entry point (``host_floor_us``: dispatch, fanout, dedup_partials, dedup_sum, combine,
schedule). Skew: per-rank row and per-expert counts come from ``make_routing`` with the row's
routing seed (:func:`mok.spec.rows.row_routing_seed`: its ``routing_seed`` column, else the
benchmarks' rule, the tokens per rank).

Every knob is fitted by :func:`sim.comm.fit.fit_kernel_profile` on the fit rows
(:func:`sim.measured.is_fit_row`: the 4096-token rows of ``h200x2-comm-grid-v4-2026-11-30.csv``,
the grid of the current kernels) and stored in ``sim/profiles/mok-comm-h200x2.json``; its 512-
and 16384-token rows are validation only.

Row -> prediction mapping: :data:`PREDICTORS` is keyed by the CSV's ``what``; a megakernel layer
sweep adds a ``"layer"`` entry that maps its row to :func:`sim.layer.model.simulate`.
"""

from __future__ import annotations

from collections.abc import Callable

from mok.spec.rows import bench_routing_seed, row_routing_seed
from mok.spec.workload import get_shape
from sim.comm.catalog import KERNELS, KernelSpec, kernel_engine, kernel_key
from sim.comm.profile import KernelProfile
from sim.comm.rates import phase_rates
from sim.comm.rows import (
    MIN_STAGES,
    WARPS_PER_SM,
    busiest_share,
    counts_for,
    loop_rows,
    ring_split,
    ring_stores,
    sum_ring_stages,
    sum_ring_turns,
    warp_row_scale,
)
from sim.config import SimConfig, Workload
from sim.core.engine import Graph, run_graph
from sim.core.transfer import TransferBuilder

__all__ = [
    "PhaseBuilder",
    "PREDICTORS",
    "build_kernel_graph",
    "device_kernel_us",
    "predict_kernel_us",
    "predict_row",
    "host_bound",
    "host_us",
    "num_calls",
    "schedule_device_us",
    "schedule_serial_loads",
    "schedule_us",
    "SCHEDULE_CHUNK_TOKENS",
]


# -- the graph --------------------------------------------------------------------------------
class PhaseBuilder(TransferBuilder):
    """The transfer machinery (:class:`sim.core.transfer.TransferBuilder`) with the comm rates
    of one kernel phase at a time (:meth:`set_phase_rates`)."""

    def __init__(self, wl: Workload, cfg: SimConfig, prof: KernelProfile) -> None:
        super().__init__(wl.topo, wl.ep, cfg.push_latency_fraction, cfg.flow_granularity)
        self.wl, self.cfg, self.prof = wl, cfg, prof

    def set_phase_rates(self, knob: str, sms: float, scale: float = 1.0) -> None:
        """Comm-engine payload rates (bytes/us) of kernel ``knob`` run as if on ``sms`` SMs (the
        busiest warps' share of the grid, :func:`busiest_share`), each at the probe's per-SM
        rate x the kernel's in-flight factor x ``scale`` (the row-size scale of its warp
        routine): :func:`sim.comm.rates.phase_rates`."""
        self.rates = phase_rates(self.gpu, self.topo, self.prof, knob, sms, scale)


def build_kernel_graph(
    spec: KernelSpec,
    engine: str,
    model: str,
    tokens: int,
    num_ranks: int,
    skew: str,
    sms: int,
    prof: KernelProfile,
    seed: int | None = None,
) -> tuple[PhaseBuilder, Graph]:
    """The task graph of one standalone run of ``spec`` on ``engine``, on the routing trace of
    ``seed`` (None: the one the benchmarks draw for this batch size,
    :func:`mok.spec.rows.bench_routing_seed`; a measured row's: :func:`row_routing_seed`)."""
    if seed is None:
        seed = bench_routing_seed(tokens)
    wl = Workload(model, tokens, num_ranks, prof.topology, skew)
    if sms < 1 or sms > wl.topo.gpu.num_sms:
        raise ValueError(f"sms={sms} outside 1..{wl.topo.gpu.num_sms}")
    cfg = SimConfig(num_comm_sms=sms, mechanism="tma" if engine == "tma" else "st")
    b = PhaseBuilder(wl, cfg, prof)
    c = counts_for(model, tokens, num_ranks, skew, seed)
    row_bytes = float(wl.model_shape.hidden * 2)
    g = b.g
    prev: list[int | None] = [None] * num_ranks
    start = [g.delay(prof.call_fixed_us, [], r, "launch") for r in range(num_ranks)]
    for i, ph in enumerate(spec.phases):
        eng = kernel_engine(ph.knob)  # a composite's phases run their own kernels' engines
        ring = eng == "tma" and ph.routine in ("copy", "fan")
        sum_stages = sum_ring_stages(row_bytes, num_ranks) if ph.routine == "ring_sum" else 0
        # NOTE: too few stages for whole rows (many ranks): the chunked reduce pipeline runs
        sum_ring = eng == "tma" and sum_stages >= MIN_STAGES
        # a phase waits for every rank's previous phase when it needs their signals
        barrier = [p for p in prev if p is not None] if ph.remote_waits else []
        for r in range(num_ranks):
            rows = loop_rows(c, r, ph.loop)
            if eng == "tma":  # blocks stride the items evenly; the ring's issue bound is below
                b.set_phase_rates(ph.knob, sms)
            else:  # one row per warp: the busiest warps set the time
                share = busiest_share(rows, sms * WARPS_PER_SM)
                lam = prof.warp_lookup_rounds.get(ph.routine, 0.0)
                scale = warp_row_scale(ph.routine, row_bytes, lam) if eng == "vector" else 1.0
                b.set_phase_rates(ph.knob, sms / share, scale)
            deps = [start[r], prev[r], *barrier]
            skew = prof.handshake_us if ph.rendezvous else 0.0
            wait = ph.remote_waits * (b.flag_remote + skew)
            wait += prof.call_fixed_us if ph.new_launch else 0.0
            if i and ph.remote_waits:
                wait += b.fence
            pre = g.delay(wait, deps, r, "signal", i) if wait > 0 else g.join(deps, r, "join", i)
            x = ph.bytes_fn(c, r)
            local = (x.local_read + x.local_write) / 2 * row_bytes
            if x.nv_in.any():
                t = b.transfer(r, "pull", True, x.nv_in * row_bytes, local, [pre], r, "phase", i)
            else:
                t = b.transfer(r, "push", False, x.nv_out * row_bytes, local, [pre], r, "phase", i)
            if ring:  # the one issuing thread walks its items (+ extra stores of a fan-out)
                real, pad = ring_split(rows, sms)
                item = prof.tma_item_us + (ring_stores(c, r, ph.routine) - 1) * prof.tma_store_us
                issue = g.delay(real * item, [pre], r, "issue", i)
                t = g.join([t, issue], r, "phase", i)
                if pad and prof.tma_pad_us > 0:  # padding runs: no bytes move meanwhile
                    t = g.delay(pad * prof.tma_pad_us, [t], r, "phase", i)
            if sum_ring:  # each block retires `stages` rows per stage turnover
                turns = sum_ring_turns(rows, sms, sum_stages)
                issue = g.delay(turns * prof.sum_ring_turn_us, [pre], r, "issue", i)
                t = g.join([t, issue], r, "phase", i)
            prev[r] = t
    return b, g


def device_kernel_us(
    key: tuple[str, str, str],
    model: str,
    tokens: int,
    num_ranks: int,
    skew: str,
    sms: int,
    prof: KernelProfile,
    seed: int | None = None,
) -> float:
    """Device time (us, the slowest rank) of one standalone run of kernel ``key`` on the routing
    trace of ``seed`` (as :func:`build_kernel_graph`)."""
    spec = KERNELS[key]
    b, g = build_kernel_graph(spec, key[2], model, tokens, num_ranks, skew, sms, prof, seed)
    return run_graph(g, b.topo.capacities(b.gpu)).makespan_us


def predict_kernel_us(
    key: tuple[str, str, str],
    model: str,
    tokens: int,
    num_ranks: int,
    skew: str,
    sms: int,
    prof: KernelProfile,
    seed: int | None = None,
) -> float:
    """Predicted time (us, the slowest rank) of one standalone kernel run as the benchmark times
    it: max(host time of its Python calls, device time) (see :func:`host_bound`)."""
    dev = device_kernel_us(key, model, tokens, num_ranks, skew, sms, prof, seed)
    return host_bound(dev, KERNELS[key], prof)


def num_calls(spec: KernelSpec) -> int:
    """Python calls (= kernel launches) of one measured run."""
    return len(spec.calls)


def host_us(spec: KernelSpec | None, prof: KernelProfile) -> float:
    """Host time of one measured run: the sum over its Python calls (schedule: one call)."""
    return sum(prof.host_us(e) for e in (("schedule",) if spec is None else spec.calls))


def host_bound(device_us: float, spec: KernelSpec | None, prof: KernelProfile) -> float:
    """What back-to-back CUDA-event timing sees: the start event is enqueued right behind the
    previous call's kernel and the host spends :func:`host_us` per run before the next kernel
    reaches the GPU, so a run shorter than its host time measures the host time and a longer
    one its device time (not their sum: the host work overlaps the previous kernel).

    NOTE: a queue model of the timing loop (launch latency exposed on top of the device time
    when the stream idles, host jitter, the untimed dedup_sum after dedup_partials) was tried;
    fitted on the fit rows its extra knobs all came out 0, so it is not used."""
    return max(device_us, host_us(spec, prof))


# -- row -> prediction ------------------------------------------------------------------------
def _comm_row(row: dict, prof: KernelProfile) -> tuple[float, str, float]:
    key = kernel_key(row)
    if key is None:
        raise LookupError(
            f"no kernel model for what={row.get('what')!r} mode={row.get('mode')!r} "
            f"engine={row.get('engine', '-')!r}"
        )
    dev = device_kernel_us(
        key,
        row["model"],
        int(row["tokens_per_rank"]),
        int(row.get("num_ranks") or 2),
        row["skew"],
        int(row["sms"]),
        prof,
        row_routing_seed(row),
    )
    return host_bound(dev, KERNELS[key], prof), KERNELS[key].name, dev


# mok.workspace._CHUNK_TOKENS: the schedule kernel histograms and walks tokens in chunks of 64
SCHEDULE_CHUNK_TOKENS = 64


def schedule_serial_loads(tokens: int, model: str | None = None) -> int:
    """Dependent loads of the schedule kernel's two one-thread scans (csrc/schedule.cuh phase
    2): one per token chunk (the histogram scan of each (expert, rank)), then one per (rank,
    local expert), i.e. one per expert (the padded region offsets of a rank, one thread per
    rank, counts summed over the ranks one load at a time). Without ``model`` the second scan
    is left out."""
    chunks = -(-int(tokens) // SCHEDULE_CHUNK_TOKENS)
    return chunks + (0 if model is None else get_shape(model).num_experts)


def schedule_device_us(tokens: int, prof: KernelProfile, model: str | None = None) -> float:
    """The schedule kernel on the device: one call (fixed cost + the route-ready handshake with
    the peer), its grid barriers and chunk walk (``schedule_fixed_us``), and its serial scans
    (:func:`schedule_serial_loads` x ``schedule_load_us``): 64 + 256 loads for DeepSeek-V3 at
    4096 tokens per rank, 64 + 128 for Qwen3."""
    loads = schedule_serial_loads(tokens, model)
    fixed = prof.call_fixed_us + prof.handshake_us + prof.schedule_fixed_us
    return fixed + prof.schedule_load_us * loads


def schedule_us(tokens: int, prof: KernelProfile, model: str | None = None) -> float:
    """The schedule kernel as the benchmark measures it (:func:`host_bound`)."""
    return host_bound(schedule_device_us(tokens, prof, model), None, prof)


def _schedule_row(row: dict, prof: KernelProfile) -> tuple[float, str, float]:
    args = (int(row["tokens_per_rank"]), prof, row["model"])
    return schedule_us(*args), "schedule", schedule_device_us(*args)


# what -> predictor(row, profile) -> (predicted us, kernel name, device us); LookupError = not
# modelled. A megakernel layer CSV registers "layer" here (row -> Workload + SimConfig ->
# simulate()).
PREDICTORS: dict[str, Callable[[dict, KernelProfile], tuple[float, str, float]]] = {
    "schedule": _schedule_row,
    "dispatch": _comm_row,
    "combine": _comm_row,
}


def predict_row(row: dict, prof: KernelProfile) -> tuple[float, str, float]:
    """(predicted us, kernel name, device us) of a measured row; LookupError if no model
    covers it. The prediction is what the benchmark measures (the host floor included), the
    device time is the kernel alone."""
    if row.get("impl", "mok") != "mok":
        raise LookupError(f"impl={row.get('impl')!r} is not a mok kernel")
    fn = PREDICTORS.get(row.get("what", ""))
    if fn is None:
        raise LookupError(f"no predictor for what={row.get('what')!r}")
    return fn(row, prof)
