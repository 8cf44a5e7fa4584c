"""The probe's results: what each measurement means (:data:`METHODS`), the sections
(:data:`SECTIONS`) and :class:`ProbeResults`, the JSON / CSV writer, the printed table of
``python -m mok.bench probe`` and the reader of a probe JSON (:meth:`ProbeResults.read`).

Pure Python: the CPU tests build one from synthetic numbers and read the committed probe files.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import re
from pathlib import Path

__all__ = ["SECTIONS", "METHODS", "POLL_MODES", "FENCES", "ProbeResults", "distribution"]

SECTIONS = (
    "hbm",
    "gemm",
    "grouped",
    "local",
    "peer",
    "green",
    "poll_cost",
    "fence_cost",
    "block_skew",
    "signal_jitter",
)
# poll_cost modes and fence_cost fences, in the order of csrc/probe/probe.h (mode / fence codes)
POLL_MODES = ("warp", "thread", "thread_per_flag")
FENCES = ("sc", "acq_rel", "release")

METHODS = {
    "p2p_access": "1 where rank 0 and rank 1 map each other's memory (torch symmetric memory, no "
    "multicast; torch.cuda.can_device_access_peer where one process sees both GPUs).",
    "signal_latency": "one thread per block, ping-pong on a uint64 flag with st.release.sys.global "
    "/ ld.acquire.sys.global (the poller reads its own memory, the poster stores into the "
    "other's); untimed warm-up round trips absorb the launch skew, then N round trips timed with "
    "%globaltimer; median of 3 launches; one_way = round_trip/2. '0<->1' = GPU0 and GPU1 (one "
    "block each), '0<->0' = two blocks of one kernel on two SMs of GPU0.",
    "signal_latency_gpu_scope": "as signal_latency '0<->0' with st.release.gpu / ld.acquire.gpu "
    "(the scope mok's kernels use between SMs of one GPU).",
    "remote_load_latency": "one thread chases a random cyclic permutation (one 8-byte link per "
    "64-byte line) with ld.global.cv: untimed warm-up, then N dependent loads timed with "
    "%globaltimer; readerX_memY = GPU X reading memory of GPU Y; buffer size in the key.",
    "p2p_bandwidth_by_sms": "grid-stride copy with 16-byte (int4) accesses, one block of 1024 "
    "threads per SM (> half the SM's shared memory reserved, so blocks never share an SM), rank 0 "
    "only. push = read local, write peer; pull = read peer, write local; local = both on one GPU. "
    "Copy size max(256 MiB, 32 MiB per SM) up to the --copy-mib cap. GB/s = bytes copied / time "
    "(one direction). memcpyPeer = copy engine (Tensor.copy_ into the peer's symmetric buffer).",
    "p2p_bidirectional_by_sms": "both GPUs copy towards (push) or from (pull) the other at the "
    "same time with the 16-byte kernel; per_direction = bytes one GPU moved / the slower GPU's "
    "median time; both_directions = 2 x per_direction.",
    "tma_bulk_by_sms": "cp.async.bulk (non-tensor TMA) copies in chunks of 2 KiB or 16 KiB: one "
    "block per SM, one thread keeps 8 global->shared bulk loads in flight (mbarrier complete_tx, a "
    "ring of 12 stages) and stores each chunk with a shared->global bulk store (up to 4 stores "
    "still reading shared memory). pull = load from "
    "peer, store local; push = load local, store to peer; bidir = both GPUs at once (GB/s per "
    "direction); local = both on one GPU. pull_copy_correct: checksum after a pull.",
    "copy_checks": "after the largest SM count, the destination is poisoned, copied once more and "
    "its int64 checksum compared with the source's (true = equal).",
    "bf16_gemm_and_copy": "torch.mm 8192x8192x8192 bf16 on random data, median; *_sustained: "
    "the same after sustained_warm_s seconds of untimed calls (the GPU at its power-capped "
    "clock), sustained_sm_mhz the median SM clock sampled during its timed calls; d2d copy "
    "(Tensor.copy_) of hbm_bandwidth.bytes counting read+write.",
    "hbm_bandwidth": "copy_GBps_rw: Tensor.copy_ between two device buffers, bytes read + "
    "written / time; read_GBps: a 16-byte load kernel over the buffer (2 blocks of 1024 threads "
    "per SM, 4 loads in flight per thread); write_GBps: Tensor.fill_ of the buffer.",
    "nccl_all_to_all": "torch.distributed all_to_all_single, even splits, bf16 rows of 7168; each "
    "rank sends `tokens` rows to every rank; GBps_out_per_gpu = bytes sent to other ranks / time.",
    "grouped_gemm_by_rows": "torch._grouped_mm bf16 (2-D tokens x 3-D weights [E, N, K] "
    "transposed, equal rows per expert, offs = cumulative rows) on all SMs: gate_up = [E*rows, "
    "hidden] x [hidden, 2*intermediate], down = [E*rows, intermediate] x [intermediate, hidden]; "
    "weight sets rotated so that they exceed 3x L2; TFLOP/s = 2*E*rows*N*K / median time.",
    "grouped_gemm_by_sms": "same GEMMs at rows_per_expert, limited to `sms` SMs through torch's "
    "SM carveout (torch._C._set_sm_carveout_experimental(num_sms - sms)), which sets the SM count "
    "of the persistent CUTLASS grouped kernel (its grid); sm_limit_effective says whether the "
    "fewest SMs ran measurably slower than all SMs (else the carveout had no effect).",
    "grouped_gemm_by_sms_green": "cross-check of grouped_gemm_by_sms on the first shape: the GEMM "
    "runs inside a CUDA green context of `sms` SMs (torch.cuda.green_contexts), i.e. a hardware "
    "SM partition; timed with CUDA events on that context's stream, this rank only. The kernel "
    "still sizes its persistent grid for all SMs, so its CTAs run in waves over the partition: "
    "expect less than the carveout numbers.",
    "poll_cost": "ns per sweep over K packed uint64 flags (K in the key) that already hold their "
    "target, so a sweep never waits: ld.acquire at gpu / sys scope (the key above the mode); "
    "warp = one warp, flag j on lane j % 32, a warp vote per sweep; thread = one thread loads the "
    "K flags in turn (the pattern of block_wait_all in csrc/common/waits.cuh); thread_per_flag = "
    "K threads, one flag each, a block vote (__syncthreads_and) per sweep. One block, untimed "
    "warm-up sweeps, then --poll-sweeps timed with %globaltimer; median of 3 launches.",
    "fence_cost": "n blocks of 1024 threads, one per SM (n in the key under the fence), each "
    "stores bytes_per_sm (the innermost key) with 16-byte stores into its slice of local memory "
    "(local) or of a second GPU visible to the process (peer), then a barrier and the publication "
    "of the communication kernels: sc = every thread fence.sc.sys (__threadfence_system), "
    "barrier, thread 0 fence.sc.sys + st.release.sys of its flag; acq_rel = the same with "
    "fence.acq_rel.sys; release = barrier, thread 0 st.release.sys only. fence_us: from the "
    "barrier after the stores to after the flag store, %clock64 of the block converted with the "
    "SM clock the block measured against %globaltimer over its life (held >= 50 us); median "
    "over blocks, then median of --iters launches after one untimed; fence_max_us: the same "
    "with the slowest block; store_us: entry to the barrier after the stores.",
    "block_skew": "a cooperative launch (as mok's persistent kernels) of blocks_per_sm (key) x "
    "SMs blocks of 128 threads, shared memory reserved so at most that many share an SM; thread "
    "0 stamps %globaltimer at entry and holds its SM for 20 us. Per launch the spread is the "
    "latest entry minus the earliest; spread_us = median and spread_max_us = max over --iters x "
    "2 launches; p50 / p90 / p99 of every block's entry after its launch's earliest; sms_seen = "
    "distinct %smid; timer_step_ns = smallest non-zero step between consecutive %globaltimer "
    "reads (the resolution every globaltimer number here has at best).",
    "signal_jitter": "as signal_latency '0<->0' (two blocks of one GPU, one thread each, flag "
    "ping-pong at sys / gpu scope), with every round trip recorded: %clock64 cycles of each of "
    "--latency-iters round trips (at most 28672) after the warm-up, kept in shared memory and "
    "converted with the SM clock measured over the loop (%clock64 / %globaltimer); one launch. "
    "round_trip_us: min / p50 / mean / p90 / p99 / max / std of the round trips; "
    "one_way_jitter_mean_us = (mean - min) / 2, the mean delay of one completion above the "
    "fastest (two completions per round trip).",
}


# ---- the JSON writer and reader ----------------------------------------------------------------
class ProbeResults:
    """The probe JSON (nested, keys and units of the committed probe) plus flat rows for the
    printed table and the CSV."""

    def __init__(self, meta: dict):
        self.meta = dict(meta)
        self.results: dict = {}
        self.skipped: dict[str, str] = {}
        self.rows: list[dict] = []

    def _row(self, family: str, case: str, x, value: float, unit: str) -> None:
        self.rows.append({"family": family, "case": case, "x": x, "value": value, "unit": unit})

    def _at(self, *path: str) -> dict:
        d = self.results
        for p in path:
            d = d.setdefault(p, {})
        return d

    def add_p2p_access(self, pairs: dict[str, int]) -> None:
        self._at("p2p_access").update({k: int(v) for k, v in pairs.items()})

    def add_copy(
        self,
        kind: str,
        mech: str,
        num_sms: int,
        gbps: float,
        *,
        bidir: bool = False,
        chunk: int | None = None,
    ) -> None:
        """``kind``: push / pull / local; ``mech``: st (16-byte kernel) or tma (needs chunk);
        ``gbps``: payload GB/s of one direction."""
        if kind not in ("push", "pull", "local") or mech not in ("st", "tma"):
            raise ValueError(f"unknown copy {kind}/{mech}; supported: push|pull|local, st|tma")
        if kind == "local" and bidir:
            raise ValueError("a local copy has no second direction")
        n, v = str(int(num_sms)), round(float(gbps), 1)
        if mech == "st" and bidir:
            self._at("p2p_bidirectional_by_sms", kind)[n] = {
                "per_direction_GBps": v,
                "both_directions_GBps": round(2 * float(gbps), 1),
            }
        elif mech == "st":
            self._at("p2p_bandwidth_by_sms", kind)[n] = v
        else:
            if not chunk:
                raise ValueError("a TMA copy point needs its chunk size")
            key = f"{kind}_{'bidir' if bidir else 'onedir'}_chunk{int(chunk)}"
            self._at("tma_bulk_by_sms", key)[n] = v
        case = f"{kind} {mech}{chunk or ''} {'bidir/dir' if bidir else 'onedir'}"
        self._row("copy", case, int(num_sms), v, "GB/s")

    def add_copy_check(self, name: str, ok: bool) -> None:
        self._at("copy_checks")[name] = bool(ok)
        if name.startswith("pull_tma"):  # the committed probe's flag: every TMA pull was right
            tma = self._at("tma_bulk_by_sms")
            tma["pull_copy_correct"] = tma.get("pull_copy_correct", True) and bool(ok)
        self._row("check", name, None, float(ok), "ok")

    def add_memcpy_peer(self, gbps: float) -> None:
        self._at("p2p_bandwidth_by_sms")["memcpyPeer_GBps"] = round(float(gbps), 1)
        self._row("copy", "memcpyPeer (copy engine)", None, round(float(gbps), 1), "GB/s")

    def add_signal(self, pair: str, round_trip_us: float, *, gpu_scope: bool = False) -> None:
        key = "signal_latency_gpu_scope" if gpu_scope else "signal_latency"
        rt = float(round_trip_us)
        self._at(key)[pair] = {"round_trip_us": round(rt, 5), "one_way_us": round(rt / 2, 5)}
        self._row(
            "latency",
            f"flag one-way {pair} {'gpu' if gpu_scope else 'sys'}",
            None,
            round(rt / 2, 3),
            "us",
        )

    def add_load_latency(self, reader: int, mem: int, size_mb: int, ns: float) -> None:
        key = f"reader{reader}_mem{mem}_{int(size_mb)}MB_ns"
        self._at("remote_load_latency")[key] = round(float(ns), 2)
        self._row(
            "latency",
            f"dependent load GPU{reader}->mem{mem} {size_mb}MB",
            None,
            round(float(ns), 1),
            "ns",
        )

    def add_poll_cost(self, scope: str, mode: str, num_flags: int, ns_per_sweep: float) -> None:
        """One poll_cost point: ``scope`` gpu / sys, ``mode`` one of :data:`POLL_MODES`."""
        if scope not in ("gpu", "sys") or mode not in POLL_MODES:
            raise ValueError(
                f"unknown poll point {scope}/{mode}; supported: gpu|sys, {'|'.join(POLL_MODES)}"
            )
        ns = round(float(ns_per_sweep), 1)
        self._at("poll_cost", scope, mode)[str(int(num_flags))] = ns
        self._row("poll", f"{mode} {scope} ns/sweep", int(num_flags), ns, "ns")

    def add_fence_cost(
        self,
        target: str,
        fence: str,
        num_sms: int,
        bytes_per_sm: int,
        fence_us: float,
        fence_max_us: float,
        store_us: float,
    ) -> None:
        """One fence_cost point: ``target`` local / peer, ``fence`` one of :data:`FENCES`."""
        if target not in ("local", "peer") or fence not in FENCES:
            raise ValueError(
                f"unknown fence point {target}/{fence}; supported: local|peer, {'|'.join(FENCES)}"
            )
        pt = {
            "fence_us": round(float(fence_us), 4),
            "fence_max_us": round(float(fence_max_us), 4),
            "store_us": round(float(store_us), 3),
        }
        self._at("fence_cost", target, fence, str(int(num_sms)))[str(int(bytes_per_sm))] = pt
        case = f"{target} {fence} fence us at {int(num_sms)} SMs"
        self._row("fence", case, int(bytes_per_sm), pt["fence_us"], "us")

    def add_block_skew(self, blocks_per_sm: int, stats: dict) -> None:
        """One block_skew entry: blocks, sms_seen, launches, spread_us, spread_max_us, p50_us,
        p90_us, p99_us, timer_step_ns."""
        ints = ("blocks", "sms_seen", "launches")
        entry = {k: int(v) if k in ints else round(float(v), 4) for k, v in stats.items()}
        self._at("block_skew")[str(int(blocks_per_sm))] = entry
        case = f"start spread {int(blocks_per_sm)} block(s)/SM"
        self._row("skew", case, None, entry["spread_us"], "us")

    def add_signal_jitter(self, pair: str, scope: str, samples: int, round_trip_us: dict) -> None:
        """Recorded round trips of a flag ping-pong: ``round_trip_us`` as :func:`distribution`
        gives it (min, p50, mean, p90, p99, max, std)."""
        if scope not in ("gpu", "sys"):
            raise ValueError(f"unknown scope {scope!r}; supported: gpu, sys")
        rt = {k: round(float(v), 5) for k, v in round_trip_us.items()}
        self._at("signal_jitter", scope)[pair] = {
            "samples": int(samples),
            "round_trip_us": rt,
            "one_way_jitter_mean_us": round((rt["mean"] - rt["min"]) / 2, 5),
        }
        for stat in ("p50", "p99"):
            case = f"flag round trip {stat} {pair} {scope}"
            self._row("latency", case, None, round(rt[stat], 3), "us")
        jitter = round((rt["mean"] - rt["min"]) / 2, 4)
        self._row("latency", f"flag one-way jitter mean {pair} {scope}", None, jitter, "us")

    def add_bf16_gemm(self, tflops: float) -> None:
        self._at("bf16_gemm_and_copy")["bf16_tflops"] = round(float(tflops), 1)
        self._row("gemm", "bf16 matmul 8192^3", None, round(float(tflops), 1), "TFLOP/s")

    def add_bf16_gemm_sustained(self, tflops: float, sm_mhz: float | None, warm_s: float) -> None:
        at = self._at("bf16_gemm_and_copy")
        at["bf16_tflops_sustained"] = round(float(tflops), 1)
        at["sustained_warm_s"] = float(warm_s)
        case = "bf16 matmul 8192^3 sustained"
        self._row("gemm", case, None, round(float(tflops), 1), "TFLOP/s")
        if sm_mhz is not None:
            at["sustained_sm_mhz"] = round(float(sm_mhz), 1)
            self._row("gemm", f"{case} SM clock", None, round(float(sm_mhz), 1), "MHz")

    def add_hbm(self, nbytes: int, copy_rw_gbps: float, read_gbps: float, write_gbps: float):
        rw = round(float(copy_rw_gbps), 1)
        self._at("hbm_bandwidth").update(
            bytes=int(nbytes),
            copy_GBps_rw=rw,
            read_GBps=round(float(read_gbps), 1),
            write_GBps=round(float(write_gbps), 1),
        )
        self._at("bf16_gemm_and_copy")["d2d_copy_GBps_rw"] = rw
        for case, v in (("copy (read+write)", rw), ("read", read_gbps), ("write", write_gbps)):
            self._row("hbm", case, None, round(float(v), 1), "GB/s")

    def add_a2a(self, tokens: int, ms: float, gbps: float) -> None:
        self._at("nccl_all_to_all")[str(int(tokens))] = {
            "ms": round(float(ms), 4),
            "GBps_out_per_gpu": round(float(gbps), 1),
        }
        self._row("nccl", "all_to_all_single GB/s out", int(tokens), round(float(gbps), 1), "GB/s")

    def add_grouped(
        self,
        shape: str,
        hidden: int,
        intermediate: int,
        num_experts: int,
        op: str,
        rows_per_expert: int,
        num_sms: int,
        us: float,
        *,
        by: str = "rows",
        method: str = "carveout",
    ) -> float:
        """One grouped-GEMM point; returns its TFLOP/s. ``by``: rows (all SMs) or sms."""
        if op not in ("gate_up", "down"):
            raise ValueError(f"unknown grouped GEMM op {op!r}; supported: gate_up, down")
        k, n = (hidden, 2 * intermediate) if op == "gate_up" else (intermediate, hidden)
        tflops = 2.0 * num_experts * rows_per_expert * n * k / (us * 1e-6) / 1e12
        point = {"us": round(float(us), 2), "tflops": round(tflops, 1)}
        info = {"hidden": hidden, "intermediate": intermediate, "num_experts": num_experts}
        if by == "rows":
            entry = self._at("grouped_gemm_by_rows", shape)
            entry.update(info, num_sms=int(num_sms))
            entry.setdefault(op, {})[str(int(rows_per_expert))] = point
            self._row(
                "grouped",
                f"{shape} {op} TFLOP/s by rows",
                rows_per_expert,
                point["tflops"],
                "TFLOP/s",
            )
        elif by == "sms":
            key = "grouped_gemm_by_sms" + ("" if method == "carveout" else f"_{method}")
            entry = self._at(key, f"{shape}_rows{int(rows_per_expert)}")
            entry.update(info, rows_per_expert=int(rows_per_expert))
            entry.setdefault(op, {})[str(int(num_sms))] = point
            self._row(
                "grouped",
                f"{shape} {op} TFLOP/s by SMs ({method})",
                int(num_sms),
                point["tflops"],
                "TFLOP/s",
            )
        else:
            raise ValueError(f"by must be 'rows' or 'sms' (found {by!r})")
        return tflops

    def mark_sm_limit(self, key: str, case: str, effective: bool, ratio: float) -> None:
        entry = self._at(key, case)
        entry["sm_limit_effective"] = bool(effective)
        entry["time_ratio_fewest_to_all_sms"] = round(float(ratio), 3)

    def skip(self, part: str, reason: str) -> None:
        self.skipped[part] = reason

    def what(self) -> str:
        m = self.meta
        text = (
            f"Microbenchmarks (python -m mok.bench probe) on {m.get('num_ranks', 1)}x "
            f"{m.get('gpu', '?')} ({m.get('num_sms', '?')} SMs, {m.get('l2_mb', '?')} MB L2), "
            f"driver {m.get('driver', '?')}, CUDA {m.get('cuda', '?')}, torch {m.get('torch', '?')}"
            f", mok {m.get('git_sha', '?')}. Measured {m.get('date', '?')}."
        )
        if m.get("quick"):
            text += " Quick smoke run (--quick): fewer points and repeats."
        if self.skipped:
            text += " Skipped: " + "; ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return text

    def to_json(self) -> dict:
        methods = {k: METHODS[k] for k in self.results if k in METHODS}
        return {
            "what": self.what(),
            "methods": methods,
            "results": self.results,
            "meta": self.meta,
            "skipped": self.skipped,
        }

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def write_csv(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in self.meta.items() if not isinstance(v, dict | list)}
        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["family", "case", "x", "value", "unit", *meta])
            w.writeheader()
            w.writerows({**r, **meta} for r in self.rows)

    @classmethod
    def from_json(cls, doc: dict) -> ProbeResults:
        """A probe JSON read back (one this writer wrote, or the older two-GPU probe without
        ``meta`` / ``skipped``): results, meta and skipped as in the document, the flat rows of
        :meth:`table` and :meth:`write_csv` rebuilt from the results (``what`` and ``methods``
        of :meth:`to_json` are this writer's). Raises ValueError for a document without a
        ``results`` object (a fitted GPU profile, say)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
            found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(
                f"not a probe JSON (found {found}): python -m mok.bench probe writes "
                "what / methods / results / meta / skipped"
            )
        res = cls(doc.get("meta") or {})
        _replay(res, doc["results"])
        res.results = copy.deepcopy(doc["results"])
        res.skipped = dict(doc.get("skipped") or {})
        return res

    @classmethod
    def read(cls, path: str | Path) -> ProbeResults:
        """:meth:`from_json` of a probe JSON file."""
        return cls.from_json(json.loads(Path(path).read_text()))

    def table(self) -> str:
        """One line per (family, case): a single value, or x1/x2/..: v1/v2/.. for sweeps."""
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in self.rows:
            groups.setdefault((r["family"], r["case"]), []).append(r)
        lines = []
        for (fam, case), rs in groups.items():
            unit = rs[0]["unit"]
            if rs[0]["x"] is None:
                vals = "/".join(_fmt(r["value"]) for r in rs)
                lines.append(f"{fam:<8} {case:<44} {vals} {unit}")
            else:
                xs = "/".join(str(r["x"]) for r in rs)
                vals = "/".join(_fmt(r["value"]) for r in rs)
                lines.append(f"{fam:<8} {case:<44} {xs}: {vals} {unit}")
        for part, reason in self.skipped.items():
            lines.append(f"skipped  {part}: {reason}")
        return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def distribution(values) -> dict[str, float]:
    """min, p50, mean, p90, p99, max and std (population) of ``values`` (quantiles linear
    between the two nearest ranks)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("distribution of no values")
    n = len(xs)

    def q(p: float) -> float:
        i = p * (n - 1)
        lo = math.floor(i)
        hi = min(lo + 1, n - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    return {
        "min": xs[0],
        "p50": q(0.5),
        "mean": mean,
        "p90": q(0.9),
        "p99": q(0.99),
        "max": xs[-1],
        "std": std,
    }


def _replay(res: ProbeResults, results: dict) -> None:
    """Feed every point of ``results`` through ``res``'s add_* calls (keys it does not know are
    left out of the rows)."""
    for key, v in results.items():
        if key == "p2p_access":
            res.add_p2p_access(v)
        elif key in ("signal_latency", "signal_latency_gpu_scope"):
            for pair, pt in v.items():
                res.add_signal(pair, pt["round_trip_us"], gpu_scope=key != "signal_latency")
        elif key == "remote_load_latency":
            for name, ns in v.items():
                m = re.fullmatch(r"reader(\d+)_mem(\d+)_(\d+)MB_ns", name)
                if m:
                    res.add_load_latency(int(m[1]), int(m[2]), int(m[3]), ns)
        elif key == "p2p_bandwidth_by_sms":
            for kind, pts in v.items():
                if kind == "memcpyPeer_GBps":
                    res.add_memcpy_peer(pts)
                else:
                    for n, gbps in pts.items():
                        res.add_copy(kind, "st", int(n), gbps)
        elif key == "p2p_bidirectional_by_sms":
            for kind, pts in v.items():
                for n, pt in pts.items():
                    res.add_copy(kind, "st", int(n), pt["per_direction_GBps"], bidir=True)
        elif key == "tma_bulk_by_sms":
            for name, pts in v.items():
                m = re.fullmatch(r"(\w+)_(onedir|bidir)_chunk(\d+)", name)
                if m:  # (pull_copy_correct: the copy checks' summary)
                    for n, gbps in pts.items():
                        res.add_copy(
                            m[1], "tma", int(n), gbps, bidir=m[2] == "bidir", chunk=int(m[3])
                        )
        elif key == "copy_checks":
            for name, ok in v.items():
                res.add_copy_check(name, ok)
        elif key == "bf16_gemm_and_copy":
            if "bf16_tflops" in v:
                res.add_bf16_gemm(v["bf16_tflops"])
            if "bf16_tflops_sustained" in v:
                res.add_bf16_gemm_sustained(
                    v["bf16_tflops_sustained"], v.get("sustained_sm_mhz"), v["sustained_warm_s"]
                )
            if "hbm_bandwidth" not in results and "d2d_copy_GBps_rw" in v:
                res._row("hbm", "copy (read+write)", None, v["d2d_copy_GBps_rw"], "GB/s")
        elif key == "hbm_bandwidth":
            res.add_hbm(v["bytes"], v["copy_GBps_rw"], v["read_GBps"], v["write_GBps"])
        elif key == "nccl_all_to_all":
            for tokens, pt in v.items():
                res.add_a2a(int(tokens), pt["ms"], pt["GBps_out_per_gpu"])
        elif key == "grouped_gemm_by_rows":
            for shape, e in v.items():
                info = (shape, e["hidden"], e["intermediate"], e["num_experts"])
                for op in ("gate_up", "down"):
                    for rows, pt in e.get(op, {}).items():
                        res.add_grouped(*info, op, int(rows), e["num_sms"], pt["us"])
        elif key.startswith("grouped_gemm_by_sms"):
            method = key[len("grouped_gemm_by_sms") :].lstrip("_") or "carveout"
            for case, e in v.items():
                info = (re.sub(r"_rows\d+$", "", case), e["hidden"], e["intermediate"])
                for op in ("gate_up", "down"):
                    for sms, pt in e.get(op, {}).items():
                        res.add_grouped(
                            *info, e["num_experts"], op, e["rows_per_expert"], int(sms), pt["us"],
                            by="sms", method=method,
                        )  # fmt: skip
                if "sm_limit_effective" in e:
                    ratio = e.get("time_ratio_fewest_to_all_sms", 0.0)
                    res.mark_sm_limit(key, case, e["sm_limit_effective"], ratio)
        elif key == "poll_cost":
            for scope, modes in v.items():
                for mode, pts in modes.items():
                    for k, ns in pts.items():
                        res.add_poll_cost(scope, mode, int(k), ns)
        elif key == "fence_cost":
            for target, fences in v.items():
                for fence, by_sms in fences.items():
                    for n, pts in by_sms.items():
                        for b, pt in pts.items():
                            res.add_fence_cost(
                                target, fence, int(n), int(b),
                                pt["fence_us"], pt["fence_max_us"], pt["store_us"],
                            )  # fmt: skip
        elif key == "block_skew":
            for k, stats in v.items():
                res.add_block_skew(int(k), stats)
        elif key == "signal_jitter":
            for scope, pairs in v.items():
                for pair, e in pairs.items():
                    res.add_signal_jitter(pair, scope, e["samples"], e["round_trip_us"])
