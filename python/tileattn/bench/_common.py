"""Timing, memory and output helpers shared by the benchmark modules."""

from __future__ import annotations

import math
import os
import sys
from typing import Callable

import torch

MIB = float(1 << 20)


def require_cuda(module: str) -> torch.device:
    """The benchmarks time GPU kernels with CUDA events; refuse clearly anywhere else."""
    import tileattn

    if not torch.cuda.is_available():
        sys.exit(f"{module}: needs a CUDA device (torch.cuda.is_available() is False); the benchmarks time GPU "
                 "kernels with CUDA events. On the CPU use tileattn-bench from the C++ build.")
    if not tileattn.cuda_available():
        sys.exit(f"{module}: this build of tileattn has no CUDA backend (build it where nvcc is on PATH)")
    return torch.device("cuda", torch.cuda.current_device())


def require_extras(module: str) -> None:
    """The benchmarks write their tables with pandas and plot with matplotlib, the package's
    `bench` extra; without them, say which extra to install instead of a bare ModuleNotFoundError."""
    import importlib

    missing = []
    for name in ("pandas", "matplotlib"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        sys.exit(f"{module}: needs {' and '.join(missing)} (the benchmark extra): pip install 'tileattn[bench]'")


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def release_memory() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def time_each(fn: Callable[[], object], warmup: int, passes: int, before: Callable[[], None] | None = None):
    """Per-pass times in ms from CUDA events around each call; `before` runs untimed before each."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(passes):
        if before:
            before()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        times.append((start, stop))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times]


def mean_std(values):
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    var = sum((x - mean) ** 2 for x in values) / max(1, len(values) - 1)
    return mean, math.sqrt(var)


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak of torch's allocated memory while fn runs (inputs included), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / MIB


def progress(done: int, total: int, label: str) -> None:
    print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)


def output_path(path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return path


def measured_matmul_tflops(device: torch.device, n: int = 8192, dtype=torch.bfloat16) -> float:
    """The card's bf16 matmul rate as measured here: the ceiling the attention rates are compared to."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = time_each(lambda: a @ b, warmup=5, passes=20)
    return 2.0 * n ** 3 / (sorted(times)[len(times) // 2] * 1e-3) / 1e12


def save_plot(frame, x: str, ys: list[str], hue: str, path: str, title: str, logx: bool = True,
              logy: bool = False) -> None:
    """A PNG beside the CSV: one line per value of `hue`, one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ys), figsize=(5 * len(ys), 4), squeeze=False)
    for ax, y in zip(axes[0], ys):
        for name, group in frame.groupby(hue):
            group = group.dropna(subset=[y])
            if len(group):
                ax.plot(group[x], group[y], marker="o", label=str(name))
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
