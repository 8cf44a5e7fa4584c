"""When the unfused forward (and the backward) gather their rows from the tokens instead of
dispatching them (CPU)."""

from __future__ import annotations

import types

import pytest
import torch

import mok.autograd as ma
from mok import layer
from mok.errors import MoKInputError


@pytest.mark.parametrize(
    ("ranks", "tokens", "expected"),
    [(1, 7, True), (1, 0, False), (2, 7, False), (8, 0, False)],
)
def test_gathers_only_at_one_rank_with_rows(ranks, tokens, expected):
    # zero tokens: the kernel's gather source would be empty, so the dispatched path runs
    ws = types.SimpleNamespace(num_ranks=ranks)
    assert layer.gathers_rows(ws, torch.zeros(tokens, 512, dtype=torch.bfloat16)) is expected


def test_the_switch_and_a_strided_x_turn_the_gather_off(monkeypatch):
    ws = types.SimpleNamespace(num_ranks=1)
    x = torch.zeros(8, 512, dtype=torch.bfloat16)
    assert not layer.gathers_rows(ws, x[:, ::2])
    monkeypatch.setattr(layer, "GATHER_AT_ONE_RANK", False)
    assert not layer.gathers_rows(ws, x)


def _weights(inter: int):
    return torch.zeros(4, 2 * inter, 512), torch.zeros(4, 512, inter)


@pytest.mark.parametrize(
    ("switch", "inter", "ranks", "expected"),
    [
        ("auto", 256, 1, True),
        ("auto", 128, 1, True),
        ("auto", 512, 1, False),
        ("auto", 256, 2, False),
        (True, 2048, 1, True),
        (True, 256, 2, False),
        (False, 256, 1, False),
    ],
)
def test_the_backward_gathers_at_one_rank_where_chosen(monkeypatch, switch, inter, ranks, expected):
    # the kernels' own fit is a GPU matter: taken as given here
    monkeypatch.setattr(ma, "gathered_backward_fits", lambda *a: True)
    monkeypatch.setattr(ma, "GATHER_BACKWARD", switch)
    ws, cfg = types.SimpleNamespace(num_ranks=ranks), types.SimpleNamespace(row_tile=128)
    x = torch.zeros(8, 512, dtype=torch.bfloat16)
    assert ma._gathers_backward(ws, x, *_weights(inter), cfg) is expected
    monkeypatch.setattr(layer, "GATHER_AT_ONE_RANK", False)  # the forward's switch turns it off
    assert ma._gathers_backward(ws, x, *_weights(inter), cfg) is False


def test_an_unknown_backward_gather_switch_is_refused(monkeypatch):
    monkeypatch.setattr(ma, "GATHER_BACKWARD", "yes")
    ws, cfg = types.SimpleNamespace(num_ranks=1), types.SimpleNamespace(row_tile=128)
    with pytest.raises(MoKInputError, match="GATHER_BACKWARD"):
        ma._gathers_backward(ws, torch.zeros(8, 512), *_weights(256), cfg)
