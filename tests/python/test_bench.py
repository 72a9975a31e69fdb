"""The benchmark modules: they refuse clearly without CUDA, and their options parse."""

import subprocess
import sys

import pytest
import torch

MODULES = ["tileattn.bench.softmax_matmul", "tileattn.bench.attention"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("module", MODULES)
def test_refuses_without_cuda(module, tmp_path):
    result = subprocess.run([sys.executable, "-m", module, "--passes", "1", "--csv", str(tmp_path / "x.csv")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs a CUDA device" in result.stderr
    assert not (tmp_path / "x.csv").exists()


# Runs a benchmark module as `python -m` would, with pandas and matplotlib made unimportable and the
# CUDA check passed, so that the extras check is what answers (on any machine).
_WITHOUT_EXTRAS = """
import runpy, sys
sys.modules["pandas"] = sys.modules["matplotlib"] = None
from tileattn.bench import _common
_common.require_cuda = lambda module: None
sys.argv = [sys.argv[1], "--passes", "1", "--csv", sys.argv[2]]
runpy.run_module(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("module", MODULES)
def test_without_the_bench_extra_names_it(module, tmp_path):
    csv = tmp_path / "x.csv"
    result = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, module, str(csv)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "needs pandas and matplotlib" in result.stderr and "pip install 'tileattn[bench]'" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not csv.exists()


@pytest.mark.parametrize("module", MODULES)
def test_help(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage" in result.stdout


@pytest.mark.gpu
def test_softmax_matmul_benchmark_writes_csv_and_plot(tmp_path):
    pytest.importorskip("pandas", reason="the benchmark tables need the bench extra (pandas)")
    from tileattn.bench import softmax_matmul

    frame = softmax_matmul.run(warmup=1, passes=2, d2_values=[64, 128])
    assert list(frame.columns) == softmax_matmul.COLUMNS
    assert str(frame["BLOCK"].dtype) == "Int64" and frame["BLOCK"].isna().all()
    assert (frame["forward_ms_mean"] > 0).all() and set(frame["triton"]) == {True, False}


@pytest.mark.gpu
def test_attention_benchmark_small_grid():
    pytest.importorskip("pandas", reason="the benchmark tables need the bench extra (pandas)")
    from tileattn.bench import attention

    frame = attention.run_course(["tileattn", "pytorch_sdpa"], causal=False, warmup=1, passes=2, seq_lens=[256])
    assert list(frame.columns) == attention.COLUMNS
    assert (frame["status"] == "ok").all(), frame["status"].tolist()
    assert (frame["backward_ms"] > 0).all()


def test_course_plot_writes_time_and_peak_memory_panels(tmp_path):
    pd = pytest.importorskip("pandas", reason="the benchmark tables need the bench extra (pandas)")
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (matplotlib)")
    from tileattn.bench import attention

    rows = [dict(implementation=impl, d_model=64, seq_len=n, forward_ms=s * t, forward_peak_MiB=s * m,
                 backward_ms=2 * s * t, backward_peak_MiB=2 * s * m, saved_activations_MiB=s * m / 2, status="ok",
                 gpu="a GPU")
            for impl, s in (("tileattn", 1.0), ("pytorch_sdpa", 3.0)) for n, t, m in ((256, 0.1, 4.0), (4096, 2.0, 64.0))]
    path = tmp_path / "course.png"
    attention.plot_course(pd.DataFrame(rows, columns=attention.COLUMNS), str(path), tf32=False)
    assert path.stat().st_size > 0


def test_overhead_ratios_pair_rounds():
    from tileattn.bench.overhead import paired_ratios

    def row(impl, mode, direction, rounds):
        return dict(impl=impl, mode=mode, direction=direction, rounds_us=rounds)

    rows = [row("tileattn", "eager", "fwd", [10.0, 30.0, 8.0]), row("sdpa", "eager", "fwd", [20.0, 10.0, 0.0]),
            row("sdpa", "eager", "fwd+bwd", [5.0]), row("tileattn", "eager", "fwd+bwd", [4.0]),
            row("tileattn", "compiled", "fwd", [1.0])]
    # Round by round, not best against best (8/10 would be 0.8); a round SDPA measured as free is skipped.
    assert paired_ratios(rows) == [("eager", "fwd", [0.5, 3.0]), ("eager", "fwd+bwd", [0.8])]


def test_overhead_benchmark_on_cpu():
    result = subprocess.run([sys.executable, "-m", "tileattn.bench.overhead", "--device", "cpu", "--modes", "eager",
                             "--rounds", "2", "--calls", "50", "--seqlen", "16"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = lines.index("tileattn / SDPA overhead, paired by round: median (min - max)")
    paired = [line.split() for line in lines[at + 1:]]
    assert [p[:2] for p in paired] == [["eager", "fwd"], ["eager", "fwd+bwd"]]
    for p in paired:
        median, low, high = float(p[2]), float(p[3].strip("(")), float(p[5].strip(")"))
        assert 0 <= low <= median <= high  # two decimals: a loaded machine can print 0.00


def test_h100_ratios_are_sdpa_time_over_tileattn_time():
    pd = pytest.importorskip("pandas", reason="the benchmark tables need the bench extra (pandas)")
    from tileattn.bench import attention

    def row(impl, fwd, bwd, status="ok", n=1024, heads_kv=32):
        return dict(implementation=impl, headdim=64, seq_len=n, heads=32, heads_kv=heads_kv, causal=False,
                    forward_ms=fwd, backward_ms=bwd, status=status)

    frame = pd.DataFrame([row("tileattn", 2.0, 4.0), row("sdpa_flash", 3.0, 5.0), row("sdpa_cudnn", 1.0, 8.0),
                          row("sdpa_efficient", 9.0, 9.0, status="OOM"), row("tileattn", 1.0, 1.0, n=4096),
                          row("sdpa_cudnn", 2.0, 2.0, n=4096, heads_kv=8)])
    r = attention.ratios_h100(frame).set_index("seq_len")
    assert r.loc[1024, "forward_vs_cudnn"] == pytest.approx(0.5)
    assert r.loc[1024, "backward_vs_cudnn"] == pytest.approx(2.0)
    assert r.loc[1024, "step_vs_cudnn"] == pytest.approx(1.5)
    # The fastest backend per column (cuDNN forward, flash backward; flash's step 8 < cuDNN's 9);
    # the OOM row is no peer.
    assert r.loc[1024, "forward_vs_best_sdpa"] == pytest.approx(0.5)
    assert r.loc[1024, "backward_vs_best_sdpa"] == pytest.approx(1.25)
    assert r.loc[1024, "step_vs_best_sdpa"] == pytest.approx(8.0 / 6.0)
    # A shape no peer ran (cuDNN ran the GQA problem of that length, another shape): no ratio.
    assert r.loc[4096, ["forward_vs_cudnn", "step_vs_best_sdpa"]].isna().all()


def test_h100_ratios_give_the_deterministic_backward_over_the_default():
    pd = pytest.importorskip("pandas", reason="the benchmark tables need the bench extra (pandas)")
    from tileattn.bench import attention

    def row(impl, bwd, n, status="ok"):
        return dict(implementation=impl, headdim=192, seq_len=n, heads=16, heads_kv=16, causal=True,
                    forward_ms=1.0, backward_ms=bwd, status=status)

    frame = pd.DataFrame([row("tileattn", 4.0, 1024), row("tileattn_deterministic", 5.0, 1024),
                          row("tileattn", 2.0, 4096), row("tileattn_deterministic", 9.0, 4096, status="OOM")])
    r = attention.ratios_h100(frame).set_index("seq_len")
    assert r.loc[1024, "deterministic_backward_cost"] == pytest.approx(1.25)
    assert pd.isna(r.loc[4096, "deterministic_backward_cost"])
    # Without the deterministic rows, no such column.
    assert "deterministic_backward_cost" not in attention.ratios_h100(frame[frame.implementation == "tileattn"])


def test_h100_grid_keeps_the_head_dims_asked_for():
    from tileattn.bench import attention

    wide = attention.h100_configs([192, 256])
    assert {c[0] for c in wide} == {192, 256} and len(wide) == 4
    assert wide == [c for c in attention.h100_configs() if c[0] in (192, 256)]
    assert attention.h100_configs([64]) == [c for c in attention.h100_configs() if c[0] == 64]


def test_h100_grid_holds_the_training_step_shapes():
    from tileattn.bench import attention

    configs = attention.h100_configs()
    assert len(set(configs)) == len(configs)
    for d, n, causal, batch, heads, heads_kv in configs:
        assert batch * n == 16 * 1024 and heads % heads_kv == 0
    # The square grid, and GQA 32/8 at D = 128 and the wide head dims at N = 4k, causal and not.
    for d in (64, 128):
        for n in (1024, 4096, 16384):
            assert (d, n, True, 16384 // n, 2048 // d, 2048 // d) in configs
    for shape in [(128, 4096, 4, 32, 8), (192, 4096, 4, 16, 16), (256, 4096, 4, 8, 8)]:
        d, n, batch, heads, heads_kv = shape
        assert {(d, n, c, batch, heads, heads_kv) for c in (False, True)} <= set(configs)

