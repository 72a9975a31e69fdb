"""Context-parallel attention on several GPUs: per ring step, the attention time of one block
against the time to send the K/V shard it needs, and the whole call's throughput.

Run under torchrun, one process per GPU (NCCL):

    torchrun --nproc-per-node 2 -m tileattn.bench.context_parallel [--seqlen 131072] [--headdim 128]
        [--heads 16] [--heads-kv 16] [--batch 1] [--dtype bfloat16] [--no-causal] [--mode ring]

Rank 0 prints, for the per-rank shard of the sequence: the K/V bytes one ring step sends, the time
of that exchange alone, the forward time of one full (non-diagonal) block and of the causal
diagonal, and their ratio (communication hides under compute when the block takes longer); then
forward and forward + backward of ``context_parallel_attn`` against one GPU running the whole
sequence with ``flash_attn_func`` (throughput ratio = one-GPU time / parallel time, the
issue's 1.8x-at-2-GPUs criterion). See docs/context_parallel.md for the model these numbers test.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import tileattn

from ._common import require_cuda

MODULE = "python -m tileattn.bench.context_parallel"


def _time_ms(fn, iters: int) -> float:
    fn()  # warm-up (plans, allocator, NCCL communicators)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    # The slowest rank sets the pace of a collective program.
    t = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog=MODULE, description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--mode", default="ring", choices=["ring", "allgather"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-single", action="store_true", help="do not time the one-GPU baseline")
    args = parser.parse_args(argv)

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit(f"{MODULE}: needs a process group; run it under torchrun, one process per GPU, e.g. "
                 f"torchrun --nproc-per-node 2 -m tileattn.bench.context_parallel")
    require_cuda(MODULE)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.device_count() <= local_rank:
        sys.exit(f"{MODULE}: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    from tileattn.distributed import context_parallel_attn, shard
    from tileattn.distributed.context_parallel import _pack, _ring_exchange, _wait

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    b, n, h, d = args.batch, args.seqlen, args.heads, args.headdim
    hkv = args.heads_kv or h
    g = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(b, n, hh, d, device="cuda", dtype=dtype, generator=g) for hh in (h, hkv, hkv)]
    q, k, v = (shard(t, causal=args.causal).contiguous().requires_grad_() for t in full)
    nl = q.shape[1]
    bytes_per_step = 2 * b * nl * hkv * d * q.element_size()

    kv = _pack(k.detach(), v.detach())

    def exchange():
        _, reqs = _ring_exchange([kv], None, rank, world)
        _wait(reqs)

    t_comm = _time_ms(exchange, args.iters)
    # One ring step's compute: the local queries against one visiting shard. With the zig-zag split
    # an off-diagonal step is half the block (n_local x n_local / 2), the diagonal a causal block.
    half = nl // 2 if args.causal else nl
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    t_block = _time_ms(lambda: tileattn.flash_attn_func(qd[:, :half] if args.causal else qd, kd, vd), args.iters)
    t_diag = _time_ms(lambda: tileattn.flash_attn_func(qd, kd, vd, causal=True), args.iters) if args.causal else None

    dout = torch.randn_like(q)
    fwd = _time_ms(lambda: context_parallel_attn(qd, kd, vd, causal=args.causal, mode=args.mode), args.iters)

    def fwd_bwd():
        out = context_parallel_attn(q, k, v, causal=args.causal, mode=args.mode)
        out.backward(dout)

    t_fb = _time_ms(fwd_bwd, args.iters)
    single = single_fb = None
    if not args.skip_single and rank == 0:
        qs, ks, vs = (t.detach().requires_grad_() for t in full)
        torch.cuda.synchronize()
        single = _time_local(lambda: tileattn.flash_attn_func(qs.detach(), ks.detach(), vs.detach(),
                                                              causal=args.causal), args.iters)
        full_dout = torch.randn_like(qs)
        single_fb = _time_local(lambda: tileattn.flash_attn_func(qs, ks, vs, causal=args.causal).backward(full_dout),
                                args.iters)
    dist.barrier()
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"device: {world} x {name}; B={b} N={n} H={h} Hkv={hkv} D={d} {args.dtype} "
              f"causal={args.causal} mode={args.mode}")
        print(f"per ring step: K/V sent {bytes_per_step / 1e6:.1f} MB in {t_comm:.3f} ms "
              f"({bytes_per_step / t_comm / 1e6:.1f} GB/s)")
        print(f"per ring step: block forward {t_block:.3f} ms" + (f", causal diagonal {t_diag:.3f} ms" if t_diag else "")
              + f"; compute / communication = {t_block / t_comm:.2f}")
        flops = tileattn.attention_forward_flops(b, h, n, n, d, d, args.causal)
        print(f"context_parallel_attn: forward {fwd:.2f} ms ({flops / fwd / 1e9:.0f} TFLOP/s over {world} GPUs), "
              f"forward + backward {t_fb:.2f} ms")
        if single is not None:
            print(f"one GPU, whole sequence: forward {single:.2f} ms, forward + backward {single_fb:.2f} ms; "
                  f"throughput ratio {world} GPUs / 1: forward {single / fwd:.2f}x, "
                  f"forward + backward {single_fb / t_fb:.2f}x")
    dist.destroy_process_group()


def _time_local(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


if __name__ == "__main__":
    main()
