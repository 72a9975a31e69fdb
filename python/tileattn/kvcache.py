"""Inference with a key/value cache, as flash-attn's ``flash_attn_with_kvcache``: new keys and
values appended to the cache in place (with rotary embedding), then attention over each
sequence's cached keys, contiguous or paged (``block_table``).

The whole call is the library's forward over the cache where it lies (problem.hpp's key/value
cache fields): the append and the rotary embedding run in the same plan, before the attention, on
the caller's stream and with no host synchronisation (CUDA graphs work); nothing is gathered.
"""

from __future__ import annotations

import contextlib
import operator
import re
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .errors import InvalidArgumentError, InvalidTypeError
from . import _ops
from .functional import _dtype_name, _flash_attn_lse, _flash_window, _int64, _places, _scaled_query, _softcap


def _int32_table(t: Optional[Tensor], name: str, shape: tuple, device: torch.device) -> Optional[Tensor]:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise InvalidTypeError(f"{name}.dtype={_dtype_name(t.dtype)} must be int32")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but q is on {device}; all tensors must share one device")
    if tuple(t.shape) != shape:
        raise InvalidArgumentError(f"{name}.shape={tuple(t.shape)} must be {shape}")
    return t.contiguous()


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
    b, so a cache with more rows than the batch uses its first ones; through the page table when
    paged) before attending; ``cache_seqlens`` itself is not changed. Sequence b then attends to
    cache rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new). With ``rotary_cos``/``rotary_sin``
    (seqlen_ro, rotary_dim / 2) the new keys and q are rotated first, at absolute cache positions:
    new key i at cache_seqlens[b] + i, query i at cache_seqlens[b] + i when causal or local (a
    window side shorter than the cache), else every query at cache_seqlens[b];
    ``rotary_interleaved`` picks pairs (2i, 2i + 1) (GPT-J) or (i, i + rotary_dim / 2) (GPT-NeoX).

    ``causal`` and ``window_size`` are aligned to each sequence's own key count (bottom-right),
    the window read against the cache's keys per sequence as flash-attn reads it (docs/python.md);
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
        raise InvalidArgumentError(f"q must have 4 dimensions (batch, seqlen_q, heads, headdim), got shape "
                                   f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise InvalidArgumentError(
                f"{name} must have 4 dimensions (batch_cache, seqlen_cache, heads_kv, headdim) or, "
                "paged, (num_pages, page_size, heads_kv, headdim)")
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v must be given together (the new keys and values to append)")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise InvalidArgumentError(
            f"v_cache.shape={tuple(v_cache.shape)} must equal k_cache.shape={tuple(k_cache.shape)} "
            "in all dimensions but the last")
    if (rotary_cos is None) != (rotary_sin is None):
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and k is None:
        raise InvalidArgumentError(
            "rotary_cos/rotary_sin need the new k and v (the rotary embedding is applied to the keys "
            "being appended and to q)")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.dtype != q.dtype:
            raise InvalidTypeError(f"{name}.dtype={_dtype_name(t.dtype)} must equal q.dtype={_dtype_name(q.dtype)}")
    batch, seqlen_q = q.shape[0], q.shape[1]
    device = q.device
    splits = _splits(num_splits)
    paged = block_table is not None

    if paged:
        if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise InvalidArgumentError(
                f"block_table must be (batch, max_pages)=({batch}, max_pages), got shape "
                f"{tuple(block_table.shape) if isinstance(block_table, Tensor) else block_table!r}")
        block_table = _int32_table(block_table, "block_table", tuple(block_table.shape), device)
        if cache_batch_idx is not None:
            raise InvalidArgumentError(
                "cache_batch_idx cannot be combined with block_table (a paged cache is indexed by "
                "its page table)")
        if cache_leftpad is not None:
            raise InvalidArgumentError("cache_leftpad cannot be combined with block_table")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            if k_cache.shape[0] < batch:
                raise InvalidArgumentError(
                    f"k_cache.shape[0]={k_cache.shape[0]} must be at least q.shape[0]={batch} (batch), or "
                    "cache_batch_idx must say which cache row each sequence uses")
            # As flash-attn: sequence b uses cache row b. Views, so appends land in the given cache.
            k_cache, v_cache = k_cache[:batch], v_cache[:batch]
    left, right = _flash_window(window_size, causal, capacity)
    cache_batch_idx = _int32_table(cache_batch_idx, "cache_batch_idx", (batch,), device)
    cache_leftpad = _int32_table(cache_leftpad, "cache_leftpad", (batch,), device)

    seqlen_new = 0
    if k is not None:
        # The shapes of k and v are the library's to check; their length places the append.
        seqlen_new = k.shape[1] if isinstance(k, Tensor) and k.dim() == 4 else 0
        if seqlen_new > capacity:
            raise InvalidArgumentError(
                f"k.shape[1]={seqlen_new} new keys exceed the cache's capacity={capacity} (keys per "
                "sequence)")
        if cache_seqlens is None:
            raise InvalidArgumentError("cache_seqlens is needed with k and v (where to append them)")

    # Cached lengths as an int32 tensor on q's device.
    if cache_seqlens is None:
        seqlens = None
    elif isinstance(cache_seqlens, Tensor):
        seqlens = _int32_table(cache_seqlens, "cache_seqlens", (batch,), device)
    else:
        try:
            n = operator.index(cache_seqlens)
        except TypeError:
            raise InvalidTypeError(f"cache_seqlens must be an int or an int32 tensor (batch,), got "
                                   f"{type(cache_seqlens).__name__}") from None
        if not 0 <= n <= capacity - seqlen_new:
            raise InvalidArgumentError(f"cache_seqlens={n} must be in [0, {capacity - seqlen_new}] (the cache holds "
                                       f"{capacity} keys per sequence and {seqlen_new} are appended)")
        seqlens = torch.full((batch,), n, dtype=torch.int32, device=device)
    # Read back on the CPU (or on request); not while tracing, where the value is not known yet (the
    # library checks a CPU tensor's values when the graph runs).
    if (seqlens is not None and batch > 0 and (seqlens.device.type == "cpu" or _ops._checks["cu_seqlens"])
            and not torch.compiler.is_compiling()):
        low, top = int(seqlens.min()), int(seqlens.max())
        if low < 0 or top + seqlen_new > capacity:
            raise InvalidArgumentError(
                f"cache_seqlens must be in [0, {capacity - seqlen_new}] (the cache holds {capacity} "
                f"keys per sequence and {seqlen_new} are appended), got values in [{low}, {top}]")

    if rotary_cos is not None:
        for t, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
            if not isinstance(t, Tensor):
                raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        # flash-attn takes the tables in q's dtype only; another float dtype is rounded to it once.
        rotary_cos, rotary_sin = (t.to(q.dtype) if t.dtype != q.dtype and t.is_floating_point() else t
                                  for t in (rotary_cos, rotary_sin))
    seqused = seqlens + seqlen_new if k is not None and seqlen_new else seqlens
    # Without explicit lengths each sequence reaches the end of its cache row.
    if seqused is None and (cache_leftpad is not None or paged):
        seqused = torch.full((batch,), capacity, dtype=torch.int32, device=device)

    q, scale = _scaled_query(q, softmax_scale, "softmax_scale")
    cap = _softcap(softcap)
    if q.numel() == 0 or capacity == 0:
        # Nothing to attend (no query rows, or a cache of no keys): what a fully masked row gives.
        out = q.new_zeros((*q.shape[:-1], v_cache.shape[-1]))
        lse = torch.full((batch, q.shape[2], seqlen_q), float("-inf"), dtype=torch.float32, device=device)
        if seqlen_new and batch and q.shape[2] and seqlen_q == 0:
            # The append still happens: through a call with one query position, its output unused.
            _cache_call(q.new_zeros((batch, 1, *q.shape[2:])), k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                        rotary_interleaved, seqused, cache_leftpad, cache_batch_idx, block_table, capacity, scale,
                        causal, left, right, cap, alibi_slopes, splits)
        return (out, _flash_attn_lse(lse)) if return_softmax_lse else out
    out, lse = _cache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved, seqused,
                           cache_leftpad, cache_batch_idx, block_table, capacity, scale, causal, left, right, cap,
                           alibi_slopes, splits)
    return (out, _flash_attn_lse(lse)) if return_softmax_lse else out


def _cache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved, seqused, cache_leftpad,
                cache_batch_idx, block_table, capacity, scale, causal, left, right, softcap, alibi_slopes, splits):
    """One library call: every rule is checked before anything runs, so a refused call leaves the
    cache as it was; then the append (rotary included) and the attention. Traced, it is an
    operator of the graph, whose messages keep the library's names."""
    names = contextlib.nullcontext() if torch.compiler.is_compiling() else _argument_names()
    with names:
        return _ops.cache_forward(q, k_cache, v_cache, None, None, q.shape[1], capacity, scale, bool(causal), left,
                                  right, softcap, alibi_slopes, seqused, cache_leftpad, cache_batch_idx, block_table,
                                  splits, k_new=k, v_new=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                  rotary_interleaved=rotary_interleaved)


# The library names the cache fields after its problem struct (its k and v are the caches, k_new
# and v_new the keys appended); a caller of flash_attn_with_kvcache passed flash-attn's names,
# which its error messages should use. One pass, so that no name is renamed twice.
_CALLER_NAMES = {"leftpad_k": "cache_leftpad", "kv_batch_idx": "cache_batch_idx",
                 "seqused_k": "cache_seqlens + seqlen_new", "kv_batch": "k_cache.shape[0]",
                 "num_pages": "k_cache.shape[0]", "rotary_dim": "rotary_dim (2 * rotary_cos.shape[1])",
                 "rotary_seqlen": "rotary_cos.shape[0]", "seqlen_k": "the cache's capacity",
                 "headdim_qk": "headdim", "k_new": "k", "v_new": "v", "k": "k_cache", "v": "v_cache"}
# rotary_dim is spelled out only where a value follows it ("rotary_dim=18"), not inside a shape.
_CALLER_PATTERN = re.compile(r"\b(" + "|".join("rotary_dim(?==)" if name == "rotary_dim" else re.escape(name)
                                                for name in _CALLER_NAMES) + r")(?!\w)")


@contextlib.contextmanager
def _argument_names():
    try:
        yield
    except (ValueError, TypeError, NotImplementedError) as e:
        message = _CALLER_PATTERN.sub(lambda m: _CALLER_NAMES[m.group(1)], str(e))
        if message == str(e):
            raise
        raise type(e)(message) from None


def _splits(num_splits) -> int:
    n = _int64(num_splits, "num_splits")
    if n < 0:
        raise InvalidArgumentError(f"num_splits={num_splits} must be >= 0 (0 = chosen by the library)")
    return n


def _paged_table(block_table, k: Tensor, v: Tensor, batch: int, device: torch.device) -> Tensor:
    """flash_attn_varlen_func's block_table (batch, max_pages) int32, over k and v as paged caches."""
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise InvalidArgumentError(
            f"block_table must be (batch, max_pages)=({batch}, max_pages), got shape "
            f"{tuple(block_table.shape) if isinstance(block_table, Tensor) else block_table!r}")
    block_table = _int32_table(block_table, "block_table", tuple(block_table.shape), device)
    for t, name in ((k, "k"), (v, "v")):
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name} must be a paged cache (num_pages, page_size, heads_kv, headdim) "
                                       f"with block_table, got shape {tuple(t.shape)}")
    return block_table


def gathered_keys(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor],
                  block_table: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The keys and values a ``flash_attn_varlen_func`` call with ``block_table`` and/or
    ``seqused_k`` reads, gathered into a plain variable-length batch: (k', v', cu_seqlens_k'). The
    gather is differentiable, its gradient adding into k and v, so such a call can have gradients.
    Tables are checked as the library checks them (CPU tables, or any with check_cu_seqlens());
    unchecked, an index out of range is clamped: unspecified values, never a read outside k, v."""
    if not isinstance(cu_seqlens_k, Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.shape[0] < 1:
        raise InvalidArgumentError("cu_seqlens_k must be a 1-D tensor (batch + 1,) of int32 offsets")
    batch, device = cu_seqlens_k.shape[0] - 1, k.device
    seqused_k = _int32_table(seqused_k, "seqused_k", (batch,), device)
    starts = cu_seqlens_k[:-1].long()
    lengths = cu_seqlens_k[1:].long() - starts if seqused_k is None else seqused_k.long()
    cu = torch.nn.functional.pad(lengths.clamp_min(0).cumsum(0), (1, 0))
    b, j = _places(cu, int(cu[-1]))  # the one wait for the device: the gathered length
    if block_table is None:
        index, rows, flat_k, flat_v = starts[b] + j, k.shape[0], k, v
        ok = lambda: bool((lengths <= cu_seqlens_k[1:].long() - starts).all())  # noqa: E731
        rule = "seqused_k[b] must be at most sequence b's length in cu_seqlens_k"
    else:
        block_table = _paged_table(block_table, k, v, batch, device)
        page, max_pages = k.shape[1], block_table.shape[1]
        slot = j // page
        pages = block_table.long()[b, slot.clamp_max(max_pages - 1)]
        index, rows, flat_k, flat_v = pages * page + j % page, k.shape[0] * page, k.flatten(0, 1), v.flatten(0, 1)
        ok = lambda: bool((slot < max_pages).all() and ((pages >= 0) & (pages < k.shape[0])).all())  # noqa: E731
        rule = "every key must lie on a page of block_table in [0, num_pages)"
    if device.type == "cpu" or _ops._checks["cu_seqlens"]:
        if not bool((lengths >= 0).all()) or not ok():
            raise InvalidArgumentError(f"the key tables break a rule: {rule}, and lengths must be >= 0")
    index = index.clamp(0, max(rows - 1, 0))
    return flat_k[index], flat_v[index], cu.to(torch.int32)


def cache_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                         left: int, right: int, softcap: float, alibi_slopes: Optional[Tensor],
                         seqused_k: Optional[Tensor], block_table: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``flash_attn_varlen_func`` with ``block_table`` (paged k, v) and/or ``seqused_k``: the
    forward, returning (out, lse (heads, total_q))."""
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] < 1:
            raise InvalidArgumentError(f"{name} must be a 1-D tensor (batch + 1,) of int32 offsets")
    batch = cu_seqlens_q.shape[0] - 1
    device = q.device
    if block_table is not None:
        block_table = _paged_table(block_table, k, v, batch, device)
    seqused_k = _int32_table(seqused_k, "seqused_k", (batch,), device)
    if q.dim() != 3:
        raise InvalidArgumentError(
            f"q must have 3 dimensions (total_tokens, heads, headdim), got shape {tuple(q.shape)}")
    if q.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=device)
    return _ops.cache_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                              left, right, softcap, alibi_slopes, seqused_k, None, None, block_table, 0)
