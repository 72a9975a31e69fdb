"""PyTorch SDPA (flash backend) on the shapes tools/device/bench_forward.cu times, same CSV.

Usage: python3 tools/device/sdpa_peer.py B,H,Nq,Nk,D,causal ...
Tensors are bf16 in SDPA's (batch, heads, seqlen, dim) layout. Causal with Nq != Nk is skipped:
SDPA aligns its causal mask top-left, tileattn (like flash-attn) bottom-right.
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def forward_flops(b, h, nq, nk, d, causal):
    f = 4.0 * b * h * nq * nk * d
    return f / 2 if causal else f


def time_ms(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, total = [], 0.0
    while len(times) < 10 or (total < 500.0 and len(times) < 200):
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
    print("impl,dtype,batch,heads,seqlen_q,seqlen_k,headdim,causal,ms,tflops,gbps")
    for arg in sys.argv[1:]:
        b, h, nq, nk, d, causal = (int(x) for x in arg.split(","))
        if causal and nq != nk:
            continue
        q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)))
        nbytes = 2.0 * (2 * q.numel() + 2 * k.numel())
        print(f"sdpa_flash,bf16,{b},{h},{nq},{nk},{d},{causal},{ms:.4f},"
              f"{forward_flops(b, h, nq, nk, d, causal) / ms / 1e9:.1f},{nbytes / ms / 1e6:.0f}", flush=True)


if __name__ == "__main__":
    main()
