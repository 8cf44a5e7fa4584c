"""The one-GPU backward piece by piece: the kernels a ``mok.bench train --kernels`` profile timed
(the ``-kernels.csv`` beside a train CSV, :mod:`mok.bench.kernel_times`) against the layer
model's pieces of the same rows, mok's serial backward and the fused design
(docs/sim-validation.md, "The backward by piece").

Measured (:func:`measured_pieces`): each profiled kernel of a case, per step, goes to one piece
by its name (:data:`KERNEL_PIECES`). Only the cases whose forward is unfused (``mok-unfused``,
``mok-saved``) are split into passes: their forward runs the schedule and the combine once each
and its gate / up and down kernels, and at one rank reads its rows from the tokens
(``mok.layer.GATHER_AT_ONE_RANK``, since git d3eea98), so the backward has half of the
schedule's and the combine's time and every row copy. ``bwd_fused_kernel`` is the gate / up
dgrad alone where a dh kernel (``swiglu_bwd_kernel`` mode 0, 2 or 3) ran in the same step, else
the whole backward from saved g / u in one launch. The torch kernels (small elementwise ops,
copies, memsets) are not split by pass; ``other`` is the train row's ``bwd_us`` less the
backward's pieces, so the backward's share of them and the gaps between kernels (and the
profiler's own cost) land there.

Model (:func:`model_pieces`): the serial backward's chain (:mod:`sim.layer.backward`, its
pieces add up to its prediction) and the fused design's prediction split the same way: its
schedule, the exposed part of its transfers (``exposed_comm_us``: the layer less the layer with
free transfers), each GEMM's busy time on its compute SMs (``piece_us``), its final sum, and the
rest (tails, signals and GEMM time hidden under exposed transfers, which can be negative), adding
up to its prediction.

``python -m sim.app.bwd_pieces KERNELS_CSV [--train CSV] [--gather on|off]`` prints the three
side by side for every such case of the CSV (:func:`format_pieces`); ``--train CSV`` alone, the
model's pieces of the train CSV's rows beside their measured backward.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from sim.measured import read_rows

__all__ = [
    "KERNEL_PIECES",
    "PIECES",
    "MODEL_PIECES",
    "UNFUSED_FORWARD_IMPLS",
    "classify",
    "measured_pieces",
    "model_pieces",
    "compare",
    "format_pieces",
    "main",
]

# (pattern on the kernel's short name, pass, piece): "both" runs once per pass (two calls per
# step), "fwd" is the forward's, None a piece of either pass that the profile cannot place
KERNEL_PIECES = (
    (r"schedule_kernel", "both", "schedule"),
    (r"(combine_\w+|dedup_partials|dedup_sum)_kernel", "both", "combine"),
    (r"(dispatch_\w+|zero_padding|fanout|wait_x_free)_kernel", "bwd", "copies"),
    (r"swiglu_bwd_kernel<0\b", "bwd", "recompute+down_dgrad"),
    (r"swiglu_bwd_kernel<[23]\b", "bwd", "down_dgrad"),
    (r"swiglu_bwd_kernel<1\b", "fwd", "forward"),
    (r"bwd_fused_kernel", "bwd", "bwd_fused"),
    (r"wgrad_gather_kernel<\d+, 1>", "bwd", "dw_gate_up"),
    (r"wgrad_gather_kernel<\d+, 0>", "bwd", "dw_down"),
    (r"wgrad_kernel", "bwd", "dw"),
)
# the rows of the comparison: (name, the model's pieces it holds, what it says)
PIECES = (
    ("schedule", ("schedule",), "schedule (one of the step's two calls)"),
    ("copies", ("copies",), "dY and x row copies (dispatches, padding zeros)"),
    ("recompute+down_dgrad", ("recompute", "down_dgrad"), "gate/up recompute + down dgrad"),
    ("down_dgrad", ("down_dgrad",), "down dgrad from saved g/u (SwiGLU bwd)"),
    ("swiglu_epilogue", ("swiglu_epilogue",), "  model: of which the SwiGLU epilogue"),
    ("gate_up_dgrad", ("gate_up_dgrad",), "gate/up dgrad (d_a)"),
    ("dw_gate_up", ("dw_gate_up",), "dW_gate_up"),
    ("dw_down", ("dw_down",), "dW_down"),
    ("dw", ("dw_down", "dw_gate_up"), "dW_down + dW_gate_up"),
    (
        "fused",
        ("down_dgrad", "gate_up_dgrad", "dw_down", "dw_gate_up"),
        "one launch from saved g/u (dh, d_a, both dW)",
    ),
    ("shared", ("shared",), "shared expert"),
    ("combine", ("combine",), "combine (one of the step's two calls)"),
    ("other", ("other",), "the rest: torch ops, gaps / tails, signals"),
)
# the cases whose kernels are split into passes (module docstring)
UNFUSED_FORWARD_IMPLS = ("mok-unfused", "mok-saved")
_DH = ("recompute+down_dgrad", "down_dgrad")


def classify(short: str) -> tuple[str | None, str]:
    """(pass, piece) of a kernel by its short name (:data:`KERNEL_PIECES`); (None, "other") for
    any other kernel."""
    for pattern, where, piece in KERNEL_PIECES:
        if re.search(pattern, short):
            return where, piece
    return None, "other"


def measured_pieces(kernel_rows: Sequence[dict], bwd_us: float) -> dict[str, float]:
    """The backward's pieces (us per step; the names of :data:`PIECES`) of one case's rows of a
    kernels CSV, and ``other``: ``bwd_us`` (the train row's) less their sum."""
    out: dict[str, float] = {}
    for r in kernel_rows:
        where, piece = classify(r["short"])
        if where in ("fwd", None):
            continue
        us = float(r["us_per_step"]) * (0.5 if where == "both" else 1.0)
        out[piece] = out.get(piece, 0.0) + us
    if "bwd_fused" in out:
        # the gate / up dgrad alone beside a dh kernel, else the whole backward in one launch
        out["gate_up_dgrad" if any(k in out for k in _DH) else "fused"] = out.pop("bwd_fused")
    out["other"] = bwd_us - sum(out.values())
    return out


def model_pieces(row: dict, design: bool = False, gather: bool | None = None) -> dict[str, float]:
    """The layer model's backward of a train row (:func:`sim.app.validate.train_model_config`:
    mok's serial backward, or with ``design`` the fused design; ``gather`` as there) by piece:
    ``schedule``, ``copies``, the GEMMs (:meth:`sim.layer.backward.BackwardPass.piece_us`),
    ``combine`` and ``other``, adding up to the prediction (``total``); and
    ``swiglu_epilogue``, the part of ``down_dgrad`` its epilogue's bytes take."""
    from sim.app.validate import train_model_config
    from sim.layer.model import BackwardBuilder, simulate

    wl, plan, _, cfg = train_model_config(row, design=design, gather=gather)
    res = simulate(wl, cfg, plan)
    b = res.breakdown
    out = {"schedule": b["schedule_us"], "copies": b["exposed_comm_us"]}
    out.update(BackwardBuilder(wl, cfg, plan).piece_us(0))
    phase, dur = res.graph.phase, res.run.end_us - res.run.start_us
    out["combine"] = float(sum(d for p, d in zip(phase, dur, strict=True) if p == "reduce"))
    out["other"] = res.layer_us - sum(out.values())
    out["total"] = res.layer_us
    # the SwiGLU backward in the down dgrad's epilogue: part of down_dgrad, not added again
    bare = BackwardBuilder(wl, cfg.replace(swiglu_bwd_bytes_per_elem=0.0), plan).piece_us(0)
    out["swiglu_epilogue"] = out["down_dgrad"] - bare["down_dgrad"]
    return out


def _train_csv(kernels_csv: str) -> str:
    """The train CSV a kernels CSV was written beside (``<stem>-kernels.csv``)."""
    p = Path(kernels_csv)
    if not p.stem.endswith("-kernels"):
        raise ValueError(f"{kernels_csv} is not named <train CSV stem>-kernels.csv: give --train")
    return str(p.with_name(p.stem[: -len("-kernels")] + p.suffix))


def compare(
    kernels_csv: str | None, train_csv: str | None = None, gather: bool | None = None
) -> list[dict]:
    """One entry per case of ``kernels_csv`` whose forward is unfused
    (:data:`UNFUSED_FORWARD_IMPLS`) and whose train row (``train_csv``, default the CSV beside
    it) has the same (model, tokens, skew, impl, sms): its train row, and the pieces measured,
    of the serial model and of the design (:func:`measured_pieces`, :func:`model_pieces`).
    Without ``kernels_csv``, every such row of ``train_csv``, nothing measured by piece."""
    if kernels_csv is None and train_csv is None:
        raise ValueError("give a kernels CSV, a train CSV (--train) or both")
    kernels = None if kernels_csv is None else read_rows(kernels_csv)
    train = read_rows(train_csv or _train_csv(kernels_csv))
    key = ("model", "tokens_per_rank", "skew", "impl", "sms")
    out = []
    for row in train:
        if row["impl"] not in UNFUSED_FORWARD_IMPLS:
            continue
        measured: dict[str, float] = {}
        if kernels is not None:
            mine = [k for k in kernels if all(k[c] == row[c] for c in key)]
            if not mine:
                continue
            measured = measured_pieces(mine, float(row["bwd_us"]))
        out.append(
            {
                "row": row,
                "measured": measured,
                "serial": model_pieces(row, gather=gather),
                "design": model_pieces(row, design=True),
            }
        )
    return out


def _cell(x: float | None) -> str:
    return f"{'-':>9}" if x is None else f"{x:>9.1f}"


# the model's own pieces, in the serial chain's order (the table of a case without a profile)
MODEL_PIECES = (
    ("schedule", ("schedule",), "schedule"),
    ("copies", ("copies",), "dY and x row copies"),
    ("recompute", ("recompute",), "gate/up recompute"),
    ("down_dgrad", ("down_dgrad",), "down dgrad (SwiGLU bwd in its epilogue)"),
    ("swiglu_epilogue", ("swiglu_epilogue",), "  of which the SwiGLU epilogue"),
    ("gate_up_dgrad", ("gate_up_dgrad",), "gate/up dgrad (d_a)"),
    ("dw_gate_up", ("dw_gate_up",), "dW_gate_up"),
    ("dw_down", ("dw_down",), "dW_down"),
    ("shared", ("shared",), "shared expert"),
    ("combine", ("combine",), "combine"),
    ("other", ("other",), "the rest: tails, signals"),
)


def format_pieces(cases: Sequence[dict]) -> str:
    """The cases of :func:`compare` as tables: per piece of :data:`PIECES` that either side
    has, the measured us and the serial model's and the design's, each with its error against
    the measured piece (a case without a profile: the model's own pieces,
    :data:`MODEL_PIECES`); then the totals."""
    lines = []
    for c in cases:
        row, meas = c["row"], c["measured"]
        rows = PIECES if meas else MODEL_PIECES
        lines.append(
            f"{row['model']} {row['skew']} {row['impl']} ({row.get('git_sha', '')}, "
            f"{row.get('sm_mhz', '?')} MHz): bwd {float(row['bwd_us']):.1f} us"
        )
        lines.append(
            f"  {'piece':<46}{'measured':>9}{'serial':>9}{'err':>8}{'design':>9}{'err':>8}"
        )
        for name, model_keys, text in rows:
            got = {}
            for side in ("serial", "design"):
                m = c[side]
                have = [k for k in model_keys if k in m]
                got[side] = sum(m[k] for k in have) if have else None
            # a model piece the profile shows within another (or not at all) is skipped, but
            # for the epilogue, shown beside the dh kernel
            shown = ("copies", "schedule", "combine")
            epilogue = name == "swiglu_epilogue" and any(k in meas for k in _DH)
            if meas and name not in meas and name not in shown and not epilogue:
                continue
            if not meas and all(not got[side] for side in got):
                continue
            m_us = meas.get(name)
            cells = _cell(m_us)
            for side in ("serial", "design"):
                v = got[side]
                err = "" if v is None or not m_us else f"{100 * (v / m_us - 1):+7.0f}%"
                cells += _cell(v) + f"{err:>8}"
            lines.append(f"  {text:<46}{cells}")
        tot = float(row["bwd_us"])
        cells = _cell(tot)
        for side in ("serial", "design"):
            v = c[side]["total"]
            cells += _cell(v) + f"{100 * (v / tot - 1):+7.1f}%"
        lines.append(f"  {'backward (the train row; the predictions)':<46}{cells}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sim.app.bwd_pieces",
        description="a train run's backward kernels (mok.bench train --kernels) beside the "
        "layer model's backward pieces (mok's serial backward and the fused design)",
    )
    ap.add_argument("kernels", nargs="?", help="the -kernels.csv of a train run")
    ap.add_argument("--train", help="its train CSV (default: the CSV beside it)")
    ap.add_argument(
        "--gather",
        choices=("on", "off"),
        default=None,
        help="the serial model's rows read from the tokens (on) or copied (off) at every size, "
        "as a run that forced mok.autograd.GATHER_BACKWARD; default: mok's 'auto' rule",
    )
    a = ap.parse_args(argv)
    gather = None if a.gather is None else a.gather == "on"
    print(format_pieces(compare(a.kernels, a.train, gather)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
