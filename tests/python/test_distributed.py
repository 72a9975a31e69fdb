"""merge_attention, and context-parallel attention over torch.distributed.

The merge is checked against a float64 formula. The distributed layer runs in 2 and 4 CPU
processes over gloo (torch.multiprocessing, a free localhost port): each rank builds the same full
inputs from a shared seed, runs its shard through context_parallel_attn, and compares its output
and gradient shards with the single-process tileattn result and with a float64 reference under
the 2x rule (naive.py). NCCL variants are marked gpu and need two GPUs. The packed (varlen) form is checked the same way
against the single-process flash_attn_varlen_func on the whole packed batch.
"""

from __future__ import annotations

import math
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import naive
import tileattn
from tileattn.distributed import (context_parallel_attn, context_parallel_attn_varlen, shard, shard_cu_seqlens,
                                  shard_varlen, unshard, unshard_varlen)

FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


# ---- merge_attention ---------------------------------------------------------------------------

def _merge_reference(out, lse, out_b, lse_b):
    l64, lb64 = lse.double(), lse_b.double()
    both = torch.logaddexp(l64, lb64)
    safe = torch.where(torch.isinf(both), 0.0, both)
    wa = torch.where(torch.isinf(l64), 0.0, torch.exp(l64 - safe))
    wb = torch.where(torch.isinf(lb64), 0.0, torch.exp(lb64 - safe))
    # lse (batch, heads, seqlen) -> weights on out's (batch, seqlen, heads, 1)
    wa, wb = wa.transpose(-1, -2)[..., None], wb.transpose(-1, -2)[..., None]
    a = torch.where(wa > 0, out.double(), 0.0)
    b = torch.where(wb > 0, out_b.double(), 0.0)
    return wa * a + wb * b, both


def test_merge_of_flash_attn_results_takes_their_empty_rows():
    # flash_attn_func marks a row without keys with lse = +inf, as flash-attn does. Causal attention
    # over keys [0, 8) and [8, 12) merged, in either order, is causal attention over all 12, the rows
    # that see no key of the second part included.
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    whole, whole_lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    for first_part_first in (True, False):
        # Key j <= query i in both parts: for the first, the window's right side covers the offset
        # of 8 keys against 12 queries (below the 8 keys, where flash-attn would read it as
        # unbounded); the second is bottom-right causal.
        first = tileattn.flash_attn_func(q, k[:, :8], v[:, :8], window_size=(-1, 4), return_attn_probs=True)
        second = tileattn.flash_attn_func(q, k[:, 8:], v[:, 8:], causal=True, return_attn_probs=True)
        assert torch.isposinf(second[1][:, :, :8]).all()
        (out, lse, _), (out_b, lse_b, _) = (first, second) if first_part_first else (second, first)
        tileattn.merge_attention(out, lse, out_b, lse_b)
        assert naive.max_error(out, whole) < 1e-5 and naive.max_error(lse, whole_lse) < 1e-5


@pytest.mark.parametrize("out_dtype,b_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16)])
def test_merge_matches_float64_with_empty_rows(out_dtype, b_dtype):
    B, N, H, D = 2, 33, 3, 24
    # Strided views: out is a slice of a wider buffer, lse a slice of longer rows.
    out_buf = torch.randn(B, N + 4, H, D + 8).to(out_dtype)
    out = out_buf[:, 2:N + 2, :, :D]
    lse_buf = torch.randn(B, H, N + 5) * 4
    lse = lse_buf[:, :, 3:N + 3]
    out_b = torch.randn(B, N, H, D).to(b_dtype)
    lse_b = torch.randn(B, H, N) * 4
    lse[0, 0, :5] = -math.inf
    lse_b[0, 0, 3:8] = -math.inf  # rows 3, 4: both sides empty
    lse_b[1, 2, 7] = lse[1, 2, 7] - 50  # one side far below fp32's resolution
    out[0, :5, 0] = math.nan  # an empty side's O must not leak
    out_b[0, 3:8, 0] = math.nan
    want_o, want_l = _merge_reference(out, lse, out_b, lse_b)
    # Same-precision naive: the plain formula in fp32 (finite rows only), rounded to out's dtype.
    l32 = torch.logaddexp(lse, lse_b)
    naive_o = (torch.exp(lse - l32).transpose(-1, -2)[..., None] * out.float()
               + torch.exp(lse_b - l32).transpose(-1, -2)[..., None] * out_b.float()).to(out_dtype)
    finite = ~torch.isinf(want_l).transpose(-1, -2)[..., None].expand_as(want_o)
    finite &= ~(torch.isinf(lse) | torch.isinf(lse_b)).transpose(-1, -2)[..., None]
    out_before, lse_b_before, out_b_before = out.clone(), lse_b.clone(), out_b.clone()
    out_buf_before, lse_buf_before = out_buf.clone(), lse_buf.clone()
    tileattn.merge_attention(out, lse, out_b, lse_b)

    torch.testing.assert_close(out_b, out_b_before, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse_b, lse_b_before, rtol=0, atol=0)
    assert not torch.isnan(out).any()
    naive.assert_2x_rule(out[finite], naive_o[finite], want_o[finite], FLOOR[out_dtype], "out")
    naive.assert_2x_rule(lse, l32, want_l, 1e-6, "lse")
    # Exact rows: both empty -> 0 / -inf; one side empty -> the other side unchanged.
    assert torch.equal(out[0, 3:5, 0], torch.zeros_like(out[0, 3:5, 0]))
    assert torch.isinf(lse[0, 0, 3:5]).all() and (lse[0, 0, 3:5] < 0).all()
    assert torch.equal(out[0, :3, 0].float(), out_b_before[0, :3, 0].to(out_dtype).float())
    assert torch.equal(lse[0, 0, :3], lse_b_before[0, 0, :3])
    assert torch.equal(out[0, 5:8, 0], out_before[0, 5:8, 0])
    # The buffers around the views are untouched.
    inside = torch.zeros(out_buf.shape, dtype=torch.bool)
    inside[:, 2:N + 2, :, :D] = True
    assert torch.equal(out_buf[~inside], out_buf_before[~inside])
    assert torch.equal(lse_buf[:, :, :3], lse_buf_before[:, :, :3])


def test_merge_varlen_layout():
    T, H, D = 50, 4, 16
    out, out_b = torch.randn(T, H, D), torch.randn(T, H, D)
    lse, lse_b = torch.randn(H, T), torch.randn(H, T)
    want_o, want_l = _merge_reference(out[None], lse[None], out_b[None], lse_b[None])
    tileattn.merge_attention(out, lse, out_b, lse_b)
    assert naive.max_error(out, want_o[0]) < 1e-6
    assert naive.max_error(lse, want_l[0]) < 1e-6


def test_merge_reads_expanded_inputs_as_their_copies():
    B, N, H, D = 3, 40, 4, 16
    out, lse = torch.randn(B, N, H, D), torch.randn(B, H, N)
    out_b = torch.randn(1, N, 1, D).expand(B, N, H, D)  # one row per position, for every batch and head
    lse_b = torch.randn(1, H, N).expand(B, H, N)
    want_o, want_l = _merge_reference(out, lse, out_b, lse_b)
    copy_o, copy_l = out.clone(), lse.clone()
    tileattn.merge_attention(copy_o, copy_l, out_b.contiguous(), lse_b.contiguous())
    tileattn.merge_attention(out, lse, out_b, lse_b)
    assert torch.equal(out, copy_o) and torch.equal(lse, copy_l)
    assert naive.max_error(out, want_o) < 1e-6 and naive.max_error(lse, want_l) < 1e-6
    # The written side may not be expanded: two threads would write one element.
    with pytest.raises(ValueError, match=r"out\.\w+_stride=0 must be positive"):
        tileattn.merge_attention(out_b, lse.clone(), out.clone(), lse.clone())


def test_merge_errors_name_the_argument():
    out, lse = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match=r"out_b.shape=\(1, 3, 2, 8\) must be \(1, 4, 2, 8\)"):
        tileattn.merge_attention(out, lse, torch.zeros(1, 3, 2, 8), lse.clone())
    with pytest.raises(TypeError, match="lse_b.dtype=float64 must be float32"):
        tileattn.merge_attention(out, lse, out.clone(), lse.double())
    with pytest.raises(TypeError, match="out_b.dtype=float16 must equal out.dtype=bfloat16"):
        tileattn.merge_attention(out.bfloat16(), lse, out.half(), lse.clone())
    with pytest.raises(TypeError, match="out_b.dtype=float16 must equal out.dtype=bfloat16"):  # empty, too
        tileattn.merge_attention(out[:0].bfloat16(), lse[:0], out[:0].half(), lse[:0].clone())
    with pytest.raises(ValueError, match="out_b overlaps out"):
        tileattn.merge_attention(out, lse, out, lse.clone())
    memory = torch.zeros(72)  # each written tensor against the other side's input
    with pytest.raises(ValueError, match="out_b overlaps lse"):
        tileattn.merge_attention(out, memory[60:68].view(1, 2, 4), memory[:64].view(1, 4, 2, 8), lse.clone())
    with pytest.raises(ValueError, match="lse_b overlaps out"):
        tileattn.merge_attention(memory[:64].view(1, 4, 2, 8), lse, out.clone(), memory[60:68].view(1, 2, 4))
    with pytest.raises(RuntimeError, match="out requires grad: merge_attention writes in place"):
        tileattn.merge_attention(out.clone().requires_grad_(), lse, out.clone(), lse.clone())
    with pytest.raises(ValueError, match=r"lse.shape=\(1, 4, 2\) must be \(1, 2, 4\)"):
        tileattn.merge_attention(out, lse.transpose(1, 2), out.clone(), lse.clone())


def test_merge_marks_its_outputs_as_written():
    # A tensor autograd saved, merged into through a detached view: the backward that needed the
    # old values stops with autograd's in-place error instead of using the new ones.
    x = torch.randn(1, 4, 2, 8, requires_grad=True)
    out = x * 2
    loss = (out * out).sum()
    tileattn.merge_attention(out.detach(), torch.zeros(1, 2, 4), torch.randn(1, 4, 2, 8), torch.zeros(1, 2, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---- the block decomposition: each call's mask is the global mask restricted to it ------------

def test_block_masks_match_the_global_mask():
    from tileattn.distributed.context_parallel import _block

    def mask(nq, nk, left, right, shift=None):
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        shift = nk - nq if shift is None else shift
        m = torch.ones(nq, nk, dtype=torch.bool)
        if left >= 0:
            m &= j >= i + shift - left
        if right >= 0:
            m &= j <= i + shift + right
        return m

    for qg in range(0, 30, 3):
        for kg in range(0, 30, 3):
            for causal in (False, True):
                for left, right in [(-1, -1), (5, -1), (3, 9), (0, 0), (11, 2), (-1, 3), (4, 4), (20, 20)]:
                    for sq, sk in [(8, 8), (6, 10), (10, 6), (1, 1), (1, 5)]:
                        # Global positions: query x sees key y when x - left <= y <= x + right.
                        want = mask(sq, sk, left, 0 if causal else right, shift=qg - kg)
                        got = torch.zeros(sq, sk, dtype=torch.bool)
                        b = _block(qg, sq, kg, sk, causal, left, right)
                        if b is not None:
                            assert b.left >= -1 and b.right >= -1
                            m = mask(b.q1 - b.q0, b.k1 - b.k0, b.left, 0 if b.causal else b.right)
                            assert m.any(dim=1).all(), f"a row of {b} sees no key"
                            got[b.q0:b.q1, b.k0:b.k1] = m
                            if kg + b.k1 == qg + b.q1:  # on the diagonal the user's window is the block's too
                                right_d = 0 if causal else right
                                assert torch.equal(mask(b.q1 - b.q0, b.k1 - b.k0, left, right_d), m), (b, left, right)
                        assert torch.equal(got, want), (qg, sq, kg, sk, causal, left, right, b)


def test_varlen_one_call_per_local_chunk():
    # However the lengths mix (here sequences of one chunk row, whose blocks _block reduces to
    # unmasked 1 x 1 ones), the all-gather form makes one call per local chunk: two when causal.
    from tileattn.distributed.context_parallel import _Config
    from tileattn.distributed.varlen import _plan

    lengths = [8, 36, 4, 0, 20, 4]
    cu = [sum(lengths[:b]) for b in range(len(lengths) + 1)]
    for world in (2, 4):
        for rank in range(world):
            for causal, window, calls in ((True, (-1, -1), 2), (True, (3, -1), 2), (False, (-1, -1), 1)):
                if causal and any(n % (2 * world) for n in lengths):
                    continue
                cfg = _Config(None, causal, "allgather", 0.25, *window, 0.0)
                plan = _plan(cu, rank, world, cfg, torch.device("cpu"))
                assert [len(step) for step in plan.steps] == [calls], (world, rank, causal, window)


# ---- the multi-process harness -----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, seed: int, cases: list, backend: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        for i, case in enumerate(cases):
            try:
                (_check_varlen_case if "lengths" in case else _check_case)(seed + i, **case)
            except Exception as e:
                raise AssertionError(f"rank {rank}/{world}, case {case}, seed {seed + i}:\n"
                                     f"{traceback.format_exc()}") from e
    finally:
        dist.destroy_process_group()


def _run(world: int, cases: list, seed: int, backend: str = "gloo") -> None:
    mp.spawn(_worker, args=(world, _free_port(), seed, cases, backend), nprocs=world, join=True)


def _check_case(seed: int, mode="ring", causal=False, dtype=torch.float32, B=2, N=32, H=4, Hkv=2, D=16,
                window=(-1, -1), softcap=0.0, device="cpu") -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, N, h, D, generator=g) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, N, H, D, generator=g)
    opts = dict(causal=causal, window=window, softcap=softcap)

    def grads(fn, *ts, dout=dout):
        ts = [t.detach().clone().requires_grad_() for t in ts]
        out = fn(*ts)
        out.backward(dout.to(out.dtype).to(out.device))
        return [out.detach().cpu()] + [t.grad.cpu() for t in ts]

    inputs = [t.to(dtype) for t in (q, k, v)]
    oracle = grads(lambda a, b, c: naive.attention(a, b, c, **opts)[0], *(t.double() for t in inputs))
    same = grads(lambda a, b, c: naive.attention(a, b, c, **opts)[0], *inputs)
    single = grads(lambda a, b, c: tileattn.flash_attn_func(a, b, c, causal=causal, window_size=window,
                                                            softcap=softcap), *(t.to(device) for t in inputs))
    local = [shard(t, causal=causal).to(device) for t in inputs]
    mine = grads(lambda a, b, c: context_parallel_attn(a, b, c, causal=causal, mode=mode, window_size=window,
                                                       softcap=softcap), *local,
                 dout=shard(dout, causal=causal))
    # The local gradient shards of dK/dV hold the whole gradient of this rank's K/V rows.
    for name, ours, one, ref, nv in zip(("out", "dq", "dk", "dv"), mine, single, oracle, same):
        floor = FLOOR[dtype] * (1 if name == "out" else 2)
        ref_s, nv_s, one_s = (shard(t, causal=causal) for t in (ref, nv, one))
        naive.assert_2x_rule(ours, nv_s, ref_s, floor, f"{name} (context parallel)")
        bound = 2 * naive.max_error(nv_s, ref_s) + floor
        assert naive.max_error(ours, one_s) <= bound + naive.max_error(one_s, ref_s), \
            f"{name}: context parallel differs from the single-process result"
    assert rank < world


# 2 processes: every mode x causal, GQA throughout, a bf16 pair, windows and softcap.
CASES_2 = [
    dict(mode="ring", causal=False),
    dict(mode="ring", causal=True),
    dict(mode="allgather", causal=False),
    dict(mode="allgather", causal=True),
    dict(mode="ring", causal=True, dtype=torch.bfloat16),
    dict(mode="allgather", causal=True, dtype=torch.float16),
    dict(mode="ring", causal=True, window=(5, -1), softcap=3.0),
    dict(mode="ring", causal=False, window=(3, 9), Hkv=1),
    dict(mode="allgather", causal=False, window=(11, 2), softcap=2.0),
    dict(mode="ring", causal=False, D=8, N=16),  # head dim <= 8: the CPU backward needs partial_keys there
    dict(mode="allgather", causal=True, D=4, N=16, dtype=torch.bfloat16),
]

# 4 processes: the zig-zag with every kind of step (skipped, full, diagonal).
CASES_4 = [
    dict(mode="ring", causal=True, N=48),
    dict(mode="allgather", causal=True, N=48, dtype=torch.bfloat16),
    dict(mode="ring", causal=False, N=24, window=(4, 4)),
]


def _check_varlen_case(seed: int, lengths: list, mode="allgather", causal=False, dtype=torch.float32, H=4, Hkv=2,
                       D=16, window=(-1, -1), softcap=0.0, device="cpu") -> None:
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, h, D, generator=g) for h in (H, Hkv, Hkv))
    dout = torch.randn(total, H, D, generator=g)
    opts = dict(causal=causal, window=window, softcap=softcap)

    def grads(fn, *ts, dout=dout):
        ts = [t.detach().clone().requires_grad_() for t in ts]
        out = fn(*ts)
        out.backward(dout.to(out.dtype).to(out.device))
        return [out.detach().cpu()] + [t.grad.cpu() for t in ts]

    inputs = [t.to(dtype) for t in (q, k, v)]
    oracle = grads(lambda a, b, c: naive.varlen_attention(a, b, c, cu, cu, **opts)[0], *(t.double() for t in inputs))
    same = grads(lambda a, b, c: naive.varlen_attention(a, b, c, cu, cu, **opts)[0], *inputs)
    cu_d, longest = cu.to(device), max(lengths)
    single = grads(lambda a, b, c: tileattn.flash_attn_varlen_func(a, b, c, cu_d, cu_d, longest, longest, causal=causal,
                                                                   window_size=window, softcap=softcap),
                   *(t.to(device) for t in inputs))
    local = [shard_varlen(t.to(device), cu_d, causal=causal) for t in inputs]
    assert local[0].shape[0] == total // world
    mine = grads(lambda a, b, c: context_parallel_attn_varlen(a, b, c, cu_d, longest, causal=causal, mode=mode,
                                                              window_size=window, softcap=softcap), *local,
                 dout=shard_varlen(dout.to(device), cu_d, causal=causal))
    for name, ours, one, ref, nv in zip(("out", "dq", "dk", "dv"), mine, single, oracle, same):
        floor = FLOOR[dtype] * (1 if name == "out" else 2)
        ref_s, nv_s, one_s = (shard_varlen(t, cu, causal=causal) for t in (ref, nv, one))
        naive.assert_2x_rule(ours, nv_s, ref_s, floor, f"{name} (context parallel, varlen)")
        bound = 2 * naive.max_error(nv_s, ref_s) + floor
        assert naive.max_error(ours, one_s) <= bound + naive.max_error(one_s, ref_s), \
            f"{name}: varlen context parallel differs from the single-process result"


# Packed batches: lengths that differ a lot, one sequence, an empty one; both modes, GQA/MQA,
# windows (the non-causal right window splits a chunk's sequences over several calls) and softcap.
VARLEN_CASES_2 = [
    dict(lengths=[8, 36, 4, 20], causal=True),
    dict(lengths=[8, 36, 4, 20], causal=True, mode="ring", dtype=torch.bfloat16),
    dict(lengths=[6, 30, 2], causal=False),
    dict(lengths=[10, 2, 26], causal=False, mode="ring", window=(3, 9), Hkv=1),
    dict(lengths=[32], causal=True, dtype=torch.float16),
    dict(lengths=[12, 0, 40, 4], causal=True, window=(5, -1), softcap=3.0),
    dict(lengths=[22, 4, 40], causal=False, window=(11, 2), softcap=2.0),
    dict(lengths=[4, 16], causal=False, mode="ring", D=8),
]

VARLEN_CASES_4 = [
    dict(lengths=[8, 64, 16], causal=True, dtype=torch.bfloat16),
    dict(lengths=[24, 8, 40], causal=True, mode="ring"),
    dict(lengths=[12, 28, 4], causal=False, mode="ring", window=(4, 4)),
]


def test_context_parallel_two_processes(fresh_seed):
    _run(2, CASES_2 + VARLEN_CASES_2, fresh_seed)


def test_context_parallel_four_processes(fresh_seed):
    _run(4, CASES_4 + VARLEN_CASES_4, fresh_seed)


def _shard_roundtrip_worker(rank, world, port, seed, cases, backend):
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.randn(3, 24, 2, 5, generator=torch.Generator().manual_seed(seed))
        for causal in (False, True):
            s = shard(x, causal=causal)
            assert s.shape == (3, 24 // world, 2, 5)
            assert torch.equal(unshard(s, causal=causal), x)
            # another dim (SDPA's (batch, heads, seqlen, headdim) splits dim 2), negative dims too
            xt = x.transpose(1, 2)
            assert torch.equal(unshard(shard(xt, dim=2, causal=causal), dim=-2, causal=causal), xt)
        m = 24 // (2 * world)
        z = shard(x, causal=True)
        assert torch.equal(z[:, :m], x[:, rank * m:(rank + 1) * m])
        assert torch.equal(z[:, m:], x[:, (2 * world - 1 - rank) * m:(2 * world - rank) * m])
        with _raises(ValueError, f"x.shape[1]=20 must be divisible by 2 * world_size={2 * world}"):
            shard(x[:, :20], causal=True)
        q = shard(x, causal=True)
        with _raises(ValueError, "mode='tree' must be one of"):
            context_parallel_attn(q, q, q, mode="tree")
        with _raises(ValueError, "k.shape[1]=2 and v.shape[1]"):
            context_parallel_attn(q, q[:, :2], q, causal=True)
        # Options read as flash_attn_func reads them (a negative window side unbounded, softcap <= 0
        # off, any finite scale), in both modes.
        full = torch.randn(1, 24, 2, 8, generator=torch.Generator().manual_seed(seed + 1))
        local = shard(full, causal=True)
        for mode in ("ring", "allgather"):
            for options in (dict(window_size=(-2, 3)), dict(softcap=-1.0), dict(softmax_scale=-0.4)):
                got = context_parallel_attn(local, local, local, causal=True, mode=mode, **options)
                want = shard(tileattn.flash_attn_func(full, full, full, causal=True, **options), causal=True)
                assert naive.max_error(got, want) < 1e-5, (mode, options)
        # A refused ring call is refused before anything is sent, so the group stays usable.
        with _raises(ValueError, "softmax_scale=nan must be finite"):
            context_parallel_attn(q, q, q, causal=True, softmax_scale=math.nan)
        with _raises(TypeError, "k.dtype=float64 must equal q.dtype=float32"):
            context_parallel_attn(q, q.double(), q, causal=True)
        with _raises(ValueError, "heads_kv=3 must divide heads_q=2"):
            context_parallel_attn(q, torch.cat([q, q[:, :, :1]], 2), torch.cat([q, q[:, :, :1]], 2))
        assert context_parallel_attn(q, q, q, causal=True).shape == q.shape
        # Only the group's members may call.
        members = dist.new_group(list(range(world - 1)))
        if rank == world - 1:
            with _raises(ValueError, "this process is not a member of group"):
                context_parallel_attn(q, q, q, group=members)
        _check_varlen_shard_and_errors(rank, world, seed)
    finally:
        dist.destroy_process_group()


def _check_varlen_shard_and_errors(rank: int, world: int, seed: int) -> None:
    lengths = [16, 8, 48, 0, 24]
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    x = torch.randn(96, 3, 5, generator=torch.Generator().manual_seed(seed))
    for causal in (False, True):
        s = shard_varlen(x, cu, causal=causal)
        assert s.shape == (96 // world, 3, 5)
        assert torch.equal(unshard_varlen(s, cu, causal=causal), x)
        cu_local, max_local = shard_cu_seqlens(cu, causal=causal)
        assert cu_local.dtype == torch.int32 and torch.equal(cu_local, cu // world) and max_local == 48 // world
        # Each sequence's local part is what shard gives that sequence alone.
        for b, length in enumerate(lengths):
            mine = s[cu_local[b]:cu_local[b + 1]]
            assert torch.equal(mine, shard(x[None, cu[b]:cu[b + 1]], causal=causal)[0]), (causal, b)
    # The zig-zag pair of the longest sequence (rows 24..72), spelled out.
    m = 48 // (2 * world)
    z = shard_varlen(x, cu, causal=True)[(16 + 8) // world:(16 + 8 + 48) // world]
    assert torch.equal(z[:m], x[24 + rank * m:24 + (rank + 1) * m])
    assert torch.equal(z[m:], x[24 + (2 * world - 1 - rank) * m:24 + (2 * world - rank) * m])

    bad = torch.tensor([0, 16, 26, 96], dtype=torch.int32)
    with _raises(ValueError, f"cu_seqlens: sequence 1 has length 10, which must be divisible by "
                             f"2 * world_size={2 * world} (causal: two chunks per rank); pad the sequence"):
        shard_varlen(x, bad, causal=True)
    odd = torch.tensor([0, 16, 17 + world, 96], dtype=torch.int32)
    with _raises(ValueError, f"cu_seqlens: sequence 1 has length {world + 1}, which must be divisible by "
                             f"world_size={world}"):
        shard_varlen(x, odd)
    with _raises(TypeError, "cu_seqlens.dtype=int64 must be int32"):
        shard_varlen(x, cu.long())
    with _raises(ValueError, "cu_seqlens is on meta but x is on cpu; cu_seqlens must be on the tensors' device"):
        shard_varlen(x, cu.to("meta"))
    with _raises(ValueError, "cu_seqlens[-1]=96 must equal x.shape[0]=90"):
        shard_varlen(x[:90], cu)
    with _raises(ValueError, "cu_seqlens[2]=16 is less than cu_seqlens[1]=24"):
        shard_varlen(x, torch.tensor([0, 24, 16, 96], dtype=torch.int32))

    q = shard_varlen(x, cu, causal=True)
    with _raises(ValueError, "cu_seqlens: sequence 1 has length 10, which must be divisible by"):
        context_parallel_attn_varlen(q, q, q, bad, 70, causal=True)
    with _raises(TypeError, "cu_seqlens.dtype=int64 must be int32"):
        context_parallel_attn_varlen(q, q, q, cu.long(), 48)
    with _raises(ValueError, "cu_seqlens is on meta but q is on cpu"):
        context_parallel_attn_varlen(q, q, q, cu.to("meta"), 48)
    with _raises(ValueError, f"cu_seqlens[-1]=96 must equal q.shape[0] * world_size={(96 // world - 1) * world}"):
        context_parallel_attn_varlen(q[1:], q[1:], q[1:], cu, 48)
    with _raises(ValueError, "max_seqlen=24 must be >= the longest sequence in cu_seqlens (48"):
        context_parallel_attn_varlen(q, q, q, cu, 24)
    with _raises(ValueError, "q must have 3 dimensions (total_tokens_local, heads, headdim)"):
        context_parallel_attn_varlen(q[None], q, q, cu, 48)
    with _raises(ValueError, "k.shape[0]=2 and v.shape[0]"):
        context_parallel_attn_varlen(q, q[:2], q, cu, 48)
    with _raises(ValueError, "mode='tree' must be one of"):
        context_parallel_attn_varlen(q, q, q, cu, 48, mode="tree")


class _raises:
    def __init__(self, kind, text):
        self.kind, self.text = kind, text

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        assert kind is not None, f"expected {self.kind.__name__}: {self.text}"
        assert issubclass(kind, self.kind) and self.text in str(value), f"got {kind.__name__}: {value}"
        return True


def test_shard_unshard_round_trip_and_errors(fresh_seed):
    mp.spawn(_shard_roundtrip_worker, args=(4, _free_port(), fresh_seed, None, "gloo"), nprocs=4, join=True)


def test_needs_a_process_group():
    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        shard(x)


# ---- NCCL on several GPUs ----------------------------------------------------------------------

GPU_CASES = [
    dict(mode="ring", causal=True, dtype=torch.bfloat16, N=512, H=8, Hkv=2, D=64, device="cuda"),
    dict(mode="allgather", causal=True, dtype=torch.bfloat16, N=512, H=8, Hkv=2, D=64, device="cuda"),
    dict(mode="ring", causal=False, dtype=torch.float16, N=256, H=4, Hkv=4, D=128, device="cuda"),
    dict(mode="ring", causal=True, dtype=torch.bfloat16, N=512, window=(100, -1), softcap=5.0, device="cuda"),
    dict(lengths=[64, 512, 8, 200], causal=True, dtype=torch.bfloat16, H=8, Hkv=2, D=64, device="cuda"),
    dict(lengths=[64, 512, 8, 200], mode="ring", causal=True, dtype=torch.bfloat16, D=128, device="cuda"),
    dict(lengths=[300, 4, 96], causal=False, dtype=torch.float16, window=(50, 20), device="cuda"),
    # float32 on CUDA: the fp32 backward over a block needs partial_keys (no row-statistics pass).
    dict(mode="ring", causal=True, dtype=torch.float32, N=512, H=4, Hkv=2, D=64, device="cuda"),
    dict(lengths=[64, 256, 8, 120], causal=True, dtype=torch.float32, D=64, device="cuda"),
]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")
def test_context_parallel_nccl(fresh_seed):
    _run(2, [dict(c, device="cuda") for c in GPU_CASES], fresh_seed, backend="nccl")
