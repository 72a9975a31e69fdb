"""Attention forward and backward: tileattn beside PyTorch.

    python -m tileattn.bench.attention [--impl pytorch_sdpa|tileattn] [--causal] [--tf32] [--csv PATH]
    python -m tileattn.bench.attention --preset h100 [--passes N] [--csv PATH]

Default grid: fp32, batch 8, d_model 64 (one head, (batch, seq, d_model) tensors), seq_len 256 ...
16384; each implementation under torch.compile; 10 warm-up passes, then 100 timed forward and 100
timed backward passes (CUDA events). Columns: implementation, d_model, seq_len, forward_ms,
forward_peak_MiB, backward_ms, backward_peak_MiB, saved_activations_MiB (memory the forward leaves
allocated for the backward, output excluded), status (ok, OOM, OOM(backward)), gpu. Peaks are
torch.cuda.max_memory_allocated after a reset, inputs included.

--preset h100: bf16, batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 / D), D in {64, 128},
N in {1k, 4k, 16k}, causal and not; and at N = 4k, causal and not, GQA 32/8 at D = 128, D = 192
with 16 heads and D = 256 with 8; tileattn beside SDPA's flash, cuDNN and efficient backends and
FlexAttention, on the same (batch, seqlen, heads, D) memory. Prints TFLOP/s (the FLOP count of
include/tileattn/flops.hpp, taken from the extension) and the fraction of the bf16 matmul rate
measured at the start. `--only tileattn_deterministic` adds tileattn with deterministic=True (run
only when named), and the ratios then give its backward time over the default's; `--headdim D`
keeps the grid's shapes of head dim D.

A PNG plot is written beside each CSV. Failures are recorded in the status column, never fatal.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from . import _common

SEQ_LENS = [256, 1024, 4096, 8192, 16384]
BATCH, D_MODEL = 8, 64
COLUMNS = ["implementation", "d_model", "seq_len", "forward_ms", "forward_peak_MiB", "backward_ms",
           "backward_peak_MiB", "saved_activations_MiB", "status", "gpu"]


def _course_impls(causal: bool):
    import tileattn

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours(q, k, v):
        return tileattn.FlashAttentionFunction.apply(q, k, v, causal)

    return {"pytorch_sdpa": sdpa, "tileattn": ours}


def _measure(fn, inputs, warmup: int, passes: int, row: dict) -> None:
    """Fills forward/backward times, peaks and saved activations of fn(*inputs) into row."""
    def clear_grads():
        for t in inputs:
            t.grad = None

    try:
        fwd = _common.time_each(lambda: fn(*inputs), warmup, passes)
        row["forward_ms"] = _common.mean_std(fwd)[0]
        row["forward_peak_MiB"] = _common.peak_mib(lambda: fn(*inputs))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn(*inputs)
        torch.cuda.synchronize()
        row["saved_activations_MiB"] = (torch.cuda.memory_allocated() - before
                                        - out.numel() * out.element_size()) / _common.MIB
    except Exception as error:  # recorded in the row, never fatal
        row["status"] = "OOM" if _common.is_oom(error) else f"failed: {type(error).__name__}: {error}"[:200]
        return
    try:
        dout = torch.randn_like(out)
        graph = {"out": out}
        del out

        def fresh_forward():
            # Each timed backward gets its own untimed forward: compiled backwards free (donate)
            # their saved buffers, so one graph cannot be replayed with retain_graph.
            clear_grads()
            graph["out"] = None
            graph["out"] = fn(*inputs)

        def backward():
            graph["out"].backward(dout)

        bwd = _common.time_each(backward, warmup, passes, before=fresh_forward)
        row["backward_ms"] = _common.mean_std(bwd)[0]
        fresh_forward()
        row["backward_peak_MiB"] = _common.peak_mib(backward)
        graph["out"] = None
        clear_grads()
        row["status"] = "ok"
    except Exception as error:  # recorded in the row, never fatal
        row["status"] = "OOM(backward)" if _common.is_oom(error) else f"failed(backward): {error}"[:200]


def run_course(impls: list[str], causal: bool, warmup: int, passes: int, seq_lens=SEQ_LENS):
    import pandas as pd

    device = _common.require_cuda("tileattn.bench.attention")
    gpu = torch.cuda.get_device_name(device)
    functions = _course_impls(causal)
    rows, total, done = [], len(impls) * len(seq_lens), 0
    for name in impls:
        torch._dynamo.reset()
        compiled = torch.compile(functions[name])
        for n in seq_lens:
            done += 1
            row = dict(implementation=name, d_model=D_MODEL, seq_len=n, forward_ms=math.nan,
                       forward_peak_MiB=math.nan, backward_ms=math.nan, backward_peak_MiB=math.nan,
                       saved_activations_MiB=math.nan, status="", gpu=gpu)
            try:
                inputs = [torch.randn(BATCH, n, D_MODEL, device=device, requires_grad=True) for _ in range(3)]
                _measure(compiled, inputs, warmup, passes, row)
            except Exception as error:  # allocating the inputs
                row["status"] = "OOM" if _common.is_oom(error) else f"failed: {error}"[:200]
            finally:
                inputs = None
                _common.release_memory()
            rows.append(row)
            _common.progress(done, total, f"{name} seq_len={n}: {row['status']} "
                             f"fwd {row['forward_ms']:.3f} ms, bwd {row['backward_ms']:.3f} ms")
    return pd.DataFrame(rows, columns=COLUMNS)


def plot_course(frame, path: str, tf32: bool) -> None:
    """Both implementations on the same axes: time and peak memory of each pass, and what the forward
    leaves for the backward; log scales, as the two sides differ by orders of magnitude at 16k."""
    _common.save_plot(frame, "seq_len",
                      ["forward_ms", "backward_ms", "forward_peak_MiB", "backward_peak_MiB", "saved_activations_MiB"],
                      "implementation", path,
                      f"attention fp32{' (TF32 allowed)' if tf32 else ''}, batch {BATCH}, d_model {D_MODEL} "
                      f"({frame.gpu.iloc[0]})", logy=True)


# ---- --preset h100 ---------------------------------------------------------------------------

H100_TOKENS, H100_HIDDEN = 16 * 1024, 2048
H100_HEADDIMS, H100_SEQ_LENS = [64, 128], [1024, 4096, 16384]
# Beyond the square grid, (D, N, heads, heads_kv) at B x N = 16k tokens: GQA 4:1, and the wide head
# dims, where SDPA's cuDNN and flash backends run kernels of their own.
H100_EXTRA_SHAPES = [(128, 4096, 32, 8), (192, 4096, 16, 16), (256, 4096, 8, 8)]


# Implementations the preset runs only when --only names them.
H100_OPT_IN = ("tileattn_deterministic",)


def h100_configs(headdims=None):
    """(D, N, causal, batch, heads, heads_kv) of the --preset h100 grid, in the order it runs; with
    headdims, only the shapes of those head dims."""
    square = [(d, n, H100_HIDDEN // d, H100_HIDDEN // d) for d in H100_HEADDIMS for n in H100_SEQ_LENS]
    return [(d, n, c, H100_TOKENS // n, h, hkv) for d, n, h, hkv in square + H100_EXTRA_SHAPES for c in (False, True)
            if headdims is None or d in headdims]


def _h100_impls(causal: bool, seqlen: int, device):
    import tileattn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_with(backend):
        def fn(q, k, v):  # q, k, v: (batch, seqlen, heads, D); SDPA sees (batch, heads, seqlen, D) views
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
        return fn

    def ours(q, k, v):
        return tileattn.flash_attn_func(q, k, v, causal=causal)

    def ours_deterministic(q, k, v):
        return tileattn.flash_attn_func(q, k, v, causal=causal, deterministic=True)

    impls = {"tileattn": ours,
             "tileattn_deterministic": ours_deterministic,
             "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
             "sdpa_efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return impls
    flex = torch.compile(flex_attention)
    try:
        mask = (create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seqlen, seqlen,
                                  device=device) if causal else None)
    except Exception as error:  # recorded as this peer's status
        reason = f"create_block_mask: {error}"

        def flex_fn(q, k, v):
            raise RuntimeError(reason)
    else:
        def flex_fn(q, k, v):
            return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                        enable_gqa=k.shape[2] != q.shape[2])

    impls["flex_attention"] = flex_fn
    return impls


def run_h100(warmup: int, passes: int, impl_filter: list[str] | None, headdims=None):
    import pandas as pd

    import tileattn

    device = _common.require_cuda("tileattn.bench.attention --preset h100")
    gpu = torch.cuda.get_device_name(device)
    matmul = _common.measured_matmul_tflops(device)
    print(f"{gpu}: measured bf16 matmul rate {matmul:.0f} TFLOP/s", flush=True)
    configs = h100_configs(headdims)
    rows, done = [], 0
    total = len(configs) * (5 if impl_filter is None else len(impl_filter))
    for d, n, causal, batch, heads, heads_kv in configs:
        fwd_flops = tileattn.attention_forward_flops(batch, heads, n, n, d, d, causal)
        bwd_flops = tileattn.attention_backward_flops(batch, heads, n, n, d, d, causal)
        for name, fn in _h100_impls(causal, n, device).items():
            wanted = name in impl_filter if impl_filter is not None else name not in H100_OPT_IN
            if not wanted:
                continue
            done += 1
            row = dict(implementation=name, headdim=d, seq_len=n, batch=batch, heads=heads, heads_kv=heads_kv,
                       causal=causal, forward_ms=math.nan, forward_peak_MiB=math.nan, backward_ms=math.nan,
                       backward_peak_MiB=math.nan, saved_activations_MiB=math.nan, status="", gpu=gpu)
            try:
                inputs = [torch.randn(batch, n, h, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                          for h in (heads, heads_kv, heads_kv)]
                _measure(fn, inputs, warmup, passes, row)
            except Exception as error:
                row["status"] = "OOM" if _common.is_oom(error) else f"failed: {error}"[:200]
            finally:
                inputs = None
                _common.release_memory()
            if row["status"].startswith("failed") and "No available kernel" in row["status"]:
                row["status"] = "unsupported"
            row["forward_tflops"] = fwd_flops / (row["forward_ms"] * 1e-3) / 1e12
            row["backward_tflops"] = bwd_flops / (row["backward_ms"] * 1e-3) / 1e12
            row["forward_matmul_fraction"] = row["forward_tflops"] / matmul
            row["backward_matmul_fraction"] = row["backward_tflops"] / matmul
            rows.append(row)
            _common.progress(done, total,
                             f"{name:15s} D={d:3d} N={n:5d} H={heads}/{heads_kv} causal={int(causal)} "
                             f"{row['status']:>8s}  "
                             f"fwd {row['forward_tflops']:6.1f} TFLOP/s ({row['forward_matmul_fraction']:5.1%})  "
                             f"bwd {row['backward_tflops']:6.1f} TFLOP/s ({row['backward_matmul_fraction']:5.1%})")
    frame = pd.DataFrame(rows)
    frame["matmul_tflops"] = matmul
    return frame


def ratios_h100(frame):
    """Per shape, SDPA's time over tileattn's (above 1: tileattn is faster) for the forward, the
    backward and a training step (their sum), against cuDNN and against the fastest SDPA backend of
    each column (for the step: the backend with the fastest step); where tileattn_deterministic ran,
    its backward time over tileattn's (deterministic_backward_cost). Rows that did not run are left out."""
    import pandas as pd

    key = ["headdim", "seq_len", "heads", "heads_kv", "causal"]
    ok = frame[frame["status"] == "ok"].assign(step_ms=lambda f: f["forward_ms"] + f["backward_ms"])
    ours = ok[ok["implementation"] == "tileattn"].set_index(key)
    sdpa = ok[ok["implementation"].str.startswith("sdpa_")]
    peers = {"cudnn": sdpa[sdpa["implementation"] == "sdpa_cudnn"].set_index(key),
             "best_sdpa": sdpa.groupby(key)[["forward_ms", "backward_ms", "step_ms"]].min()}
    out = pd.DataFrame(index=ours.index)
    for name, ref in peers.items():
        for col in ("forward", "backward", "step"):
            out[f"{col}_vs_{name}"] = ref[f"{col}_ms"].reindex(ours.index) / ours[f"{col}_ms"]
    deterministic = ok[ok["implementation"] == "tileattn_deterministic"].set_index(key)
    if len(deterministic):
        out["deterministic_backward_cost"] = deterministic["backward_ms"].reindex(ours.index) / ours["backward_ms"]
    return out.reset_index()


def _plot_h100(frame, path: str) -> None:
    """One panel per (head dim, pass); colour = implementation, dashed = causal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headdims = sorted(frame.headdim.unique())
    fig, axes = plt.subplots(len(headdims), 2, figsize=(11, 4 * len(headdims)), squeeze=False)
    colours = {name: f"C{i}" for i, name in enumerate(frame.implementation.unique())}
    for row, d in enumerate(headdims):
        for col, metric in enumerate(["forward_tflops", "backward_tflops"]):
            ax = axes[row][col]
            shapes = frame[frame.headdim == d].assign(gqa=lambda f: f.heads != f.heads_kv)
            for (name, causal, gqa), group in shapes.groupby(["implementation", "causal", "gqa"]):
                group = group.dropna(subset=[metric])
                ax.plot(group.seq_len, group[metric], marker="s" if gqa else "o", color=colours[name],
                        linestyle="--" if causal else "-",
                        label=f"{name}{' GQA' if gqa else ''}{' causal' if causal else ''}")
            ax.axhline(frame.matmul_tflops.iloc[0], color="grey", linewidth=0.8, label="bf16 matmul (measured)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("seq_len")
            ax.set_ylabel(f"{metric.split('_')[0]} TFLOP/s")
            ax.set_title(f"D = {d}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"attention bf16, 16k tokens ({frame.gpu.iloc[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tileattn.bench.attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["pytorch_sdpa", "tileattn"], action="append",
                        help="implementation(s) to run on the default grid (default: both)")
    parser.add_argument("--preset", choices=["h100"], help="the bf16 H100 grid beside every PyTorch peer")
    parser.add_argument("--only", action="append",
                        help="--preset h100: implementation(s) to run (tileattn, sdpa_flash, sdpa_cudnn, "
                             "sdpa_efficient, flex_attention, and tileattn_deterministic, which runs only when "
                             "named; default all the others)")
    parser.add_argument("--headdim", type=int, action="append", choices=sorted({c[0] for c in h100_configs()}),
                        help="--preset h100: only the shapes of this head dim (repeatable; default all)")
    parser.add_argument("--causal", action="store_true", help="default grid: causal mask")
    parser.add_argument("--tf32", action="store_true",
                        help="default grid: TF32 allowed (torch.set_float32_matmul_precision('high')), which is "
                             "tileattn's fp32 fast mode and lets PyTorch use TF32 too")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--csv", help="default outputs/csv/attention_benchmark.csv (attention_h100.csv with "
                                      "--preset h100)")
    args = parser.parse_args(argv)
    _common.require_cuda(parser.prog)
    _common.require_extras(parser.prog)

    if args.preset == "h100":
        frame = run_h100(args.warmup, args.passes, args.only, args.headdim)
        path = _common.output_path(args.csv or "outputs/csv/attention_h100.csv")
        frame.to_csv(path, index=False)
        _plot_h100(frame, path.rsplit(".", 1)[0] + ".png")
        columns = ["implementation", "headdim", "seq_len", "heads", "heads_kv", "causal", "status", "forward_ms",
                   "forward_tflops", "forward_matmul_fraction", "backward_ms", "backward_tflops",
                   "backward_matmul_fraction"]
        print(frame[columns].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print("SDPA's time over tileattn's (above 1: tileattn is faster):")
        print(ratios_h100(frame).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    else:
        if args.tf32:
            torch.set_float32_matmul_precision("high")
            torch.backends.cuda.matmul.allow_tf32 = True
        frame = run_course(args.impl or ["pytorch_sdpa", "tileattn"], args.causal, args.warmup, args.passes)
        path = _common.output_path(args.csv or "outputs/csv/attention_benchmark.csv")
        frame.to_csv(path, index=False)
        plot_course(frame, path.rsplit(".", 1)[0] + ".png", args.tf32)
        print(frame.drop(columns=["gpu"]).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
