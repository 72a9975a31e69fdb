"""Context-parallel attention over a torch.distributed process group.

A sequence of N tokens is split along its length over the P ranks of a group; each rank holds
n = N / P rows of Q, K and V and computes its n rows of the output. Without ``causal`` rank r holds
the contiguous rows [r n, (r + 1) n). With ``causal`` the sequence is cut into 2P chunks of
m = N / (2P) rows and rank r holds chunks r and 2P - 1 - r, in that order (the "zig-zag" split of
ring-flash-attention and Llama 3): under a causal mask the early chunk sees few keys and the late
one many, so every rank gets the same work.

Two ways to see every key:

- ``mode="ring"``: the K/V shards travel round the ring (rank r sends to r + 1), one step per rank;
  the transfer of the next shard is posted before the attention of the current one, so it runs
  under it. Each step is one or a few tileattn calls on the (query segment, key segment) pairs the
  mask leaves visible (a full block, a causal diagonal, or nothing), merged into an fp32
  accumulator with ``merge_attention``. The backward walks the ring again with the global out and
  lse: dQ accumulates locally in fp32, dK/dV in fp32 buffers that travel with their K/V shard and
  arrive at its owner after the last step.
- ``mode="allgather"``: K and V are gathered whole first (Llama 3's recipe), then each local query
  segment is one call on the key range it can see; the backward reduce-scatters dK/dV (fp32) to
  their owners. More memory (the full K/V), fewer and larger calls, no overlap.

Windows are exact in both modes: each call takes only the queries and keys the window leaves
visible between the two segments and re-expresses the window in that block's bottom-right
aligned coordinates.

The packed (varlen) form, varlen.py, splits each sequence of a packed batch the same way and
reuses the blocks, the ring walks and the collectives below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..errors import InvalidArgumentError, InvalidTypeError
from .. import _ops
from ..functional import _check_operands, _EmptyAttention, _scaled_query, _softcap, _window
from .merge import merge_attention

__all__ = ["shard", "unshard", "context_parallel_attn"]

_MODES = ("ring", "allgather")


# ---- the process group and the split ----------------------------------------------------------

def _check_shards(q: Tensor, k: Tensor, v: Tensor, mode: str, rank: int, dims: str, token_dim: int,
                  what: str) -> None:
    """The rules every form of the call shares: the mode, q/k/v tensors of `rank` dimensions with
    the same number of local tokens along `token_dim` (`what` they are, for the message)."""
    if mode not in _MODES:
        raise InvalidArgumentError(f"mode={mode!r} must be one of {_MODES}")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise InvalidArgumentError(f"{name} must have {rank} dimensions {dims}, got shape {tuple(t.shape)}")
    n = token_dim
    if k.shape[n] != q.shape[n] or v.shape[n] != q.shape[n]:
        raise InvalidArgumentError(f"k.shape[{n}]={k.shape[n]} and v.shape[{n}]={v.shape[n]} must equal "
                                   f"q.shape[{n}]={q.shape[n]} (q, k and v are {what})")


def _group_rank_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tileattn.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group, e.g. under torchrun)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise InvalidArgumentError("this process is not a member of group (torch.distributed.get_rank(group) is -1); "
                                   "only the group's ranks may call")
    return rank, world


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _segments(rank: int, world: int, local_len: int, causal: bool) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the runs of the sequence a rank holds."""
    if not causal:
        return [(0, rank * local_len, local_len)]
    m = local_len // 2
    return [(0, rank * m, m), (m, (2 * world - 1 - rank) * m, m)]


def _check_split(length: int, world: int, causal: bool, what: str) -> None:
    parts = 2 * world if causal else world
    if length % parts != 0:
        why = f"2 * world_size={parts} (causal: two chunks per rank)" if causal else f"world_size={parts}"
        raise InvalidArgumentError(f"{what}={length} must be divisible by {why}")


def shard(x: Tensor, group=None, dim: int = 1, causal: bool = False) -> Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` (the sequence axis of (batch, seqlen,
    heads, headdim) by default): the contiguous rows [r n, (r + 1) n) (a view) or, with ``causal``,
    the zig-zag pair of chunks r and 2P - 1 - r (a copy). Differentiable."""
    rank, world = _group_rank_size(group)
    dim = dim % x.dim()
    _check_split(x.shape[dim], world, causal, f"x.shape[{dim}]")
    n = x.shape[dim] // world
    parts = [x.narrow(dim, g, length) for _, g, length in _segments(rank, world, n, causal)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x_local: Tensor, group=None, dim: int = 1, causal: bool = False) -> Tensor:
    """The full tensor from every rank's ``shard`` (the inverse of ``shard``, on every rank).
    Gathers with ``all_gather``; not differentiable."""
    rank, world = _group_rank_size(group)
    dim = dim % x_local.dim()
    n = x_local.shape[dim]
    if causal and n % 2 != 0:
        raise InvalidArgumentError(f"x_local.shape[{dim}]={n} must be even (causal: two chunks per rank)")
    pieces = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(pieces, x_local.contiguous(), group=group)
    shape = list(x_local.shape)
    shape[dim] = n * world
    full = x_local.new_empty(shape)
    for s, piece in enumerate(pieces):
        for local, g, length in _segments(s, world, n, causal):
            full.narrow(dim, g, length).copy_(piece.narrow(dim, local, length))
    return full


# ---- blocks: which queries see which keys between two segments --------------------------------

@dataclass(frozen=True)
class _Block:
    q0: int  # query rows [q0, q1) and key rows [k0, k1), relative to their segments' starts
    q1: int
    k0: int
    k1: int
    causal: bool
    left: int  # the window in the block's own bottom-right aligned coordinates (-1: none)
    right: int


def _block(qg: int, sq: int, kg: int, sk: int, causal: bool, left: int, right: int) -> Optional[_Block]:
    """The call that gives queries [qg, qg + sq) their attention over keys [kg, kg + sk) (global
    positions), or None when the mask hides the whole block. Query x sees key y when
    x - left <= y <= x + right (a bound of -1 is absent; causal is right = 0). Only queries that see
    a key of the block take part, and only keys some query sees, so the window re-expressed in the
    block's own coordinates has both bounds >= 0 (tileattn's rule) and no row of it is empty."""
    if causal:
        right = 0
    qa, qb = qg, qg + sq
    if right >= 0:
        qa = max(qa, kg - right)
    if left >= 0:
        qb = min(qb, kg + sk + left)
    if qb <= qa:
        return None
    lo, hi = kg, kg + sk
    if left >= 0:
        lo = max(lo, qa - left)
    if right >= 0:
        hi = min(hi, qb + right)
    nq, nk = qb - qa, hi - lo
    shift = nk - nq  # tileattn aligns the block bottom-right: query i sits at key i + shift
    wl = left + hi - qb if left >= 0 else -1
    wr = right + qb - hi if right >= 0 else -1
    if wl >= nk - 1:  # not even the last query's lower bound reaches past the block's first key
        wl = -1
    if wr >= 0 and shift + wr >= nk - 1:  # nor its upper bound before the last
        wr = -1
    return _Block(qa - qg, qb - qg, lo - kg, hi - kg, wr == 0, wl, wr)


# ---- one block's forward and backward on tileattn ----------------------------------------------

@dataclass(frozen=True)
class _Config:
    group: object
    causal: bool
    mode: str
    scale: float
    left: int
    right: int
    softcap: float


def _block_forward(q: Tensor, k: Tensor, v: Tensor, b: _Block, cfg: _Config) -> tuple[Tensor, Tensor]:
    return _ops._forward_impl(q[:, b.q0:b.q1], k[:, b.k0:b.k1], v[:, b.k0:b.k1], None, None, 0, 0, cfg.scale,
                              b.causal, b.left, b.right, cfg.softcap, False)


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, b: _Block,
                    cfg: _Config) -> tuple[Tensor, Tensor, Tensor]:
    qs, ks = slice(b.q0, b.q1), slice(b.k0, b.k1)
    return _call_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs].contiguous(), None,
                          None, 0, 0, b.causal, b.left, b.right, cfg)


def _call_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q: int, max_seqlen_k: int, causal: bool, left: int, right: int,
                   cfg: _Config) -> tuple[Tensor, Tensor, Tensor]:
    """One tileattn backward with the global out and lse (fixed-length, or varlen with cu_seqlens):
    ``partial_keys`` tells the library that out and lse cover more keys than this call's, so every
    backend forms P from the given lse and D from the given out rather than renormalising over the
    call's own keys (which the CUDA fp32 backward, and the CPU backward for 16-bit inputs or head
    dims <= 8, do for a whole problem)."""
    dq, dk, dv = _ops._backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     cfg.scale, causal, left, right, cfg.softcap, False, partial_keys=True)
    return dq, dk, dv


# ---- packing several tensors into one message --------------------------------------------------

def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buf: Tensor, *likes: Tensor) -> list[Tensor]:
    out, offset = [], 0
    for t in likes:
        out.append(buf[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _ring_exchange(send: list[Tensor], group, rank: int, world: int) -> tuple[list[Tensor], list]:
    """Posts the send of each tensor to rank + 1 and a receive of its like from rank - 1; returns the
    receive buffers and the requests to wait on."""
    nxt, prv = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)
    recv = [torch.empty_like(t) for t in send]
    ops = []
    for tag, (s, r) in enumerate(zip(send, recv)):
        ops.append(dist.P2POp(dist.isend, s, nxt, group, tag))
        ops.append(dist.P2POp(dist.irecv, r, prv, group, tag))
    return recv, (dist.batch_isend_irecv(ops) if ops else [])


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


# ---- ring --------------------------------------------------------------------------------------

def _pairs(rank: int, src: int, world: int, n: int, cfg: _Config):
    """(q segment, k segment, block) for this rank's queries against rank `src`'s keys."""
    for qseg in _segments(rank, world, n, cfg.causal):
        for kseg in _segments(src, world, n, cfg.causal):
            b = _block(qseg[1], qseg[2], kseg[1], kseg[2], cfg.causal, cfg.left, cfg.right)
            if b is not None:
                yield qseg, kseg, b


def _shift(b: _Block, qseg, kseg) -> _Block:
    """The block in the local tensors' rows (segments start at qseg[0] and kseg[0])."""
    return _Block(b.q0 + qseg[0], b.q1 + qseg[0], b.k0 + kseg[0], b.k1 + kseg[0], b.causal, b.left, b.right)


def _ring_walk(k: Tensor, v: Tensor, cfg: _Config, step_fn) -> None:
    """The forward's ring: at each step ``step_fn(step, k_cur, v_cur)`` runs on the K/V shard of rank
    ``rank - step`` while the next shard is in flight."""
    rank, world = _group_rank_size(cfg.group)
    kv = _pack(k, v)
    for step in range(world):
        nxt, reqs = _ring_exchange([kv], cfg.group, rank, world) if step < world - 1 else (None, [])
        k_cur, v_cur = _unpack(kv, k, v)
        step_fn(step, k_cur, v_cur)
        _wait(reqs)
        if nxt is not None:
            kv = nxt[0]


def _ring_backward_walk(k: Tensor, v: Tensor, cfg: _Config, step_fn) -> tuple[Tensor, Tensor]:
    """The backward's ring: ``step_fn(step, k_cur, v_cur, dk_cur, dv_cur)`` adds the visiting shard's
    gradient into fp32 dk_cur and dv_cur, which travel on with the shard; returns this rank's own
    shard's summed fp32 (dk, dv) once they have come back."""
    rank, world = _group_rank_size(cfg.group)
    f32 = dict(dtype=torch.float32, device=k.device)
    dk_like, dv_like = torch.empty(k.shape, **f32), torch.empty(v.shape, **f32)
    kv = _pack(k, v)
    carried = None  # fp32 dK/dV of the shard held last step, summed over the ranks it has visited
    for step in range(world):
        send = ([kv] if step < world - 1 else []) + ([carried] if carried is not None else [])
        recv, reqs = _ring_exchange(send, cfg.group, rank, world)
        k_cur, v_cur = _unpack(kv, k, v)
        dkv = torch.zeros(k.numel() + v.numel(), **f32)
        step_fn(step, k_cur, v_cur, *_unpack(dkv, dk_like, dv_like))
        _wait(reqs)
        if carried is not None:
            dkv += recv[-1]  # what the ranks before this one added to this shard's gradient
        carried = dkv
        if step < world - 1:
            kv = recv[0]
    if world > 1:
        recv, reqs = _ring_exchange([carried], cfg.group, rank, world)
        _wait(reqs)
        carried = recv[0]
    dk, dv = _unpack(carried, dk_like, dv_like)
    return dk, dv


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, Tensor]:
    rank, world = _group_rank_size(cfg.group)
    batch, n, heads = q.shape[0], q.shape[1], q.shape[2]
    out = torch.empty((batch, n, heads, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, n), -math.inf, dtype=torch.float32, device=q.device)

    def step_fn(step, k_cur, v_cur):
        for qseg, kseg, b in _pairs(rank, (rank - step) % world, world, n, cfg):
            b = _shift(b, qseg, kseg)
            o_b, l_b = _block_forward(q, k_cur, v_cur, b, cfg)
            merge_attention(out[:, b.q0:b.q1], lse[:, :, b.q0:b.q1], o_b, l_b)

    _ring_walk(k, v, cfg, step_fn)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, cfg: _Config) -> tuple[Tensor, Tensor, Tensor]:
    rank, world = _group_rank_size(cfg.group)
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def step_fn(step, k_cur, v_cur, dk_cur, dv_cur):
        for qseg, kseg, b in _pairs(rank, (rank - step) % world, world, n, cfg):
            b = _shift(b, qseg, kseg)
            dq_b, dk_b, dv_b = _block_backward(dout, q, k_cur, v_cur, out, lse, b, cfg)
            dq[:, b.q0:b.q1] += dq_b
            dk_cur[:, b.k0:b.k1] += dk_b
            dv_cur[:, b.k0:b.k1] += dv_b

    dk, dv = _ring_backward_walk(k, v, cfg, step_fn)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- all-gather --------------------------------------------------------------------------------

def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _all_gather(local: Tensor, group) -> list[Tensor]:
    """Every rank's ``local`` (same size everywhere), in rank order."""
    world = dist.get_world_size(group)
    if _is_nccl(group):
        flat = local.new_empty(world * local.numel())
        dist.all_gather_into_tensor(flat, local, group=group)
        return list(flat.split(local.numel()))
    pieces = [torch.empty_like(local) for _ in range(world)]  # gloo gathers into a list
    dist.all_gather(pieces, local, group=group)
    return pieces


def _reduce_scatter(flat: Tensor, group) -> Tensor:
    """This rank's part of the sum over the ranks of ``flat`` (world equal parts, in rank order)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    size = flat.numel() // world
    if _is_nccl(group):
        mine = flat.new_empty(size)
        dist.reduce_scatter_tensor(mine, flat, group=group)
        return mine
    dist.all_reduce(flat, group=group)  # gloo has no reduce-scatter: sum everything, keep this rank's part
    return flat[rank * size:(rank + 1) * size]


def _gather_full(k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, Tensor]:
    _, world = _group_rank_size(cfg.group)
    n = k.shape[1]
    pieces = _all_gather(_pack(k, v), cfg.group)
    k_full = k.new_empty((k.shape[0], n * world, *k.shape[2:]))
    v_full = v.new_empty((v.shape[0], n * world, *v.shape[2:]))
    for s, piece in enumerate(pieces):
        k_s, v_s = _unpack(piece, k, v)
        for local_start, g, length in _segments(s, world, n, cfg.causal):
            k_full[:, g:g + length] = k_s[:, local_start:local_start + length]
            v_full[:, g:g + length] = v_s[:, local_start:local_start + length]
    return k_full, v_full


def _allgather_blocks(rank: int, world: int, n: int, cfg: _Config):
    for qseg in _segments(rank, world, n, cfg.causal):
        b = _block(qseg[1], qseg[2], 0, n * world, cfg.causal, cfg.left, cfg.right)
        if b is not None:
            yield _Block(b.q0 + qseg[0], b.q1 + qseg[0], b.k0, b.k1, b.causal, b.left, b.right)


def _allgather_forward(q, k, v, cfg: _Config):
    rank, world = _group_rank_size(cfg.group)
    k_full, v_full = _gather_full(k, v, cfg)
    n = q.shape[1]
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], n), -math.inf, dtype=torch.float32, device=q.device)
    for b in _allgather_blocks(rank, world, n, cfg):
        out[:, b.q0:b.q1], lse[:, :, b.q0:b.q1] = _block_forward(q, k_full, v_full, b, cfg)
    return out, lse


def _allgather_backward(dout, q, k, v, out, lse, cfg: _Config):
    rank, world = _group_rank_size(cfg.group)
    k_full, v_full = _gather_full(k, v, cfg)
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk_full = torch.zeros(k_full.shape, dtype=torch.float32, device=q.device)
    dv_full = torch.zeros(v_full.shape, dtype=torch.float32, device=q.device)
    for b in _allgather_blocks(rank, world, n, cfg):
        dq_b, dk_b, dv_b = _block_backward(dout, q, k_full, v_full, out, lse, b, cfg)
        dq[:, b.q0:b.q1] = dq_b
        dk_full[:, b.k0:b.k1] += dk_b
        dv_full[:, b.k0:b.k1] += dv_b
    # Each rank's shard of the summed dK/dV, in rank order, then one reduce-scatter (fp32).
    f32 = dict(dtype=torch.float32, device=q.device)
    dk_like, dv_like = torch.empty(k.shape, **f32), torch.empty(v.shape, **f32)
    by_rank = []
    for s in range(world):
        segs = _segments(s, world, n, cfg.causal)
        by_rank.append(torch.cat([dk_full[:, g:g + length] for _, g, length in segs], 1))
        by_rank.append(torch.cat([dv_full[:, g:g + length] for _, g, length in segs], 1))
    mine = _reduce_scatter(_pack(*by_rank), cfg.group)
    dk, dv = _unpack(mine, dk_like, dv_like)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the autograd function and the public call -------------------------------------------------

class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _Config):
        fwd = _ring_forward if cfg.mode == "ring" else _allgather_forward
        out, lse = fwd(q, k, v, cfg)
        # The global out and lse: all any block's backward needs besides Q, K, V and dO.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    @once_differentiable  # the block backwards' gradients have no derivative of their own
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        bwd = _ring_backward if cfg.mode == "ring" else _allgather_backward
        dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, cfg)
        return dq, dk, dv, None


def context_parallel_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False, mode: str = "ring",
                          softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                          softcap: float = 0.0) -> Tensor:
    """Attention of a sequence split over the ranks of ``group``; returns this rank's output shard.

    ``q``, ``k``, ``v`` are this rank's shards, (batch, seqlen_local, heads, headdim), as ``shard``
    cuts them with the same ``causal`` (zig-zag chunks when causal). The options mean what they do in
    ``flash_attn_func`` for the whole sequence (causal aligned at the diagonal, since Q and K are the
    same sequence); GQA/MQA take fewer K/V heads. Differentiable in q, k and v; every rank of the
    group must call it with the same shapes and options.
    """
    _check_shards(q, k, v, mode, 4, "(batch, seqlen_local, heads, headdim)", 1, "shards of one sequence")
    if causal and q.shape[1] % 2 != 0:
        raise InvalidArgumentError(f"q.shape[1]={q.shape[1]} must be even (causal: two zig-zag chunks per rank)")
    q, cfg = _config(q, k, v, None, group, causal, mode, softmax_scale, window_size, softcap)
    if q.numel() == 0 or k.numel() == 0:  # what flash_attn_func gives, and nothing to exchange
        return _EmptyAttention.apply(q, k, v, False)[0]
    return _ContextParallelAttention.apply(q, k, v, cfg)


def _config(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], group, causal, mode, softmax_scale,
            window_size, softcap) -> tuple[Tensor, _Config]:
    """The checks both forms share, and their options in one object, read as flash_attn_func reads
    them; q as the kernels take it (_scaled_query). Every rule the library would apply to the
    operands is checked here, before anything is sent: a rank refused after posting a send would
    leave its neighbours, and the group, waiting."""
    _, world = _group_rank_size(group)
    _check_operands(q, k, v, cu_seqlens, cu_seqlens)
    left, right = _window(window_size)
    q, scale = _scaled_query(q, softmax_scale, "softmax_scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # One rank holds everything: the all-gather path is then a single call, with no exchange.
    return q, _Config(group, bool(causal), "allgather" if world == 1 else mode, scale, left, right, _softcap(softcap))
