"""The benchmark entry point parses its subcommands on a CPU machine (the runs need GPUs)."""

from __future__ import annotations

import pytest

from mok.bench.__main__ import COMMANDS, main


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"mok.bench {command}" in capsys.readouterr().out


def test_unknown_subcommand_prints_usage(capsys):
    assert main(["nope"]) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["comm", "layer", "sweep", "probe", "experts"])
def test_timing_benchmarks_refuse_shared_gpu_ranks(command, monkeypatch, capsys):
    from mok.bench import __main__ as bench_main

    monkeypatch.setenv("MOK_SHARED_GPU", "1")
    assert bench_main.main([command]) == 2
    err = capsys.readouterr().err
    assert f"mok.bench {command}: refused with MOK_SHARED_GPU=1" in err
    assert "say nothing about NVLink" in err and "train, lm" in err
