"""Host overhead of one attention call: its wall time back to back minus its GPU time.

A tiny problem (default bf16, batch 1, one head, seqlen 128, head dim 64) is called in a loop, eager
and under ``torch.compile(fullgraph=True)``, forward alone and forward + backward, for tileattn
(``flash_attn_func``) and for PyTorch's SDPA as a user calls it (its default backend choice). The
GPU time of a call is taken from a CUDA graph of the same calls replayed (no host work between the
kernels); overhead = wall time per call - GPU time per call.

    python -m tileattn.bench.overhead [--calls 2000] [--seqlen 128] [--headdim 64] [--csv FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import tileattn

from ._common import require_cuda


def _make(shape_bsnd, dtype, device, requires_grad):
    return [torch.randn(shape_bsnd, dtype=dtype, device=device, requires_grad=requires_grad) for _ in range(3)]


def _calls(impl: str, backward: bool, args):
    """A zero-argument function doing one call (and its backward), with its own inputs."""
    device = torch.device("cuda")
    b, n, h, d = 1, args.seqlen, args.heads, args.headdim
    dtype = getattr(torch, args.dtype)
    if impl == "tileattn":
        q, k, v = _make((b, n, h, d), dtype, device, backward)

        def attn(q, k, v):
            return tileattn.flash_attn_func(q, k, v, causal=args.causal)
    else:
        q, k, v = _make((b, h, n, d), dtype, device, backward)

        def attn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

    grad = None
    if backward:
        with torch.no_grad():
            grad = torch.randn_like(attn(q, k, v))
    return attn, (q, k, v), grad


def _one(fn, inputs, grad):
    out = fn(*inputs)
    if grad is not None:
        q, k, v = inputs
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out


def _wall_us(fn, inputs, grad, calls: int) -> float:
    for _ in range(20):
        _one(fn, inputs, grad)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        _one(fn, inputs, grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _gpu_us(fn, inputs, grad, calls: int) -> float:
    # Replaying a graph of `per_graph` calls leaves no host work between kernels.
    per_graph = 50
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            _one(fn, inputs, grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            _one(fn, inputs, grad)
    graph.replay()
    torch.cuda.synchronize()
    replays = max(1, calls // per_graph)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (replays * per_graph)


def measure(impl: str, mode: str, backward: bool, args) -> dict:
    fn, inputs, grad = _calls(impl, backward, args)
    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    wall = _wall_us(fn, inputs, grad, args.calls)
    try:
        gpu = _gpu_us(fn, inputs, grad, args.calls)
    except Exception as error:  # a peer that cannot be captured still reports its wall time
        print(f"overhead: {impl} {mode} could not be captured in a CUDA graph ({error}); GPU time unknown",
              file=sys.stderr)
        gpu = float("nan")
    return dict(impl=impl, mode=mode, direction="fwd+bwd" if backward else "fwd", wall_us=wall, gpu_us=gpu,
                overhead_us=wall - gpu)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tileattn.bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.calls < 50:
        parser.error(f"--calls={args.calls} must be >= 50")
    require_cuda("tileattn.bench.overhead")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("eager", "compiled"):
            parser.error(f"--modes: {m!r} is not eager or compiled")
    rows = []
    device = torch.cuda.get_device_name()
    print(f"# {device}; {args.dtype} B=1 H={args.heads} N={args.seqlen} D={args.headdim}"
          f"{' causal' if args.causal else ''}; {args.calls} calls back to back", flush=True)
    print(f"{'impl':>9} {'mode':>9} {'pass':>8} {'wall us':>9} {'gpu us':>8} {'overhead us':>12}", flush=True)
    for mode in modes:
        for backward in (False, True):
            for impl in ("tileattn", "sdpa"):
                r = measure(impl, mode, backward, args)
                rows.append(r)
                print(f"{r['impl']:>9} {r['mode']:>9} {r['direction']:>8} {r['wall_us']:9.1f} {r['gpu_us']:8.1f} "
                      f"{r['overhead_us']:12.1f}", flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,impl,mode,direction,wall_us,gpu_us,overhead_us\n")
            for r in rows:
                f.write(f"{device},{r['impl']},{r['mode']},{r['direction']},{r['wall_us']:.2f},{r['gpu_us']:.2f},"
                        f"{r['overhead_us']:.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
