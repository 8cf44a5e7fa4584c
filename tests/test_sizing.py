"""mok.sizing on the CPU: the README's table of default workspace sizes is what
``python -m mok.sizing`` prints, and the command runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mok import sizing
from mok.spec.workload import get_shape

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("deepseek-v3", "kimi-k2", "qwen3-30b-a3b", "gpt-oss-120b")


def test_the_readme_table_is_the_commands_output():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- table: default-sizes -->\n((?:\|.*\n)+)", text)
    assert m, "README.md has no default-sizes table"
    expected = sizing.default_table([get_shape(n) for n in MODELS], [1, 2, 8], 80.0)
    assert m.group(1).strip() == expected


def test_the_command_prints_a_row_per_model_and_ep(capsys):
    assert sizing.main(["--models", "qwen3-30b-a3b,deepseek-v3", "--ep", "1,8"]) == 0
    rows = [
        r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r
    ]
    assert len(rows) == 1 + 4 and rows[1].startswith("| qwen3-30b-a3b | 1 | 8192 |")


def test_the_cost_of_an_explicit_size(capsys):
    """--max-tokens N: the workspace of exactly N tokens per rank (what MoKConfig(max_tokens=N)
    allocates), at any memory."""
    assert sizing.main(["--models", "deepseek-v3", "--ep", "8", "--max-tokens", "131072"]) == 0
    out = capsys.readouterr().out
    assert "| model | EP | tokens / rank |" in out and "| deepseek-v3 | 8 | 131072 |" in out
    cfg = sizing.MoKConfig()
    p = sizing.plan(sizing.Shapes(131072, 7168, 8, 256, torch.bfloat16), cfg, 8)
    assert f"| {(p.sym_bytes + p.sched_bytes + p.dedup_bytes) / 1e9:.2f} |" in out


def test_bad_arguments_say_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        sizing.main(["--models", "nope"])
    assert "unknown model shape 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sizing.main(["--max-tokens", "-1"])
