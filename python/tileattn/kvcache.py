"""Inference with a key/value cache, as flash-attn's ``flash_attn_with_kvcache``: new keys and
values appended to the cache in place (with rotary embedding), then attention over each
sequence's cached keys, contiguous or paged (``block_table``).

The attention itself is the library's forward over the cache where it lies (problem.hpp's
key/value cache fields): nothing is gathered or copied. Appending and the rotary embedding are a
few tensor operations on the caller's stream, with no host synchronisation (CUDA graphs work).
"""

from __future__ import annotations

import contextlib
import re
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import _ops
from .functional import _dtype_name, _float32, _scale, _window


def _int32_table(t: Optional[Tensor], name: str, shape: tuple, device: torch.device) -> Optional[Tensor]:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}.dtype={_dtype_name(t.dtype)} must be int32")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; all tensors must share one device")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}.shape={tuple(t.shape)} must be {shape}")
    return t.contiguous()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x (batch, seqlen, heads, d) with cos/sin (batch, seqlen, rotary_dim / 2),
    computed in fp32 and rounded once; dims past rotary_dim pass through."""
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].float()
    cos, sin = cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1) if rd < x.shape[-1] else rot.to(x.dtype)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """Attention of q over a key/value cache, as ``flash_attn.flash_attn_with_kvcache``.

    q is (batch, seqlen_q, heads, headdim). k_cache/v_cache are (batch_cache, seqlen_cache,
    heads_kv, headdim), or with ``block_table`` (batch, max_pages) int32 paged caches
    (num_pages, page_size, heads_kv, headdim); heads_kv divides heads (GQA/MQA).

    ``cache_seqlens`` (int, or int32 (batch,)) are the cached lengths. New ``k``/``v``
    (batch, seqlen_new, heads_kv, headdim), when given, are written into the caches in place at
    rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of cache row ``cache_batch_idx[b]`` (or
    b; through the page table when paged) before attending; ``cache_seqlens`` itself is not
    changed. Sequence b then attends to cache rows [cache_leftpad[b], cache_seqlens[b] +
    seqlen_new). With ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2) the new keys and q
    are rotated first, at absolute cache positions: new key i at cache_seqlens[b] + i, query i at
    cache_seqlens[b] + i when causal or windowed, else every query at cache_seqlens[b];
    ``rotary_interleaved`` picks pairs (2i, 2i + 1) (GPT-J) or (i, i + rotary_dim / 2) (GPT-NeoX).

    ``causal`` and ``window_size`` are aligned to each sequence's own key count (bottom-right);
    ``softcap``, ``alibi_slopes`` and ``softmax_scale`` as in ``flash_attn_func``. ``num_splits``
    bounds how many parts each row's keys are split into on the GPU (0: chosen by the library);
    it changes rounding only. Returns out (batch, seqlen_q, heads, headdim_v), and with
    ``return_softmax_lse=True`` also lse (batch, heads, seqlen_q) float32. Forward only (no
    autograd).

    Cache positions (cache_seqlens + seqlen_new within the cache, page indices, cache_batch_idx,
    cache_leftpad) held on the GPU are checked only under ``tileattn.check_cu_seqlens()`` (the check
    synchronises); unchecked, out-of-range values give unspecified results but no access outside
    the tensors.
    """
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions (batch, seqlen_q, heads, headdim), got shape "
                         f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch_cache, seqlen_cache, heads_kv, headdim) or, "
                             "paged, (num_pages, page_size, heads_kv, headdim)")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append)")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"v_cache.shape={tuple(v_cache.shape)} must equal k_cache.shape={tuple(k_cache.shape)} "
                         "in all dimensions but the last")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos/rotary_sin need the new k and v (the rotary embedding is applied to the keys "
                         "being appended and to q)")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={_dtype_name(t.dtype)} must equal q.dtype={_dtype_name(q.dtype)}")
    batch, seqlen_q = q.shape[0], q.shape[1]
    device = q.device
    splits = _splits(num_splits)
    paged = block_table is not None
    left, right = _window(window_size)

    if paged:
        if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch, max_pages)=({batch}, max_pages), got shape "
                             f"{tuple(block_table.shape) if isinstance(block_table, Tensor) else block_table!r}")
        block_table = _int32_table(block_table, "block_table", tuple(block_table.shape), device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache is indexed by "
                             "its page table)")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad cannot be combined with block_table")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache.shape[0]={k_cache.shape[0]} must equal q.shape[0]={batch} (batch), or "
                             "cache_batch_idx must say which cache row each sequence uses")
    cache_batch_idx = _int32_table(cache_batch_idx, "cache_batch_idx", (batch,), device)
    cache_leftpad = _int32_table(cache_leftpad, "cache_leftpad", (batch,), device)

    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1]
        for t, name, d in ((k, "k", k_cache.shape[-1]), (v, "v", v_cache.shape[-1])):
            want = (batch, seqlen_new, k_cache.shape[2], d)
            if t.dim() != 4 or tuple(t.shape) != want:
                raise ValueError(f"{name}.shape={tuple(t.shape)} must be {want} (batch, seqlen_new, heads_kv, "
                                 "headdim of the cache)")
            if t.dtype != q.dtype:
                raise TypeError(f"{name}.dtype={_dtype_name(t.dtype)} must equal q.dtype={_dtype_name(q.dtype)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is needed with k and v (where to append them)")

    # Cached lengths as an int32 tensor on q's device.
    if cache_seqlens is None:
        seqlens = None
    elif isinstance(cache_seqlens, Tensor):
        seqlens = _int32_table(cache_seqlens, "cache_seqlens", (batch,), device)
    else:
        n = int(cache_seqlens)
        if not 0 <= n <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens={n} must be in [0, {capacity - seqlen_new}] (the cache holds "
                             f"{capacity} keys per sequence and {seqlen_new} are appended)")
        seqlens = torch.full((batch,), n, dtype=torch.int32, device=device)
    if seqlens is not None and batch > 0 and (seqlens.device.type == "cpu" or _ops._checks["cu_seqlens"]):
        low, top = int(seqlens.min()), int(seqlens.max())
        if low < 0 or top + seqlen_new > capacity:
            raise ValueError(f"cache_seqlens must be in [0, {capacity - seqlen_new}] (the cache holds {capacity} "
                             f"keys per sequence and {seqlen_new} are appended), got values in [{low}, {top}]")

    if k is not None:
        if rotary_cos is not None:
            rd2 = rotary_cos.shape[-1] if rotary_cos.dim() == 2 else -1
            if rotary_cos.dim() != 2 or tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
                raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got "
                                 f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
            if not 0 < 2 * rd2 <= q.shape[-1]:
                raise ValueError(f"rotary_dim={2 * rd2} (2 * rotary_cos.shape[1]) must be in [2, headdim="
                                 f"{q.shape[-1]}]")
            if rotary_cos.shape[0] < capacity:
                raise ValueError(f"rotary_cos.shape[0]={rotary_cos.shape[0]} must be >= {capacity} (a position for "
                                 "every key the cache holds)")
            for t, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
                if t.device != device:
                    raise ValueError(f"{name} is on {t.device} but q is on {device}")
            # Positions clamp to the table so that unchecked device lengths cannot index past it.
            last = rotary_cos.shape[0] - 1
            pos_k = (seqlens.long().unsqueeze(1) + torch.arange(seqlen_new, device=device)).clamp_(0, last)
            k = _rotate(k, rotary_cos[pos_k], rotary_sin[pos_k], rotary_interleaved)
            local = causal or left >= 0 or right >= 0
            steps = torch.arange(seqlen_q, device=device) if local else torch.zeros(seqlen_q, dtype=torch.long,
                                                                                     device=device)
            pos_q = (seqlens.long().unsqueeze(1) + steps).clamp_(0, last)
            q = _rotate(q, rotary_cos[pos_q], rotary_sin[pos_q], rotary_interleaved)
        seqused = seqlens + seqlen_new
    else:
        seqused = seqlens
    # Without explicit lengths each sequence reaches the end of its cache row.
    if seqused is None and (cache_leftpad is not None or paged):
        seqused = torch.full((batch,), capacity, dtype=torch.int32, device=device)

    scale, cap = _scale(softmax_scale, "softmax_scale"), _float32(softcap, "softcap")
    if q.numel() == 0 or capacity == 0:
        # Nothing to attend (no query rows, or a cache of no keys): what a fully masked row gives.
        if k is not None:
            _append(k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table, capacity)
        out = q.new_zeros((*q.shape[:-1], v_cache.shape[-1]))
        lse = torch.full((batch, q.shape[2], seqlen_q), float("-inf"), dtype=torch.float32, device=device)
        return (out, lse) if return_softmax_lse else out
    # Every rule is checked (the plan) before the cache is written, so a refused call changes nothing.
    with _argument_names():
        out, lse, run = _ops.plan_cache_forward(q, k_cache, v_cache, None, None, seqlen_q, capacity, scale,
                                                bool(causal), left, right, cap, alibi_slopes, seqused, cache_leftpad,
                                                cache_batch_idx, block_table, splits)
    if k is not None:
        _append(k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table, capacity)
    run()
    return (out, lse) if return_softmax_lse else out


# The library names the cache fields after its problem struct; a caller of flash_attn_with_kvcache
# passed flash-attn's names, which its error messages should use.
_CALLER_NAMES = (("leftpad_k", "cache_leftpad"), ("kv_batch_idx", "cache_batch_idx"),
                 ("seqused_k", "cache_seqlens + seqlen_new"), ("kv_batch", "k_cache.shape[0]"),
                 ("num_pages", "k_cache.shape[0]"))


@contextlib.contextmanager
def _argument_names():
    try:
        yield
    except (ValueError, TypeError, NotImplementedError) as e:
        message = str(e)
        for ours, theirs in _CALLER_NAMES:
            message = re.sub(rf"\b{ours}\b", theirs, message)
        if message == str(e):
            raise
        raise type(e)(message) from None


def _splits(num_splits) -> int:
    n = int(num_splits)
    if n < 0:
        raise ValueError(f"num_splits={num_splits} must be >= 0 (0 = chosen by the library)")
    return n


def _append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, seqlens: Tensor,
            cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor], capacity: int) -> None:
    """Writes k, v (batch, seqlen_new, ...) at rows seqlens[b] + i of each sequence's cache row."""
    batch, seqlen_new = k.shape[0], k.shape[1]
    if batch == 0 or seqlen_new == 0:
        return
    device = k.device
    # Clamped like every other index the device cannot check without a sync: an out-of-range
    # length overwrites the row's last keys rather than memory past the cache.
    pos = (seqlens.long().unsqueeze(1) + torch.arange(seqlen_new, device=device)).clamp_(0, capacity - 1)
    if block_table is not None:
        page_size = k_cache.shape[1]
        pages = block_table.long().gather(1, pos // page_size).clamp_(0, k_cache.shape[0] - 1)
        rows = (pages, pos % page_size)
    else:
        cache_rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=device)
        rows = (cache_rows.clamp(0, k_cache.shape[0] - 1).unsqueeze(1).expand(batch, seqlen_new), pos)
    k_cache[rows] = k
    v_cache[rows] = v


def cache_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                         left: int, right: int, softcap: float, alibi_slopes: Optional[Tensor],
                         seqused_k: Optional[Tensor], block_table: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``flash_attn_varlen_func`` with ``block_table`` (paged k, v) and/or ``seqused_k``: the
    forward, returning (out, lse (heads, total_q))."""
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"{name} must be a 1-D tensor (batch + 1,) of int32 offsets")
    batch = cu_seqlens_q.shape[0] - 1
    device = q.device
    if block_table is not None:
        if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be (batch, max_pages)=({batch}, max_pages), got shape "
                             f"{tuple(block_table.shape) if isinstance(block_table, Tensor) else block_table!r}")
        block_table = _int32_table(block_table, "block_table", tuple(block_table.shape), device)
        for t, name in ((k, "k"), (v, "v")):
            if t.dim() != 4:
                raise ValueError(f"{name} must be a paged cache (num_pages, page_size, heads_kv, headdim) with "
                                 f"block_table, got shape {tuple(t.shape)}")
    seqused_k = _int32_table(seqused_k, "seqused_k", (batch,), device)
    if q.dim() != 3:
        raise ValueError(f"q must have 3 dimensions (total_tokens, heads, headdim), got shape {tuple(q.shape)}")
    if q.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=device)
    out, lse, run = _ops.plan_cache_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, left, right, softcap, alibi_slopes, seqused_k, None,
                                            None, block_table, 0)
    run()
    return out, lse
