"""softmax(X) @ V: tileattn's fused kernel beside PyTorch's two-step softmax then matmul.

    python -m tileattn.bench.softmax_matmul [--warmup 10] [--passes 100] [--csv PATH]

fp32, batch 16, d1 2048, d3 512, d2 = 64 ... 8192 (powers of two). Writes a CSV (columns
batch_size, d1, d2, d3, triton, BLOCK, forward_ms_mean, forward_ms_std, forward_peak_MiB,
implementation) and a PNG beside it. `triton` marks the fused kernel; BLOCK is <NA> because the
fused kernel picks its own tiles (it takes no block size). Failures (out of memory, unsupported)
are printed and recorded as NaN rows, never fatal.
"""

from __future__ import annotations

import argparse
import math

import torch

from . import _common

BATCH, D1, D3 = 16, 2048, 512
D2_VALUES = [2 ** i for i in range(6, 14)]
COLUMNS = ["batch_size", "d1", "d2", "d3", "triton", "BLOCK", "forward_ms_mean", "forward_ms_std",
           "forward_peak_MiB", "implementation"]


def _implementations():
    import tileattn

    def two_step(x, v):
        return torch.softmax(x, dim=-1) @ v

    # (name, fused, function)
    return [("tileattn", True, tileattn.softmax_matmul), ("pytorch", False, two_step)]


def run(warmup: int, passes: int, d2_values=D2_VALUES, dtype=torch.float32):
    import pandas as pd

    device = _common.require_cuda("tileattn.bench.softmax_matmul")
    rows = []
    impls = _implementations()
    total, done = len(d2_values) * len(impls), 0
    for d2 in d2_values:
        for name, fused, fn in impls:
            done += 1
            row = dict(batch_size=BATCH, d1=D1, d2=d2, d3=D3, triton=fused, BLOCK=pd.NA,
                       forward_ms_mean=math.nan, forward_ms_std=math.nan, forward_peak_MiB=math.nan,
                       implementation=name)
            try:
                x = torch.randn(BATCH, D1, d2, device=device, dtype=dtype)
                v = torch.randn(BATCH, d2, D3, device=device, dtype=dtype)
                with torch.no_grad():
                    times = _common.time_each(lambda: fn(x, v), warmup, passes)
                    row["forward_peak_MiB"] = _common.peak_mib(lambda: fn(x, v))
                row["forward_ms_mean"], row["forward_ms_std"] = _common.mean_std(times)
                status = f"{row['forward_ms_mean']:.3f} ms"
            except Exception as error:  # recorded as a NaN row, never fatal
                status = "OOM" if _common.is_oom(error) else f"failed: {error}"
            finally:
                x = v = None
                _common.release_memory()
            rows.append(row)
            _common.progress(done, total, f"{name} d2={d2}: {status}")
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["BLOCK"] = frame["BLOCK"].astype("Int64")
    return frame


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tileattn.bench.softmax_matmul", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--csv", default="outputs/softmax_matmul_benchmark.csv")
    args = parser.parse_args(argv)
    _common.require_cuda(parser.prog)
    _common.require_extras(parser.prog)

    frame = run(args.warmup, args.passes)
    path = _common.output_path(args.csv)
    frame.to_csv(path, index=False)
    _common.save_plot(frame, "d2", ["forward_ms_mean", "forward_peak_MiB"], "implementation",
                      path.rsplit(".", 1)[0] + ".png",
                      f"softmax(X)V, fp32, batch {BATCH}, d1 {D1}, d3 {D3} ({torch.cuda.get_device_name()})")
    print(frame.to_string(index=False))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
