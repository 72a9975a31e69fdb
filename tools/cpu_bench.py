#!/usr/bin/env python3
"""CPU timing of tileattn against torch.nn.functional.scaled_dot_product_attention, fp32, at equal
thread counts, through both of tileattn's entry points:

  flash: tileattn.flash_attn_func on (B, N, H, D) tensors
  sdpa:  tileattn.scaled_dot_product_attention on (B, H, N, D) tensors (read through strides)

torch always runs on (B, H, N, D) contiguous tensors, its own layout. Each round times tileattn and
torch back to back (alternating which goes first), so load from other processes hits both alike;
the figure is the median over rounds of the per-call time, and the spread (max/min of the
per-round ratios) says how noisy the machine was. With --interleave each round alternates single
calls (torch, tileattn, torch, ...) and times each, so every call follows the other library's, as
in a model that mixes attention with torch's own ops; otherwise each round times a batch of calls
of one library, then of the other.

  python3 tools/cpu_bench.py                       # the default shapes, 2 threads
  python3 tools/cpu_bench.py --threads 1 --rounds 15 --shapes 1,16,2048,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tileattn

DEFAULT_SHAPES = ["1,16,2048,64", "1,8,1024,64", "1,16,1,64"]


def _time(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _calls(entry: str, b: int, h: int, n: int, d: int, causal: bool, backward: bool):
    """(tileattn_call, torch_call): zero-argument callables doing one forward or one backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    tq, tk, tv = (t.clone().requires_grad_(backward) for t in (q, k, v))
    if entry == "flash":
        aq, ak, av = (t.transpose(1, 2).contiguous().requires_grad_(backward) for t in (q, k, v))
        ado = do.transpose(1, 2).contiguous()

        def ours_fwd():
            return tileattn.flash_attn_func(aq, ak, av, causal=causal)
    else:
        aq, ak, av = (t.clone().requires_grad_(backward) for t in (q, k, v))
        ado = do

        def ours_fwd():
            return tileattn.scaled_dot_product_attention(aq, ak, av, is_causal=causal)

    def torch_fwd():
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    if not backward:
        def ours():
            with torch.no_grad():
                ours_fwd()

        def theirs():
            with torch.no_grad():
                torch_fwd()
        return ours, theirs
    out_ours, out_torch = ours_fwd(), torch_fwd()
    return (lambda: torch.autograd.grad(out_ours, (aq, ak, av), ado, retain_graph=True),
            lambda: torch.autograd.grad(out_torch, (tq, tk, tv), do, retain_graph=True))


def measure(ours, theirs, rounds: int, min_time: float, interleave: bool = False):
    ours(), theirs()  # warm-up (first-call allocations, thread start)
    per_call = _time(theirs, 1)
    iters = max(1, int(min_time / max(per_call, 1e-7)))
    t_ours, t_theirs = [], []
    for r in range(rounds):
        pair = [(ours, t_ours), (theirs, t_theirs)]
        if r % 2:
            pair = pair[::-1]
        if interleave:
            sums = [0.0, 0.0]
            for _ in range(iters):
                for i, (fn, _out) in enumerate(pair):
                    sums[i] += _time(fn, 1)
            for (_fn, out), total in zip(pair, sums):
                out.append(total / iters)
            continue
        for fn, out in pair:
            out.append(_time(fn, iters))
    ratios = [a / b for a, b in zip(t_ours, t_theirs)]
    return statistics.median(t_ours), statistics.median(t_theirs), min(ratios), max(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timed batch of calls")
    parser.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="B,H,N,D (seqlen_q = seqlen_k = N)")
    parser.add_argument("--entries", nargs="*", default=["flash", "sdpa"], choices=["flash", "sdpa"])
    parser.add_argument("--passes", nargs="*", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--causal", nargs="*", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--interleave", action="store_true",
                        help="alternate single calls of the two libraries within each round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} rounds={args.rounds} interleave={args.interleave} torch {torch.__version__}")
    print(f"{'entry':6} {'pass':4} {'shape (B,H,N,D)':18} {'causal':6} {'tileattn':>11} {'torch':>11} "
          f"{'ratio':>6} {'spread':>12}")
    for shape in args.shapes:
        b, h, n, d = (int(x) for x in shape.split(","))
        for causal in (c == "yes" for c in args.causal):
            for entry in args.entries:
                for pass_ in args.passes:
                    ours, theirs = _calls(entry, b, h, n, d, causal, pass_ == "bwd")
                    a, t, lo, hi = measure(ours, theirs, args.rounds, args.min_time, args.interleave)
                    print(f"{entry:6} {pass_:4} {shape:18} {str(causal):6} {a * 1e6:9.1f}us {t * 1e6:9.1f}us "
                          f"{a / t:6.2f} {lo:5.2f}-{hi:5.2f}", flush=True)


if __name__ == "__main__":
    main()
