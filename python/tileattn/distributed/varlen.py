"""Context-parallel attention over a packed batch of variable-length sequences.

The packed (total_tokens, heads, headdim) batch holds sequence b in rows [cu_seqlens[b],
cu_seqlens[b + 1]). Every sequence is split along its length over the P ranks exactly as a
fixed-length sequence is (``context_parallel._segments``): rank r holds rows [r n_b, (r + 1) n_b) of
sequence b with n_b = L_b / P or, with ``causal``, chunks r and 2P - 1 - r of 2P chunks of L_b / (2P)
rows. Its pieces of all the sequences are packed in sequence order, so every rank's packed part has
the same offsets, ``cu_seqlens / P``. Each rank thus holds the same share of every sequence and, for
causal, the same work, whatever the mix of lengths. Lengths must be divisible by P (2P when causal),
the rule of TransformerEngine and ring-flash-attention: users pad the sequences.

Attention is a few tileattn varlen calls per step. A call covers one run of query rows per sequence
(the same chunk of each) against the key range that run sees; runs of different sequences cannot
share a call when their windows re-express differently (``_block``), so calls are grouped by (query
chunk, key chunk, re-expressed window): one call per query chunk for causal (with or without a left
window) and for full attention; a right window in non-causal attention may need more. A call's key
ranges need not be adjacent: the rows between them enter the call as sequences without queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..errors import InvalidArgumentError, InvalidTypeError
from .. import _ops
from ..functional import _int64
from .context_parallel import (_all_gather, _block, _call_backward, _check_shards, _Config, _config, _group_rank_size,
                               _pack, _reduce_scatter, _ring_backward_walk, _ring_walk, _segments, _unpack)
from .merge import merge_attention

__all__ = ["shard_varlen", "unshard_varlen", "shard_cu_seqlens", "context_parallel_attn_varlen"]


# ---- cu_seqlens and the split ------------------------------------------------------------------

def _read_cu_seqlens(cu_seqlens, like: Tensor, like_name: str, world: int, causal: bool) -> list[int]:
    """cu_seqlens' values on the host, after checking its type, place and every length against the
    split (one copy, and a stream sync on CUDA)."""
    if not isinstance(cu_seqlens, Tensor):
        raise InvalidTypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise InvalidTypeError(f"cu_seqlens.dtype={str(cu_seqlens.dtype).removeprefix('torch.')} must be int32")
    if cu_seqlens.device != like.device:
        raise InvalidArgumentError(f"cu_seqlens is on {cu_seqlens.device} but {like_name} is on {like.device}; "
                                   "cu_seqlens must be on the tensors' device")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise InvalidArgumentError(
            f"cu_seqlens must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise InvalidArgumentError(f"cu_seqlens[0]={cu[0]} must be 0")
    parts = 2 * world if causal else world
    why = f"2 * world_size={parts} (causal: two chunks per rank)" if causal else f"world_size={parts}"
    for b in range(len(cu) - 1):
        length = cu[b + 1] - cu[b]
        if length < 0:
            raise InvalidArgumentError(f"cu_seqlens[{b + 1}]={cu[b + 1]} is less than cu_seqlens[{b}]={cu[b]} "
                                       "(offsets must be non-decreasing)")
        if length % parts != 0:
            raise InvalidArgumentError(
                f"cu_seqlens: sequence {b} has length {length}, which must be divisible by {why}; "
                "pad the sequence")
    return cu


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """The rows [starts[i], starts[i] + lengths[i]) of every i, concatenated (int64)."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths  # where range i starts in the output
    return torch.arange(total) + torch.repeat_interleave(starts - first, lengths)


def _local_rows(cu: list[int], rank: int, world: int, causal: bool) -> Tensor:
    """The packed-batch rows a rank holds, in its packed order (int64, host): ``_segments`` of every
    sequence, sequence after sequence."""
    cu_t = torch.tensor(cu, dtype=torch.int64)
    starts, n = cu_t[:-1], (cu_t[1:] - cu_t[:-1]) // world
    if not causal:
        return _ranges(starts + rank * n, n)
    m = n // 2
    both = torch.stack([starts + rank * m, starts + (2 * world - 1 - rank) * m], 1).reshape(-1)
    return _ranges(both, torch.repeat_interleave(m, 2))


def shard_cu_seqlens(cu_seqlens: Tensor, group=None, causal: bool = False) -> tuple[Tensor, int]:
    """(cu_seqlens_local, max_seqlen_local) of this rank's packed part as ``shard_varlen`` cuts it:
    ``cu_seqlens / P`` (int32, on cu_seqlens' device; the same on every rank) and the longest
    sequence's length / P. For what runs on the local part alone (a varlen call of the rank's own
    tokens, position bookkeeping); ``context_parallel_attn_varlen`` takes the global ones."""
    _, world = _group_rank_size(group)
    cu = _read_cu_seqlens(cu_seqlens, cu_seqlens, "cu_seqlens", world, causal)
    local = torch.tensor([c // world for c in cu], dtype=torch.int32, device=cu_seqlens.device)
    return local, max(cu[b + 1] - cu[b] for b in range(len(cu) - 1)) // world


def shard_varlen(x: Tensor, cu_seqlens: Tensor, group=None, causal: bool = False) -> Tensor:
    """This rank's packed part of the packed batch ``x`` (total_tokens, ...): of every sequence the
    rows ``shard`` would give it (contiguous, or the zig-zag pair of chunks with ``causal``), packed in
    sequence order. ``cu_seqlens`` (int32, on x's device) is the whole batch's; every length must be
    divisible by the world size (twice it with ``causal``). Differentiable (a copy)."""
    rank, world = _group_rank_size(group)
    cu = _read_cu_seqlens(cu_seqlens, x, "x", world, causal)
    if cu[-1] != x.shape[0]:
        raise InvalidArgumentError(
            f"cu_seqlens[-1]={cu[-1]} must equal x.shape[0]={x.shape[0]} (the packed batch's tokens)")
    return x.index_select(0, _local_rows(cu, rank, world, causal).to(x.device))


def unshard_varlen(x_local: Tensor, cu_seqlens: Tensor, group=None, causal: bool = False) -> Tensor:
    """The whole packed batch from every rank's ``shard_varlen`` part (its inverse, on every rank).
    Gathers with ``all_gather``; not differentiable."""
    _, world = _group_rank_size(group)
    cu = _read_cu_seqlens(cu_seqlens, x_local, "x_local", world, causal)
    if cu[-1] != x_local.shape[0] * world:
        raise InvalidArgumentError(f"cu_seqlens[-1]={cu[-1]} must equal x_local.shape[0] * world_size="
                                   f"{x_local.shape[0] * world} (cu_seqlens describes the whole packed batch)")
    pieces = _all_gather(x_local.contiguous().reshape(-1), group)
    rows = torch.cat([_local_rows(cu, s, world, causal) for s in range(world)]).to(x_local.device)
    full = x_local.new_empty((cu[-1], *x_local.shape[1:]))
    full[rows] = torch.cat(pieces).view(-1, *x_local.shape[1:])
    return full


# ---- calls: which query rows see which key rows ------------------------------------------------

@dataclass(frozen=True)
class _Call:
    """One tileattn varlen call: a run of query rows of each of several sequences against the key
    range each run sees. Queries are gathered (``q_rows``) into a packed tensor of their own; keys
    are read in place, the rows between two ranges forming sequences without queries."""
    q_rows: Tensor  # int64: the local query rows, in the call's packed order
    k_rows: Tensor  # int64: the key rows the call's sequences read (not the rows between them)
    cu_q: Tensor  # int32
    cu_k: Tensor  # int32
    max_q: int
    max_k: int
    causal: bool
    left: int
    right: int


def _build_call(key, group: list, device: torch.device) -> _Call:
    q_len, k_len, end = [], [], 0
    for q0, q1, k0, k1 in group:
        if k0 > end:  # keys no query of this call sees: a sequence without queries
            q_len.append(0)
            k_len.append(k0 - end)
        q_len.append(q1 - q0)
        k_len.append(k1 - k0)
        end = k1
    cu_q = torch.tensor([0] + q_len, dtype=torch.int64).cumsum(0)
    cu_k = torch.tensor([0] + k_len, dtype=torch.int64).cumsum(0)
    q0s, q1s, k0s, k1s = (torch.tensor(c, dtype=torch.int64) for c in zip(*group))
    causal, left, right = key[-3:]
    return _Call(_ranges(q0s, q1s - q0s).to(device), _ranges(k0s, k1s - k0s).to(device),
                 cu_q.to(device=device, dtype=torch.int32), cu_k.to(device=device, dtype=torch.int32),
                 max(q_len), max(k_len), causal, left, right)


@dataclass(frozen=True)
class _Plan:
    """Everything a forward and its backward need from cu_seqlens, worked out once on the host."""
    total: int  # tokens in the whole packed batch
    rows: list  # per rank, the packed-batch rows it holds (int64, on the device), for the all-gather
    steps: list  # per step, its calls: one step for the all-gather, P for the ring (step s: rank r - s's keys)


def _plan(cu: list[int], rank: int, world: int, cfg: _Config, device: torch.device) -> _Plan:
    local = [c // world for c in cu]  # every rank's packed part has these offsets
    lengths = [(b, cu[b + 1] - cu[b]) for b in range(len(cu) - 1) if cu[b + 1] > cu[b]]

    def add(runs, key, q_base, k_base, qg, kg, blk):
        window = (blk.causal, blk.left, blk.right)
        if kg + blk.k1 == qg + blk.q1:
            # The block ends on the diagonal, where the user's window is its own: every sequence's
            # run then shares one call, even a short one whose window _block dropped as restricting
            # nothing in its block (the same mask either way).
            right = 0 if cfg.causal else cfg.right
            window = (right == 0, cfg.left, right)
        rows = (q_base + blk.q0, q_base + blk.q1, k_base + blk.k0, k_base + blk.k1)
        runs.setdefault((*key, *window), []).append(rows)

    steps = []
    if cfg.mode == "allgather":  # each local chunk against its whole sequence, in the gathered batch
        runs = {}
        for b, length in lengths:
            for qi, (ql, qg, sq) in enumerate(_segments(rank, world, length // world, cfg.causal)):
                blk = _block(qg, sq, 0, length, cfg.causal, cfg.left, cfg.right)
                if blk is not None:
                    add(runs, (qi,), local[b] + ql, cu[b], qg, 0, blk)
        steps.append(runs)
    else:  # each local chunk against each chunk of the visiting rank's part, in its packed rows
        for step in range(world):
            runs, src = {}, (rank - step) % world
            for b, length in lengths:
                n = length // world
                for qi, (ql, qg, sq) in enumerate(_segments(rank, world, n, cfg.causal)):
                    for ki, (kl, kg, sk) in enumerate(_segments(src, world, n, cfg.causal)):
                        blk = _block(qg, sq, kg, sk, cfg.causal, cfg.left, cfg.right)
                        if blk is not None:
                            add(runs, (qi, ki), local[b] + ql, local[b] + kl, qg, kg, blk)
            steps.append(runs)
    rows = [_local_rows(cu, s, world, cfg.causal).to(device) for s in range(world)] if cfg.mode == "allgather" else []
    return _Plan(cu[-1], rows, [[_build_call(key, group, device) for key, group in runs.items()] for runs in steps])


# ---- one call's forward and backward -----------------------------------------------------------

def _call_forward(q: Tensor, k: Tensor, v: Tensor, c: _Call, cfg: _Config) -> tuple[Tensor, Tensor]:
    return _ops._forward_impl(q.index_select(0, c.q_rows), k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, cfg.scale, c.causal,
                              c.left, c.right, cfg.softcap, False)


def _call_grads(dout, q, k, v, out, lse, c: _Call, cfg: _Config, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Adds the call's gradients into the fp32 dq (local rows) and dk, dv (rows of k and v)."""
    r = c.q_rows
    dq_c, dk_c, dv_c = _call_backward(dout.index_select(0, r), q.index_select(0, r), k, v, out.index_select(0, r),
                                      lse.index_select(1, r), c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, c.left,
                                      c.right, cfg)
    dq.index_add_(0, r, dq_c.float())
    # Only the call's key ranges: the rows between them are not the call's to write.
    dk.index_add_(0, c.k_rows, dk_c.index_select(0, c.k_rows).float())
    dv.index_add_(0, c.k_rows, dv_c.index_select(0, c.k_rows).float())


# ---- ring and all-gather -----------------------------------------------------------------------

def _ring_forward(q, k, v, plan: _Plan, cfg: _Config) -> tuple[Tensor, Tensor]:
    out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)

    def step_fn(step, k_cur, v_cur):
        for c in plan.steps[step]:
            o_c, l_c = _call_forward(q, k_cur, v_cur, c, cfg)
            acc_o, acc_l = out.index_select(0, c.q_rows), lse.index_select(1, c.q_rows)
            merge_attention(acc_o, acc_l, o_c, l_c)
            out[c.q_rows], lse[:, c.q_rows] = acc_o, acc_l

    _ring_walk(k, v, cfg, step_fn)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, plan: _Plan, cfg: _Config) -> tuple[Tensor, Tensor, Tensor]:
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def step_fn(step, k_cur, v_cur, dk_cur, dv_cur):
        for c in plan.steps[step]:
            _call_grads(dout, q, k_cur, v_cur, out, lse, c, cfg, dq, dk_cur, dv_cur)

    dk, dv = _ring_backward_walk(k, v, cfg, step_fn)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather_full(k: Tensor, v: Tensor, plan: _Plan, cfg: _Config) -> tuple[Tensor, Tensor]:
    parts = [_unpack(piece, k, v) for piece in _all_gather(_pack(k, v), cfg.group)]
    rows = torch.cat(plan.rows)
    k_full = k.new_empty((plan.total, *k.shape[1:]))
    v_full = v.new_empty((plan.total, *v.shape[1:]))
    k_full[rows] = torch.cat([k_s for k_s, _ in parts])
    v_full[rows] = torch.cat([v_s for _, v_s in parts])
    return k_full, v_full


def _allgather_forward(q, k, v, plan: _Plan, cfg: _Config) -> tuple[Tensor, Tensor]:
    k_full, v_full = _gather_full(k, v, plan, cfg)
    out = torch.zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    for c in plan.steps[0]:  # each local row is in one call at most
        out[c.q_rows], lse[:, c.q_rows] = _call_forward(q, k_full, v_full, c, cfg)
    return out, lse


def _allgather_backward(dout, q, k, v, out, lse, plan: _Plan, cfg: _Config) -> tuple[Tensor, Tensor, Tensor]:
    k_full, v_full = _gather_full(k, v, plan, cfg)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.zeros(q.shape, **f32)
    dk_full, dv_full = torch.zeros(k_full.shape, **f32), torch.zeros(v_full.shape, **f32)
    for c in plan.steps[0]:
        _call_grads(dout, q, k_full, v_full, out, lse, c, cfg, dq, dk_full, dv_full)
    # Each rank's rows of the summed dK/dV, in rank order, then one reduce-scatter (fp32).
    by_rank = []
    for rows in plan.rows:
        by_rank += [dk_full.index_select(0, rows), dv_full.index_select(0, rows)]
    mine = _reduce_scatter(_pack(*by_rank), cfg.group)
    dk, dv = _unpack(mine, torch.empty(k.shape, **f32), torch.empty(v.shape, **f32))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the autograd function and the public call -------------------------------------------------

class _VarlenContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, cfg: _Config):
        fwd = _ring_forward if cfg.mode == "ring" else _allgather_forward
        out, lse = fwd(q, k, v, plan, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.cfg = plan, cfg  # the backward reads no cu_seqlens again
        return out

    @staticmethod
    @once_differentiable  # the block backwards' gradients have no derivative of their own
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bwd = _ring_backward if ctx.cfg.mode == "ring" else _allgather_backward
        dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, ctx.plan, ctx.cfg)
        return dq, dk, dv, None, None


def context_parallel_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, group=None,
                                 causal: bool = False, mode: str = "allgather", softmax_scale: Optional[float] = None,
                                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> Tensor:
    """Attention of a packed batch of sequences split over the ranks of ``group``; returns this
    rank's packed output part.

    ``q``, ``k``, ``v`` are this rank's packed parts, (total_tokens / P, heads, headdim), as
    ``shard_varlen`` cuts them with the same ``causal``. ``cu_seqlens`` (int32, on q's device, batch + 1
    entries) and ``max_seqlen`` describe the WHOLE packed batch, as ``flash_attn_varlen_func`` would
    take them on one device (queries and keys alike), and must be the same on every rank; every
    sequence's length must be divisible by the world size (twice it with ``causal``). The options
    mean what they mean in ``flash_attn_varlen_func`` for each whole sequence; GQA/MQA take fewer
    K/V heads. ``mode="allgather"`` gathers K and V whole first (one call per local chunk of the
    sequences); ``mode="ring"`` passes the K/V parts round the ring as ``context_parallel_attn``
    does. Differentiable in q, k and v. cu_seqlens is read on the host once per forward (one copy
    and stream sync on CUDA); the backward reuses what was read.
    """
    _check_shards(q, k, v, mode, 3, "(total_tokens_local, heads, headdim)", 0, "parts of one packed batch")
    rank, world = _group_rank_size(group)
    cu = _read_cu_seqlens(cu_seqlens, q, "q", world, bool(causal))
    q, cfg = _config(q, k, v, cu_seqlens, group, causal, mode, softmax_scale, window_size, softcap)
    if cu[-1] != q.shape[0] * world:
        raise InvalidArgumentError(f"cu_seqlens[-1]={cu[-1]} must equal q.shape[0] * world_size={q.shape[0] * world} "
                                   "(cu_seqlens describes the whole packed batch, q this rank's part)")
    longest = max(cu[b + 1] - cu[b] for b in range(len(cu) - 1))
    max_seqlen = _int64(max_seqlen, "max_seqlen")
    if max_seqlen < longest:
        raise InvalidArgumentError(f"max_seqlen={max_seqlen!r} must be >= the longest sequence in cu_seqlens "
                                   f"({longest}; the whole batch's, not this rank's part)")
    return _VarlenContextParallelAttention.apply(q, k, v, _plan(cu, rank, world, cfg, q.device), cfg)
