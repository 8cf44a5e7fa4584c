"""mok.sizing on the CPU: the README's table of default workspace sizes is what
``python -m mok.sizing`` prints, and the command runs."""

from __future__ import annotations

import re
from pathlib import Path

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
