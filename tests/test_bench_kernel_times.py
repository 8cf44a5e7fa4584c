"""The per-kernel profile of a step (mok.bench.kernel_times), on the CPU's profiler."""

from __future__ import annotations

import pytest
import torch

from mok.bench import kernel_times as kt


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("void mok::bwd_fused_kernel<0>(mok::FusedBwdKernelArgs)", "mok::bwd_fused_kernel<0>"),
        ("mok::schedule_kernel(mok::Params)", "mok::schedule_kernel"),
        ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD"),
        ("aten::mm", "aten::mm"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
            "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1>)",
            "at::native::vectorized_elementwise_kernel",
        ),
    ],
)
def test_short_names_keep_the_kernels_head(name, short):
    assert kt.short_name(name) == short


def test_a_long_name_is_cut_to_sixty_characters():
    got = kt.short_name("_ZN7cutlass13device_kernel" + "x" * 200)
    assert len(got) == 60 and got.endswith("...")


def test_each_op_per_step_largest_first():
    a = torch.randn(256, 256)

    def step():
        (a @ a) @ a  # two matrix products a step
        a.sum()

    times = kt.kernel_times(step, steps=3)
    by_name = {t.name: t for t in times}
    assert by_name["aten::mm"].calls == pytest.approx(2.0)
    assert all(t.us > 0 for t in times)
    assert [t.us for t in times] == sorted((t.us for t in times), reverse=True)


def test_the_summary_shows_the_top_and_sums_the_rest():
    times = [kt.KernelTime(f"void k{i}(int)", 1.0, 100.0 - 10 * i) for i in range(5)]
    lines = kt.summary_lines(times, top=2)
    assert len(lines) == 4
    assert lines[1].split() == ["100.0", "1.0", "25.0%", "k0"]
    assert lines[3].split() == ["210.0", "52.5%", "(3", "others)"]


def test_the_recorder_writes_a_row_per_kernel_beside_the_train_csv(tmp_path):
    path = kt.kernels_csv(str(tmp_path / "sonic.csv"))
    assert path == str(tmp_path / "sonic-kernels.csv")
    rec = kt.KernelRecorder(path, {"gpu": "cpu", "git_sha": "abc"})
    rec.add_step({"model": "m", "impl": "mok-saved"}, [kt.KernelTime("void a(int)", 2.0, 30.0),
                                                        kt.KernelTime("b", 1.0, 10.0)])  # fmt: skip
    assert [(r["short"], r["calls_per_step"], r["us_per_step"], r["share"]) for r in rec.rows] == [
        ("a", 2.0, 30.0, 0.75),
        ("b", 1.0, 10.0, 0.25),
    ]
    rec.write()
    head = (tmp_path / "sonic-kernels.csv").read_text().splitlines()[0]
    assert head == (
        "model,impl,kernel,short,calls_per_step,us_per_step,share,profiled_steps,gpu,git_sha"
    )
