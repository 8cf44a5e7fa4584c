"""Pre-flight check of an expert-parallel group: ``torchrun --nproc-per-node=G [--nnodes ...]
-m mok.bench preflight`` on the GPUs mok will run on (for an NVL72 rack, every tray's GPUs).

Every pair of ranks is checked, in rounds of disjoint pairs (:func:`tournament`: R - 1 rounds
for R ranks, every rank in at most one pair per round, so the whole check takes time linear in
R):

* reachable: every rank maps every peer's symmetric buffer (torch symmetric memory; across
  hosts it needs fabric handles, see the README's NVL72 runbook) and reads the pattern the peer
  wrote into it;
* copy bandwidth: each rank of a pair pulls ``--mib`` from its partner's buffer with mok's 16-byte
  copy kernel on ``--sms`` SMs (both directions at once; median of ``--iters``), checked against
  the partner's bytes;
* flag round trip: the pair's lower rank stores a flag into its partner's memory and waits for
  the answer (system scope, mok's signalling), ``--rt-iters`` times; the median round trip.

Rank 0 prints one row per pair and a summary naming the pairs slower than the others (below
``SLOW_BANDWIDTH`` of the median bandwidth, or above ``SLOW_ROUND_TRIP`` of the median round
trip), and writes ``--csv`` (one row per pair, with the run's provenance). The exit status is 1
when a pair is unreachable, its copy is wrong or its flag never came back, else 0. On ranks
that share one GPU (``MOK_SHARED_GPU=1``) the check runs as a smoke test of the same code: the
reachability and copy checks hold, the timings are the time-sliced GPU's, not NVLink's (the
output says so).
"""

from __future__ import annotations

import argparse
import csv
import socket
import statistics
import sys

import torch
import torch.distributed as dist

from mok.bench.common import close_dist, init_dist, provenance, time_cuda_local
from mok.bench.probe.args import MIB
from mok.bench.probe.context import OUT_CODE, OUT_NS
from mok.errors import MoKUnsupportedError
from mok.ranks import shared_gpu

__all__ = ["PairResult", "build_parser", "main", "slow_pairs", "tournament"]

# A pair is reported slow below this share of the median bandwidth or above this multiple of
# the median round trip.
SLOW_BANDWIDTH = 0.7
SLOW_ROUND_TRIP = 1.5
_HEAD_WORDS = 512  # int64 words of the reachability pattern at the buffer's start
_FLAG_BYTES = 128  # one flag per round, a line apart


def tournament(num_ranks: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs (lower rank first) in which every unordered pair of ``num_ranks``
    ranks meets exactly once: the circle method (rank 0 fixed, the others rotating; a bye where
    the count is odd). ``num_ranks - 1`` rounds for an even count, ``num_ranks`` for an odd one,
    none for one rank."""
    if num_ranks < 1:
        raise ValueError(f"tournament: at least one rank, got {num_ranks}")
    seats: list[int | None] = list(range(num_ranks)) + ([None] if num_ranks % 2 else [])
    m = len(seats)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = seats[i], seats[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return [r for r in rounds if r]


class PairResult(dict):
    """One pair's row: rank_a < rank_b, their hosts, whether each maps the other, each
    direction's pull bandwidth (GB/s, a from b and b from a), whether both copies were right,
    the flag round trip (us; None when it timed out)."""

    FIELDS = (
        "rank_a", "rank_b", "host_a", "host_b", "reachable", "copy_ok",
        "gbps_a_from_b", "gbps_b_from_a", "round_trip_us",
    )  # fmt: skip


def _figures(rows: list[dict]) -> tuple[list[float], list[float]]:
    """(the slower direction's bandwidth of every pair whose copies were right, every round
    trip that came back)."""
    bws = [min(r["gbps_a_from_b"], r["gbps_b_from_a"]) for r in rows if r["copy_ok"]]
    rts = [r["round_trip_us"] for r in rows if r["round_trip_us"] is not None]
    return bws, rts


def slow_pairs(rows: list[dict]) -> list[tuple[dict, str]]:
    """The pairs whose bandwidth (the slower direction) is below ``SLOW_BANDWIDTH`` of the
    median, or whose round trip is above ``SLOW_ROUND_TRIP`` of the median, with why."""
    bws, rts = _figures(rows)
    med_bw = statistics.median(bws) if bws else 0.0
    med_rt = statistics.median(rts) if rts else 0.0
    slow = []
    for r in rows:
        why = []
        bw = min(r["gbps_a_from_b"], r["gbps_b_from_a"])
        if r["copy_ok"] and bw < SLOW_BANDWIDTH * med_bw:
            why.append(f"{bw:.0f} GB/s against a median of {med_bw:.0f}")
        rt = r["round_trip_us"]
        if rt is not None and rt > SLOW_ROUND_TRIP * med_rt:
            why.append(f"round trip {rt:.2f} us against a median of {med_rt:.2f}")
        if why:
            slow.append((r, "; ".join(why)))
    return slow


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node=G -m mok.bench preflight",
        description="Check every pair of ranks: NVLink-reachable (symmetric memory), copy "
        "bandwidth, flag round trip. Exit status 1 when a pair fails.",
    )
    ap.add_argument("--mib", type=int, default=None,
                    help="MiB pulled per copy (default 256; 16 on shared-GPU ranks)")  # fmt: skip
    ap.add_argument("--sms", type=int, default=32, help="SMs of each copy (default 32)")
    ap.add_argument("--iters", type=int, default=5, help="timed copies per pair (median)")
    ap.add_argument(
        "--rt-iters", type=int, default=None,
        help="flag round trips per pair (default 2000; 20 on shared-GPU ranks)",
    )  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=10.0, help="bound of each flag wait")
    ap.add_argument("--csv", default=None, help="one row per pair (rank 0)")
    return ap


def _pattern(rank: int, device) -> torch.Tensor:
    return torch.arange(_HEAD_WORDS, dtype=torch.int64, device=device) + rank * 1_000_003


def _say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _rendezvous(nbytes: int, dev):
    """(this rank's symmetric buffer, its handle), or MoKUnsupportedError saying what symmetric
    memory across these ranks needs."""
    import torch.distributed._symmetric_memory as symm_mem

    try:
        sym = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
        return sym, symm_mem.rendezvous(sym, group=dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds; the text is the point
        raise MoKUnsupportedError(
            f"preflight: torch symmetric memory could not map the ranks' buffers ({e}). Within "
            "one host it maps peers through file descriptors; across the trays of an NVLink "
            "rack it needs fabric handles (IMEX channels set up on every tray, the driver's "
            "fabric manager running): see the README's NVL72 runbook"
        ) from e


def _round_trip(ext, mine: int, theirs: int, ping: bool, iters: int, timeout_ns: int, out,
                stream) -> float | None:  # fmt: skip
    """The pair's flag ping-pong (system scope; csrc/probe/probe.cu); us per round trip on the
    pinging rank (0.0 on the other), None on a timeout."""
    warm = max(2, iters // 20)
    out.zero_()
    err = ext.probe_pingpong(mine, theirs, 0, 0, 1, 0 if ping else -1, 0, warm, iters, 0,
                             timeout_ns, out.data_ptr(), stream)  # fmt: skip
    if err:
        raise MoKUnsupportedError(f"preflight: the ping-pong kernel failed to launch (error {err})")
    torch.cuda.synchronize()
    if out[OUT_CODE].item():
        return None
    return out[OUT_NS].item() / iters / 1e3 if ping else 0.0


def _measure(a: argparse.Namespace, dev) -> list[dict]:
    """Every pair's row (on every rank: the rows are all-gathered)."""
    from mok import _ext

    ext = _ext.load()
    rank, R = dist.get_rank(), dist.get_world_size()
    shared = shared_gpu()
    nbytes = (a.mib if a.mib is not None else (16 if shared else 256)) * MIB
    rt_iters = a.rt_iters if a.rt_iters is not None else (20 if shared else 2000)
    sms = max(1, min(a.sms, torch.cuda.get_device_properties(dev).multi_processor_count))
    rounds = tournament(R)
    flag0 = _HEAD_WORDS * 8
    data0 = flag0 + _FLAG_BYTES * max(1, len(rounds))
    data0 = (data0 + 4095) // 4096 * 4096
    sym, hdl = _rendezvous(data0 + nbytes, dev)
    ptrs = list(hdl.buffer_ptrs)
    sym[:data0].zero_()
    sym[:flag0].view(torch.int64).copy_(_pattern(rank, dev))
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    sym[data0:].view(torch.int32).random_(generator=gen)
    local = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = torch.zeros(8, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    hdl.barrier()
    hosts: list[str] = [""] * R
    dist.all_gather_object(hosts, socket.gethostname())
    # reachability: every peer's pattern, read through the peer's mapping
    reach = []
    for peer in range(R):
        view = hdl.get_buffer(peer, (_HEAD_WORDS,), torch.int64)
        reach.append(bool(torch.equal(view, _pattern(peer, dev))))
    stream = torch.cuda.current_stream(dev).cuda_stream
    timeout_ns = int(a.timeout_s * 1e9)
    mine: dict[int, tuple[float, bool, float | None]] = {}  # partner -> (GB/s, copy ok, rt)
    from tqdm import tqdm

    for i, pairs in enumerate(tqdm(rounds, disable=rank != 0, desc="preflight rounds")):
        partner = next((b if a_ == rank else a_ for a_, b in pairs if rank in (a_, b)), None)
        torch.cuda.synchronize()
        hdl.barrier()
        if partner is None:  # a bye
            continue
        src = ptrs[partner] + data0

        def copy(src=src):
            err = ext.probe_copy_vector(local.data_ptr(), src, nbytes, sms, stream)
            if err:
                raise MoKUnsupportedError(f"preflight: the copy kernel failed (error {err})")

        us = time_cuda_local(copy, a.iters, 1)
        ok = bool(torch.equal(local, hdl.get_buffer(partner, (nbytes,), torch.uint8, data0)))
        flag = flag0 + _FLAG_BYTES * i
        rt = _round_trip(ext, sym.data_ptr() + flag, ptrs[partner] + flag, rank < partner,
                         rt_iters, timeout_ns, out, stream)  # fmt: skip
        mine[partner] = (nbytes / (us * 1e3), ok and reach[partner], rt)
    hdl.barrier()
    everyone: list[dict] = [{}] * R
    dist.all_gather_object(everyone, {"reach": reach, "pairs": mine})
    rows = []
    for pairs in rounds:
        for ra, rb in pairs:
            bw_a, ok_a, rt_a = everyone[ra]["pairs"][rb]
            bw_b, ok_b, _ = everyone[rb]["pairs"][ra]
            rows.append(PairResult(
                rank_a=ra, rank_b=rb, host_a=hosts[ra], host_b=hosts[rb],
                reachable=everyone[ra]["reach"][rb] and everyone[rb]["reach"][ra],
                copy_ok=ok_a and ok_b, gbps_a_from_b=bw_a, gbps_b_from_a=bw_b,
                round_trip_us=rt_a,
            ))  # fmt: skip
    return sorted(rows, key=lambda r: (r["rank_a"], r["rank_b"]))


def _report(rows: list[dict], shared: bool) -> int:
    """Rank 0's table and summary; the exit status."""
    print(f"{'pair':>9} {'hosts':<32} {'GB/s a<-b':>10} {'GB/s b<-a':>10} {'rt us':>8}  status")
    bad = 0
    for r in rows:
        status = "ok"
        if not r["reachable"]:
            status = "UNREACHABLE"
        elif not r["copy_ok"]:
            status = "COPY WRONG"
        elif r["round_trip_us"] is None:
            status = "FLAG TIMEOUT"
        bad += status != "ok"
        rt = "-" if r["round_trip_us"] is None else f"{r['round_trip_us']:.2f}"
        hosts = f"{r['host_a']} / {r['host_b']}"[:32]
        print(
            f"{r['rank_a']:>4}-{r['rank_b']:<4} {hosts:<32} {r['gbps_a_from_b']:>10.1f} "
            f"{r['gbps_b_from_a']:>10.1f} {rt:>8}  {status}"
        )
    slow = slow_pairs(rows)
    for r, why in slow:
        print(f"slow pair {r['rank_a']}-{r['rank_b']}: {why}")
    ok_bw, rts = _figures(rows)
    if ok_bw and rts:
        print(
            f"{len(rows)} pairs: {bad} failed, {len(slow)} slow; pull bandwidth min / median "
            f"{min(ok_bw):.0f} / {statistics.median(ok_bw):.0f} GB/s, round trip median / max "
            f"{statistics.median(rts):.2f} / {max(rts):.2f} us"
        )
    if shared:
        print("(ranks share one GPU: the checks hold, the timings are the time-sliced GPU's, "
              "not NVLink's)")  # fmt: skip
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.iters < 1 or a.sms < 1 or (a.mib is not None and a.mib < 1):
        build_parser().error("--iters, --sms and --mib must be >= 1")
    dev = init_dist("mok.bench preflight")
    shared = shared_gpu()
    if dist.get_world_size() == 1:
        _say("preflight: one rank, no pair to check (run it under torchrun on every GPU)")
        return close_dist()
    rows = _measure(a, dev)
    status = 0
    if dist.get_rank() == 0:
        status = _report(rows, shared)
        if a.csv:
            meta = {**provenance(), "shared_gpu": int(shared), "sms": a.sms}
            with open(a.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=[*PairResult.FIELDS, *meta])
                w.writeheader()
                for r in rows:
                    w.writerow({**r, **meta})
    verdict = [status]
    dist.broadcast_object_list(verdict, 0)
    close_dist()
    return int(verdict[0])


if __name__ == "__main__":
    sys.exit(main())
