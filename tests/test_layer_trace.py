"""The fused layer's trace decoder on a hand-written buffer (CPU)."""

from __future__ import annotations

import torch

from mok import layer_trace


def _code(event: int, kind: int, index: int) -> int:
    code = (event << 56) | (kind << 48) | index
    return code - 2**64 if code >= 2**63 else code  # stored as int64


def test_decode_and_summary_of_one_tile():
    buf = torch.zeros(2, 2, 8, 2, dtype=torch.int64)
    # Block 1, consumer region: gate/up tile 5 waits 2 us, multiplies 10 us, stores 3 us.
    events = [(1000, 20), (3000, 21), (13000, 22), (16000, 23)]
    for i, (ns, ev) in enumerate(events, start=1):
        buf[1, 1, i] = torch.tensor([ns, _code(ev, 2, 5)])
    buf[1, 1, 0, 0] = len(events)
    # Block 0, communication region: minibatch 3 ready.
    buf[0, 0, 1] = torch.tensor([500, _code(4, 0, 3)])
    buf[0, 0, 0, 0] = 1
    ev = layer_trace.decode(buf)
    assert [e.name for e in ev] == ["ready", "tile_start", "first_stage", "main_done", "epi_done"]
    assert ev[0].index == 3 and ev[0].kind == "" and ev[0].block == 0
    assert all(e.kind == "gu" and e.index == 5 and e.block == 1 for e in ev[1:])
    s = layer_trace.summary(ev)
    assert s["consumer_wait_first_stage[gu]"] == 2.0
    assert s["consumer_mma[gu]"] == 10.0
    assert s["consumer_epilogue[gu]"] == 3.0
    assert s["span"] == 15.5
    assert s["worker_end_spread"] == 0.0  # one worker


def test_worker_end_spread():
    buf = torch.zeros(3, 2, 4, 2, dtype=torch.int64)
    for block, end in ((1, 9000), (2, 12500)):
        buf[block, 1, 1] = torch.tensor([end, _code(23, 3, block)])  # last epilogue done
        buf[block, 1, 0, 0] = 1
    assert layer_trace.summary(layer_trace.decode(buf))["worker_end_spread"] == 3.5


def test_chrome_trace_has_tile_phases_and_instants(tmp_path):
    import json

    buf = torch.zeros(2, 2, 8, 2, dtype=torch.int64)
    for i, (ns, ev) in enumerate([(1000, 20), (3000, 21), (13000, 22), (14000, 24)], start=1):
        buf[1, 1, i] = torch.tensor([ns, _code(ev, 2, 5)])
    buf[1, 1, 5] = torch.tensor([16000, _code(23, 2, 5)])
    buf[1, 1, 0, 0] = 5
    buf[0, 0, 1] = torch.tensor([500, _code(4, 0, 3)])
    buf[0, 0, 0, 0] = 1
    path = tmp_path / "t.json"
    layer_trace.to_chrome(layer_trace.decode(buf), path)
    rows = json.loads(path.read_text())["traceEvents"]
    spans = sorted((r["name"], r["dur"]) for r in rows if r["ph"] == "X")
    # the epilogue is drawn whole; its sub-phases only feed summary()
    assert spans == [
        ("gu first_stage->main_done", 10.0),
        ("gu main_done->epi_done", 3.0),
        ("gu tile_start->first_stage", 2.0),
    ]
    assert [(r["name"], r["args"]["index"]) for r in rows if r["ph"] == "i"] == [("ready", 3)]
