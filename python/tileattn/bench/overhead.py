"""Host overhead of one attention call: its wall time back to back minus its device time.

A tiny problem (default batch 1, one head, seqlen 128, head dim 64; bf16 on a GPU, fp32 on the CPU)
is called in a loop, eager and under ``torch.compile(fullgraph=True)``, forward alone and forward +
backward, for tileattn (``flash_attn_func``) and for PyTorch's SDPA as a user calls it (its default
backend choice). Every case is timed in ``--rounds`` rounds, the order of the cases reversed from
one round to the next, and the best round is kept, so that a slow spell of the machine does not
land on one side only; the ratio of tileattn's overhead to SDPA's is also given per round (median
and range), each round's two figures taken a few milliseconds apart.

On a GPU the device time of a call is taken from a CUDA graph of the same calls replayed (no host
work between the kernels) and overhead = wall time per call - GPU time per call. On the CPU
(``--device cpu``) the work itself is host time: the table gives the wall time per call beside
SDPA's, which for tiny problems is almost all Python and framework overhead.

    python -m tileattn.bench.overhead [--device cuda|cpu] [--calls 2000] [--rounds 3] [--seqlen 128]
                                      [--headdim 64] [--csv FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tileattn

from ._common import require_cuda


def _make(shape_bsnd, dtype, device, requires_grad):
    return [torch.randn(shape_bsnd, dtype=dtype, device=device, requires_grad=requires_grad) for _ in range(3)]


def _calls(impl: str, backward: bool, args):
    """A function doing one call, its inputs and (for the backward) the gradient of its output."""
    b, n, h, d = 1, args.seqlen, args.heads, args.headdim
    dtype = getattr(torch, args.dtype)
    if impl == "tileattn":
        q, k, v = _make((b, n, h, d), dtype, args.device, backward)

        def attn(q, k, v):
            return tileattn.flash_attn_func(q, k, v, causal=args.causal)
    else:
        q, k, v = _make((b, h, n, d), dtype, args.device, backward)

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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _wall_us(fn, inputs, grad, calls: int, device: torch.device) -> float:
    for _ in range(20):
        _one(fn, inputs, grad)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        _one(fn, inputs, grad)
    _synchronize(device)
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


class _Case:
    """One (impl, mode, pass): its callable built (and compiled) once, timed in every round."""

    def __init__(self, impl: str, mode: str, backward: bool, args):
        self.impl, self.mode, self.backward = impl, mode, backward
        self.fn, self.inputs, self.grad = _calls(impl, backward, args)
        if mode == "compiled":
            self.fn = torch.compile(self.fn, fullgraph=True)
        self.walls = []

    def row(self, gpu_us: float) -> dict:
        wall = min(self.walls)
        return dict(impl=self.impl, mode=self.mode, direction="fwd+bwd" if self.backward else "fwd", wall_us=wall,
                    gpu_us=gpu_us, overhead_us=wall - gpu_us, rounds_us=[w - gpu_us for w in self.walls])


def measure_all(args) -> list[dict]:
    """Every case of args.modes, timed in args.rounds alternating rounds; a row per case."""
    torch._dynamo.reset()
    cases = [_Case(impl, mode, backward, args) for mode in args.modes for backward in (False, True)
             for impl in ("tileattn", "sdpa")]
    for r in range(args.rounds):
        for case in (cases if r % 2 == 0 else reversed(cases)):
            case.walls.append(_wall_us(case.fn, case.inputs, case.grad, args.calls, args.device))
    rows = []
    for case in cases:
        gpu = 0.0
        if args.device.type == "cuda":
            try:
                gpu = _gpu_us(case.fn, case.inputs, case.grad, args.calls)
            except Exception as error:  # a peer that cannot be captured still reports its wall time
                print(f"overhead: {case.impl} {case.mode} could not be captured in a CUDA graph ({error}); GPU time "
                      "unknown", file=sys.stderr)
                gpu = float("nan")
        rows.append(case.row(gpu))
    return rows


def paired_ratios(rows: list[dict]) -> list[tuple[str, str, list[float]]]:
    """(mode, direction, ratios): tileattn's overhead over SDPA's in each round, sorted, for every
    tileattn row that has an SDPA row of the same mode and direction. The same round's two figures
    share the machine's state, so their ratio is steadier than either figure."""
    out = []
    for ours in (r for r in rows if r["impl"] == "tileattn"):
        peer = next((r for r in rows if r["impl"] == "sdpa" and r["mode"] == ours["mode"]
                     and r["direction"] == ours["direction"]), None)
        if peer is not None:
            ratios = sorted(a / b for a, b in zip(ours["rounds_us"], peer["rounds_us"]) if b > 0)
            out.append((ours["mode"], ours["direction"], ratios))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tileattn.bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--calls", type=int, default=2000, help="calls per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every case, in alternating order")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--modes", default="eager,compiled", help="comma list of eager, compiled")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.calls < 50:
        parser.error(f"--calls={args.calls} must be >= 50")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be >= 1")
    for name in ("seqlen", "heads", "headdim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in ("eager", "compiled"):
            parser.error(f"--modes: {m!r} is not eager or compiled")
    if args.device == "cuda":
        args.device = require_cuda("tileattn.bench.overhead")
        device_name = torch.cuda.get_device_name()
    else:
        args.device = torch.device("cpu")
        device_name = f"cpu ({torch.get_num_threads()} threads)"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    cpu = args.device.type == "cpu"
    print(f"# {device_name}; {args.dtype} B=1 H={args.heads} N={args.seqlen} D={args.headdim}"
          f"{' causal' if args.causal else ''}; {args.calls} calls back to back, best of {args.rounds} rounds"
          f"{'; on the cpu the wall time is the whole call' if cpu else ''}", flush=True)
    rows = measure_all(args)
    print(f"{'impl':>9} {'mode':>9} {'pass':>8} {'wall us':>9} {'gpu us':>8} {'overhead us':>12}", flush=True)
    for r in rows:
        gpu = f"{'-':>8}" if cpu else f"{r['gpu_us']:8.1f}"
        print(f"{r['impl']:>9} {r['mode']:>9} {r['direction']:>8} {r['wall_us']:9.1f} {gpu} {r['overhead_us']:12.1f}",
              flush=True)
    print("tileattn / SDPA overhead, paired by round: median (min - max)", flush=True)
    for mode, direction, ratios in paired_ratios(rows):
        if ratios:
            print(f"{mode:>9} {direction:>8} {statistics.median(ratios):6.2f} ({ratios[0]:.2f} - {ratios[-1]:.2f})",
                  flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("device,impl,mode,direction,wall_us,gpu_us,overhead_us\n")
            for r in rows:
                f.write(f"{device_name},{r['impl']},{r['mode']},{r['direction']},{r['wall_us']:.2f},"
                        f"{r['gpu_us']:.2f},{r['overhead_us']:.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
