"""PyTorch peers for tools/device/bench_fp32.cu, same CSV: impl,case,ms,tflops,extra_mib.

  torch.softmax(x, -1) @ v   fp32 with TF32 off and on, fp16, bf16 (batch 16, 2048 x 8192 x 512)
  SDPA fp32                  the attention shapes bench_fp32.cu times (TF32 off; PyTorch picks the backend)

extra_mib is the peak memory the call allocates beyond its inputs and output.
"""
import torch
import torch.nn.functional as F


def time_ms(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times, total = [], 0.0
    while len(times) < 5 or (total < 300.0 and len(times) < 50):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        total += times[-1]
    times.sort()
    return times[len(times) // 2]


def extra_mib(fn, out_bytes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return (peak - out_bytes) / 2**20


def softmax_matmul(b, d1, d2, d3):
    flops = 2.0 * b * d1 * d2 * d3
    for name, dtype, tf32 in (("f32", torch.float32, False), ("f32", torch.float32, True),
                              ("f16", torch.float16, False), ("bf16", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        x = torch.randn(b, d1, d2, device="cuda", dtype=dtype)
        v = torch.randn(b, d2, d3, device="cuda", dtype=dtype)
        fn = lambda: torch.softmax(x, -1) @ v
        ms = time_ms(fn)
        extra = extra_mib(fn, b * d1 * d3 * x.element_size())
        impl = "torch_tf32" if tf32 else ("torch_fp32" if dtype == torch.float32 else "torch")
        print(f"{impl},softmax_matmul_{name}_b{b}_{d1}x{d2}x{d3},{ms:.3f},{flops / ms / 1e9:.1f},{extra:.0f}", flush=True)
        del x, v
    torch.backends.cuda.matmul.allow_tf32 = False


def sdpa(b, h, n, d, causal):
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float32) for _ in range(3))
    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    print(f"sdpa_fp32,attention_f32_b{b}_h{h}_n{n}_d{d}{'_causal' if causal else ''},{ms:.3f},{flops / ms / 1e9:.1f},0",
          flush=True)


def main():
    print("impl,case,ms,tflops,extra_mib")
    sdpa(8, 1, 16384, 64, False)
    sdpa(8, 1, 16384, 64, True)
    sdpa(2, 8, 8192, 128, False)
    softmax_matmul(16, 2048, 8192, 512)


if __name__ == "__main__":
    main()
