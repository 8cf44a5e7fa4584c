"""Execute every exploration notebook (``notebooks/NN_name.py``, jupytext percent format) at its
small default parameters, as CI does, and check it produced its figures and findings."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT_S = 120
# a heading each notebook's last cell prints (or shows), beyond the generic checks below
EXPECTED_TEXT = {
    "01_push_vs_pull.py": "Dedup-pull cuts NVLink payload per rank",
    "02_tuning.py": "MoKConfig.from_json reads back",
    "03_sim_vs_kernel.py": "Targets met:",
    "04_scaling.py": "layer time at",
    "05_training.py": "Loss curves:",
}


def _python3_kernel(prefix: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``python3`` kernel spec running the current interpreter, written under ``prefix`` and
    put first on JUPYTER_PATH, so a user-installed ``python3`` spec cannot take its place."""
    from ipykernel.kernelspec import install

    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    install(kernel_name="python3", prefix=str(prefix))
    return "python3"


def _outputs(nb) -> tuple[str, int]:
    """(all text output, number of PNG images) of an executed notebook."""
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out.get("text", ""))
            data = out.get("data", {})
            text.append(data.get("text/plain", ""))
            images += "image/png" in data
    return "".join(text), images


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jupytext = pytest.importorskip("jupytext", reason="needs the notebooks extra (jupytext)")
    nbclient = pytest.importorskip("nbclient", reason="needs the notebooks extra (nbclient)")
    pytest.importorskip("ipykernel", reason="needs the notebooks extra (ipykernel)")

    nb = jupytext.read(path)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{path.name}: expected one cell tagged 'parameters'"
    assert nb.cells[0].cell_type == "markdown", f"{path.name}: start with a markdown intro"

    # the notebooks import sim / mok from this checkout; figures render off-screen
    repo = str(NOTEBOOK_DIR.parent)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("MPLBACKEND", "Agg")
    workdir = tmp_path / "run"
    workdir.mkdir()
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=_python3_kernel(tmp_path / "kernel", monkeypatch),
        resources={"metadata": {"path": str(workdir)}},  # the kernel's cwd
    )
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0

    errors = [
        out
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    text, images = _outputs(nb)
    assert images >= 1, f"{path.name}: no figure in the outputs"
    expected = EXPECTED_TEXT.get(path.name)
    if expected:
        assert expected in text, f"{path.name}: missing {expected!r} in the outputs"
    print(f"{path.name}: executed in {elapsed:.1f} s, {images} figure(s)")
