"""PyTorch peers of the device benchmarks, printing the CSV their tileattn counterparts print.

  python3 tools/device/peers.py forward  B,H,Nq,Nk,D,causal[,Hkv] ...   SDPA forward   (bench_attention --pass forward)
  python3 tools/device/peers.py backward B,H,Nq,Nk,D,causal[,Hkv] ...   SDPA backward  (bench_attention --pass backward)
  python3 tools/device/peers.py fp32                              softmax(x) @ v, SDPA fp32 (bench_fp32)

forward/backward: bf16, SDPA's flash and cuDNN backends, each timed on both layouts of the same
shape, contiguous (batch, heads, seqlen, dim) and a (batch, seqlen, heads, dim) buffer seen
through transpose(1, 2) (flash-attn's own layout, the one tileattn's harness uses); the faster is
printed, and nothing where a backend refuses the shape. Causal with Nq != Nk is skipped: SDPA
aligns its causal mask top-left, tileattn (like flash-attn) bottom-right. The backward runs the
forward once and times only autograd.grad of dQ, dK, dV.
fp32: torch.softmax(x, -1) @ v in fp32 with TF32 off and on, fp16, bf16 (batch 16,
2048 x 8192 x 512), and SDPA fp32 (TF32 off; PyTorch picks the backend) on bench_fp32's
attention shapes. extra_mib is the peak memory a call allocates beyond its inputs and output.
Times are the median of CUDA-event-timed calls after warm-up, queued back to back (time_ms), with
each harness's run counts.
"""
import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_COLUMNS = "impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops"  # then gbps (forward), heads_kv


@dataclass(frozen=True)
class Timing:
    warmup: int
    min_runs: int
    budget_ms: float
    max_runs: int


FORWARD_TIMING = Timing(3, 10, 500.0, 200)
BACKWARD_TIMING = Timing(3, 10, 500.0, 100)
FP32_TIMING = Timing(2, 5, 300.0, 50)


def time_ms(fn, timing):
    """Median ms of calls queued back to back, each between its own events (as bench_common.cuh):
    the GPU stays busy, so a call's host work (SDPA's dispatch, cuDNN's plan) overlaps the calls
    before it, as in a training loop. How many: the budget over one call's time."""
    for _ in range(timing.warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    runs = min(timing.max_runs, max(timing.min_runs, int(timing.budget_ms / max(start.elapsed_time(stop), 1e-3)) + 1))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(stop) for start, stop in events)
    return times[len(times) // 2]


def row(*fields):
    print(",".join(str(f) for f in fields), flush=True)


def attention_flops(b, h, nq, nk, d, causal, factor=1.0):
    f = factor * 4.0 * b * h * nq * nk * d
    return f / 2 if causal else f


def shape(arg):
    """B,H,Nq,Nk,D,causal[,Hkv]: H query heads, Hkv key/value heads (default H; SDPA's enable_gqa)."""
    fields = arg.split(",")
    if len(fields) not in (6, 7):
        raise argparse.ArgumentTypeError(f"bad shape '{arg}' (want B,H,Nq,Nk,D,causal[,Hkv])")
    values = [int(x) for x in fields]
    if len(values) == 6:
        values.append(values[1])
    if values[6] <= 0 or values[1] % values[6] != 0:
        raise argparse.ArgumentTypeError(f"bad shape '{arg}' (Hkv must divide H)")
    return tuple(values)


def sdpa_inputs(b, h, n, d, bshd, requires_grad=False):
    if bshd:
        t = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        t = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    return t.requires_grad_(requires_grad)


# SDPA's backends as peers: flash (the yardstick) and cuDNN (often the fastest on Hopper).
PEER_BACKENDS = (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))


def best_of_layouts(backend, b, h, nq, nk, d, causal, timing, backward=False, hkv=None):
    """The faster of the two layouts, in ms; None where the backend refuses the shape."""
    best = None
    hkv = h if hkv is None else hkv
    gqa = {"enable_gqa": True} if hkv != h else {}
    for bshd in (False, True):
        q = sdpa_inputs(b, h, nq, d, bshd, requires_grad=backward)
        k, v = (sdpa_inputs(b, hkv, nk, d, bshd, requires_grad=backward) for _ in range(2))
        try:
            with sdpa_kernel(backend):
                if backward:
                    dout = sdpa_inputs(b, h, nq, d, bshd)
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), **gqa)
                    fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                else:
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), **gqa)
                ms = time_ms(fn, timing)
        except RuntimeError:
            continue
        finally:
            del q, k, v
        best = ms if best is None else min(best, ms)
    return best


def forward(shapes):
    row(ATTENTION_COLUMNS + ",gbps,heads_kv")
    for b, h, nq, nk, d, causal, hkv in shapes:
        if causal and nq != nk:
            continue
        nbytes = 2.0 * (2 * b * h * nq * d + 2 * b * hkv * nk * d)
        for name, backend in PEER_BACKENDS:
            best = best_of_layouts(backend, b, h, nq, nk, d, causal, FORWARD_TIMING, hkv=hkv)
            if best is None:
                continue
            row(name, "bf16", b, h, nq, nk, d, causal, f"{best:.4f}",
                f"{attention_flops(b, h, nq, nk, d, causal) / best / 1e9:.1f}", f"{nbytes / best / 1e6:.0f}", hkv)


def backward(shapes):
    row(ATTENTION_COLUMNS + ",heads_kv")
    for b, h, nq, nk, d, causal, hkv in shapes:
        if causal and nq != nk:
            continue
        for name, backend in PEER_BACKENDS:
            best = best_of_layouts(backend, b, h, nq, nk, d, causal, BACKWARD_TIMING, backward=True, hkv=hkv)
            if best is None:
                continue
            row(name, "bf16", b, h, nq, nk, d, causal, f"{best:.4f}",
                f"{attention_flops(b, h, nq, nk, d, causal, factor=2.5) / best / 1e9:.1f}", hkv)


def extra_mib(fn, out_bytes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return (peak - out_bytes) / 2**20


def fp32_sdpa(b, h, n, d, causal):
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float32) for _ in range(3))
    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), FP32_TIMING)
    flops = attention_flops(b, h, n, n, d, causal)
    row("sdpa_fp32", f"attention_f32_b{b}_h{h}_n{n}_d{d}{'_causal' if causal else ''}", f"{ms:.3f}",
        f"{flops / ms / 1e9:.1f}", 0)


def fp32_softmax_matmul(b, d1, d2, d3):
    flops = 2.0 * b * d1 * d2 * d3
    for name, dtype, tf32 in (("f32", torch.float32, False), ("f32", torch.float32, True),
                              ("f16", torch.float16, False), ("bf16", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        x = torch.randn(b, d1, d2, device="cuda", dtype=dtype)
        v = torch.randn(b, d2, d3, device="cuda", dtype=dtype)
        fn = lambda: torch.softmax(x, -1) @ v
        ms = time_ms(fn, FP32_TIMING)
        extra = extra_mib(fn, b * d1 * d3 * x.element_size())
        impl = "torch_tf32" if tf32 else ("torch_fp32" if dtype == torch.float32 else "torch")
        row(impl, f"softmax_matmul_{name}_b{b}_{d1}x{d2}x{d3}", f"{ms:.3f}", f"{flops / ms / 1e9:.1f}", f"{extra:.0f}")
        del x, v
    torch.backends.cuda.matmul.allow_tf32 = False


def fp32():
    row("impl,case,ms,tflops,extra_mib")
    fp32_sdpa(8, 1, 16384, 64, False)
    fp32_sdpa(8, 1, 16384, 64, True)
    fp32_sdpa(2, 8, 8192, 128, False)
    fp32_softmax_matmul(16, 2048, 8192, 512)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("forward", "backward"):
        sub.add_parser(name).add_argument("shapes", nargs="*", type=shape, metavar="B,H,Nq,Nk,D,causal[,Hkv]")
    sub.add_parser("fp32")
    args = parser.parse_args()
    if args.command == "fp32":
        fp32()
    else:
        (forward if args.command == "forward" else backward)(args.shapes)


if __name__ == "__main__":
    main()
