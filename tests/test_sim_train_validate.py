"""mok-sim validate on the training-step measurements (``mok.bench train``): the train CSV read
as its own kind (never as a layer CSV), the layer model's workload and config of a train row,
the records of a tiny synthetic CSV, and the CLI on the committed ``h200x1-train.csv``."""

from __future__ import annotations

from sim.measured import is_layer_csv, is_train_csv, measured_path, read_measured, read_rows

TRAIN = measured_path("h200x1-train.csv")
LAYER = measured_path("h200x1-layer.csv")


# -- reading -------------------------------------------------------------------------------------
def test_the_train_csv_is_its_own_kind():
    kind, rows = read_measured(TRAIN)
    assert kind == "train" and len(rows) == 30 and is_train_csv(rows)
    assert not is_layer_csv(rows) and not is_layer_csv(read_rows(TRAIN))
    assert {r["_source"] for r in rows} == {"h200x1-train.csv"}
    kind, rows = read_measured(LAYER)
    assert kind == "layer" and is_layer_csv(rows) and not is_train_csv(rows)


def test_a_train_csv_with_layer_columns_is_still_a_train_csv(tmp_path):
    """Even with a ``minibatch`` column (a layer CSV's mark) the step times make it a train
    CSV: the layer readers never score its rows against a layer time."""
    text = TRAIN.read_text().splitlines()
    path = tmp_path / "t.csv"
    path.write_text("\n".join([text[0] + ",minibatch", *(r + ",4096" for r in text[1:])]) + "\n")
    kind, rows = read_measured(path)
    assert kind == "train" and not is_layer_csv(rows) and is_train_csv(rows)
