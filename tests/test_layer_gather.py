"""When the unfused forward gathers its rows from x instead of dispatching them (CPU)."""

from __future__ import annotations

import types

import pytest
import torch

from mok import layer


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
