"""PyTorch SDPA backward (flash backend) on the shapes tools/device/bench_backward.cu times, same CSV.

Usage: python3 tools/device/sdpa_bwd_peer.py B,H,Nq,Nk,D,causal ...
bf16 in SDPA's (batch, heads, seqlen, dim) layout; the forward runs once and only the backward
(autograd.grad of dQ, dK, dV) is timed. Causal with Nq != Nk is skipped (SDPA aligns top-left).
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def backward_flops(b, h, nq, nk, d, causal):
    f = 2.5 * 4.0 * b * h * nq * nk * d
    return f / 2 if causal else f


def time_ms(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, total = [], 0.0
    while len(times) < 10 or (total < 500.0 and len(times) < 100):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        total += times[-1]
    times.sort()
    return times[len(times) // 2]


def main():
    print("impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops")
    for arg in sys.argv[1:]:
        b, h, nq, nk, d, causal = (int(x) for x in arg.split(","))
        if causal and nq != nk:
            continue
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for n in (nq, nk, nk))
        dout = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            ms = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        print(f"sdpa_flash,bf16,{b},{h},{nq},{nk},{d},{causal},{ms:.4f},"
              f"{backward_flops(b, h, nq, nk, d, causal) / ms / 1e9:.1f}", flush=True)


if __name__ == "__main__":
    main()
