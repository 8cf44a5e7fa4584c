"""Off CUDA, every API entry point (``mok.MoE``, ``mok.functional.moe`` / ``moe_forward`` /
``moe_backward``) raises :class:`mok.MoKInputError` for each kind of bad input, the type the
CUDA path raises, from the API boundary (a short traceback), with a message naming what was
found."""

from __future__ import annotations

import traceback

import pytest
import torch

import mok
from mok import functional as mf
from mok.spec.workload import ModelShape
from reference.weights import MoEWeights

E, H, INTER, K, N = 8, 32, 16, 2, 5
SHAPE = ModelShape("errors", E, H, INTER, K)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return x, idx, torch.rand(N, K, generator=g)


def _mistakes():
    x, idx, tw = _inputs()
    dup = idx.clone()
    dup[1, 1] = dup[1, 0]
    return {
        "x of three dims": ((x[None], idx, tw), r"x must be \[num_tokens, hidden\]"),
        "integer x": ((x.long(), idx, tw), "x must be a float tensor"),
        "x of another hidden": ((x[:, :16], idx, tw), "x has hidden=16 but the weights have hid"),
        "ids out of range": ((x, idx + E, tw), r"outside \[0, 8\)"),
        "negative ids": ((x, idx - E, tw), r"outside \[0, 8\)"),
        "float ids": ((x, idx.float(), tw), "topk_idx must be int32 or int64"),
        "a repeated id": ((x, dup, tw), "same expert twice"),
        "weights of another shape": ((x, idx, tw[:, :1]), "expected the shape of topk_idx"),
        "NaN weights": ((x, idx, tw.masked_fill(tw > 0.5, float("nan"))), "not finite"),
        "too few routing rows": ((x, idx[:3], tw[:3]), r"topk_idx must be \[num_tokens=5"),
    }


MISTAKES = _mistakes()


def _entry_points():
    w = MoEWeights.random(SHAPE, dtype=torch.float32)
    m = mok.MoE.from_weights(E, torch.cat([w.w_gate, w.w_up], 1), w.w_down)
    return {
        "MoE": lambda x, idx, tw: m(x, idx, tw),
        "moe": lambda x, idx, tw: mf.moe(x, idx, tw, w, E),
        "moe_forward": lambda x, idx, tw: mf.moe_forward(x, idx, tw, w, E),
        "moe_backward": lambda x, idx, tw: mf.moe_backward(x.float() * 0, x, idx, tw, w, E),
    }


ENTRY_POINTS = _entry_points()


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_every_mistake_is_an_input_error_from_the_api(entry, case):
    args, match = MISTAKES[case]
    if entry == "moe_backward" and case == "x of three dims":
        pytest.skip("moe_backward checks grad_out against x first (its own MoKInputError)")
    with pytest.raises(mok.MoKInputError, match=match) as err:
        ENTRY_POINTS[entry](*args)
    assert isinstance(err.value, ValueError)  # MoKInputError is a ValueError too
    frames = traceback.extract_tb(err.value.__traceback__)
    assert len(frames) <= 8, [f"{f.filename}:{f.lineno}" for f in frames]


def test_good_inputs_still_run_on_every_entry_point():
    x, idx, tw = _inputs()
    outs = [ENTRY_POINTS[e](x, idx, tw) for e in ("MoE", "moe", "moe_forward")]
    assert all(o.shape == (N, H) for o in outs)
    assert torch.equal(outs[1], outs[2])
    assert ENTRY_POINTS["moe_backward"](x, idx, tw).dx.shape == (N, H)
