"""Public functions with flash-attn's and PyTorch SDPA's call signatures.

Every function goes through ``tileattn._ops`` (its torch.library operators under torch.compile,
the same computation without the operator dispatch in eager mode; autograd and CUDA graphs
either way). Options tileattn does not implement raise NotImplementedError naming the
argument; nothing is silently ignored.

fp32 inputs follow PyTorch's switch for fp32 matmuls, read at every call: with
``torch.set_float32_matmul_precision("high")`` or ``"medium"`` (or
``torch.backends.cuda.matmul.allow_tf32 = True``) they run in the tensor-core fast mode (TF32
products, fp32 accumulation) on the GPU; with ``"highest"`` (PyTorch's default) fp32 stays exact.
The CPU backend computes fp32 exactly in both cases.
"""

from __future__ import annotations

import math
import operator
import struct
import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import InvalidArgumentError, InvalidTypeError, _not_built
from . import _ext, _ops

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "scaled_dot_product_attention",
           "softmax_matmul"]

_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38


_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def _dropout(dropout_p: float) -> float:
    if type(dropout_p) is float and 0.0 <= dropout_p < _BELOW_ONE:  # every call without dropout
        return dropout_p
    p = float(dropout_p)
    if not 0.0 <= p <= 1.0:  # NaN fails too
        raise InvalidArgumentError(f"dropout_p={dropout_p!r} must be in [0, 1]")
    # The library takes float32: a p just below 1 must not round up to it.
    return p if p == 1.0 else min(p, _BELOW_ONE)


def _dropout_rng(q: Tensor, p: float) -> Optional[Tensor]:
    """The call's dropout seed and offset: two int64 draws (their bits read as uint64) from PyTorch's
    default generator of q's device, left on that device. The kernels read the pair when they run,
    so torch.manual_seed reproduces a run, every call advances the generator, nothing waits for the
    device, and a call captured into a CUDA graph draws a fresh pair on every replay (PyTorch's
    generator is graph-safe)."""
    if not 0.0 < p < 1.0 or q.device.type not in ("cpu", "cuda"):
        return None
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=q.device)


def dropout_keep_mask(dropout_rng: Optional[Tensor], dropout_p: float, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int) -> Tensor:
    """The keep mask of one dropout call as a bool tensor (batch, heads, seqlen_q, seqlen_k): True
    where element (b, h, i, j) is kept, with i, j positions within sequence b (src/common/philox.hpp's
    rule; docs/python.md). Every element is False for dropout_p = 1, True for dropout_p = 0."""
    mask = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.uint8)
    if dropout_p >= 1.0:
        return mask.zero_().view(torch.bool)
    seed, offset = _ops.dropout_seed_offset(dropout_rng)
    _ops._ext.dropout_keep_mask(_ops._capsule(mask), dropout_p, seed, offset)
    return mask.view(torch.bool)


def _float32(value, name: str) -> float:
    # The extension takes float32: a value beyond its range would reach the library's rules as inf
    # (or 0), and the message would name a number the caller never passed.
    if torch.compiler.is_compiling():
        # Traced, the value may be symbolic, and these checks would make it a constant (a
        # recompile per value, or a graph break); the library checks it when the graph runs.
        return value
    x = float(value)
    if math.isfinite(x) and abs(x) > _FLOAT32_MAX:
        raise InvalidArgumentError(f"{name}={value!r} is outside float32's range (|{name}| <= {_FLOAT32_MAX:.7g})")
    # Below float32's range a value is 0 there, as in flash-attn's float parameters.
    return x if x == 0.0 or struct.unpack("f", struct.pack("f", x))[0] != 0.0 else math.copysign(0.0, x)


def _scaled_query(q: Tensor, scale: Optional[float], name: str) -> tuple[Tensor, Optional[float]]:
    """(q, scale) with a scale the kernels take: they track each row's max of the raw products,
    which needs scale > 0, so a negative scale flips q's sign instead (exact) and 0 zeroes q (every
    visible key gets the same weight, as in flash-attn and PyTorch)."""
    if scale is None:
        return q, None
    scale = _float32(scale, name)
    if not torch.compiler.is_compiling() and not math.isfinite(scale):
        raise InvalidArgumentError(f"{name}={scale} must be finite")
    if scale > 0.0:
        return q, scale
    return (-q, -scale) if scale < 0.0 else (q * 0.0, 1.0)


def _softcap(softcap) -> float:
    # flash-attn soft-caps only where softcap > 0: any other value is "off".
    if type(softcap) is float and softcap == 0.0:  # the default, on every call
        return 0.0
    cap = _float32(softcap, "softcap")
    return cap if cap > 0.0 else 0.0


def _flash_attn_lse(lse: Tensor) -> Tensor:
    """softmax_lse as flash-attn returns it: +inf on a row that sees no key (its kernels' mark, so
    that exp(score - lse) is 0 there), where the library writes log(0) = -inf."""
    return torch.nan_to_num(lse, nan=math.nan, posinf=math.inf, neginf=math.inf)


def _int64(value, name: str) -> int:
    if torch.compiler.is_compiling():
        return value  # as in _float32: operator.index would make a symbolic value a constant
    try:
        x = operator.index(value)
    except TypeError:
        raise InvalidTypeError(f"{name}={value!r} must be an integer") from None
    if not -_INT64_MAX - 1 <= x <= _INT64_MAX:
        raise InvalidArgumentError(f"{name}={x} does not fit in int64")
    return x


_NO_WINDOW = (-1, -1)


def _window(window_size: Sequence[int]) -> tuple[int, int]:
    if (type(window_size) is tuple and window_size == _NO_WINDOW and type(window_size[0]) is int
            and type(window_size[1]) is int):  # the default
        return _NO_WINDOW
    if len(window_size) != 2:
        raise InvalidArgumentError(f"window_size={tuple(window_size)} must be a pair (left, right)")
    left, right = _int64(window_size[0], "window_size[0]"), _int64(window_size[1], "window_size[1]")
    # Any negative side is unbounded, as in flash-attn.
    return (left if left >= 0 else -1), (right if right >= 0 else -1)


def _flash_window(window_size: Sequence[int], causal: bool, keys) -> tuple[int, int]:
    """window_size as flash-attn's kernels apply it (its flash_api.cpp, every entry): a side reaching
    every key (>= keys: seqlen_k, max_seqlen_k, or the cache's keys per sequence) is unbounded, and a
    window bounded on the left only is bounded on the right at ``keys``, so that where seqlen_q >
    2 * seqlen_k the first rows see no key. keys None (k not a tensor yet): the pair as given, for
    the library to refuse the call."""
    left, right = _window(window_size)
    if keys is None:
        return left, right
    left = -1 if left >= keys else left
    right = -1 if right >= keys else right
    if not causal and left >= 0 and right < 0:
        right = int(keys)
    return left, right


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Traced by dynamo (a guard on the autocast state), so no is_compiling() check is needed.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Inside torch.autocast, the operands in its lower-precision dtype, as PyTorch's SDPA takes them
    (its autocast policy: every floating operand but float64 is cast)."""
    if not _any_autocast():  # the one check outside autocast
        return q, k, v
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t
                 for t in (q, k, v))


def _check_operands(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                    cu_seqlens_k: Optional[Tensor]) -> None:
    # The rules the extension applies to these tensors, with its messages, for calls that must know
    # before the extension runs: an empty problem (which never reaches it) and a context-parallel
    # call (whose ranks would be left waiting on a send posted before a refusal).
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    _ops._check_same_device(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    _ops._check_attention_ranks(q, k, v, varlen)
    if q.dtype not in _KERNEL_DTYPES:
        raise InvalidTypeError(f"q.dtype={_dtype_name(q.dtype)} is not supported (float16, bfloat16 or float32)")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise InvalidTypeError(f"{name}.dtype={_dtype_name(t.dtype)} must equal q.dtype={_dtype_name(q.dtype)}")
    if k.shape[-1] != q.shape[-1]:
        raise InvalidArgumentError(f"k.shape={tuple(k.shape)} must be {(*k.shape[:-1], q.shape[-1])} "
                                   "(its head dim must equal q.shape[-1])")
    if v.shape[:-1] != k.shape[:-1]:
        raise InvalidArgumentError(f"v.shape={tuple(v.shape)} must be {(*k.shape[:-1], v.shape[-1])} "
                                   "(all dimensions but the last must equal k's)")
    if not varlen and k.shape[0] != q.shape[0]:
        raise InvalidArgumentError(f"k.shape[0]={k.shape[0]} must equal q.shape[0]={q.shape[0]} (batch)")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_q % heads_kv if heads_kv else heads_q:
        raise InvalidArgumentError(f"heads_kv={heads_kv} must divide heads_q={heads_q} (GQA)")
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise InvalidArgumentError("cu_seqlens_q and cu_seqlens_k must be given together (variable length)")
        for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
            if t.dtype != torch.int32:
                raise InvalidTypeError(f"{name}.dtype={_dtype_name(t.dtype)} must be int32")
            if t.dim() != 1 or t.shape[0] < 1:
                raise InvalidArgumentError(f"{name} must be 1-D (batch + 1,) with at least one offset, got shape "
                                           f"{tuple(t.shape)}")
        if cu_seqlens_k.shape != cu_seqlens_q.shape:
            raise InvalidArgumentError(f"cu_seqlens_k.shape={tuple(cu_seqlens_k.shape)} must be "
                                       f"{tuple(cu_seqlens_q.shape)} (the shape of cu_seqlens_q)")


def _is_empty(q: Tensor, k: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int,
              max_seqlen_k: int) -> bool:
    """No query row sees a key: no rows, no heads, no batch, or no keys at all (for a
    variable-length batch also every sequence empty: a maximum length of 0)."""
    if cu_seqlens_q is not None:
        return (q.shape[0] == 0 or q.shape[1] == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] <= 1
                or max_seqlen_q == 0 or max_seqlen_k == 0)
    shape = q.shape  # read once: each read of a shape builds it
    return shape[0] == 0 or shape[1] == 0 or shape[2] == 0 or k.shape[1] == 0


def _check_empty_offsets(cu: Tensor, name: str, max_len: int, max_name: str) -> None:
    # A maximum length of 0 says every sequence is empty. The library checks that where it reads
    # the offsets anyway (CPU tensors, or CUDA ones with tileattn.check_cu_seqlens()); the same
    # rule and message here, since such a call never reaches it.
    if cu.device.type != "cpu" and not _ops._checks["cu_seqlens"]:
        return
    lengths = (cu[1:] - cu[:-1]).tolist()
    for b, n in enumerate(lengths):
        if n > max_len:
            raise InvalidArgumentError(f"{name}: sequence {b} has length {n} > {max_name}={max_len} ({max_name} is the "
                                       "maximum length of a variable-length batch)")


class _EmptyAttention(torch.autograd.Function):
    """What PyTorch's SDPA returns where nothing is computed: out of zeros (empty when there are
    no query rows), lse = -inf, and zero gradients. Written with setup_context, as torch.func's
    transforms require."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, varlen: bool):
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        return out, torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, _ = inputs
        ctx.shapes = (q.shape, k.shape, v.shape)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q_shape, k_shape, v_shape = ctx.shapes
        zeros = lambda shape: grad_out.new_zeros(shape)  # noqa: E731
        return zeros(q_shape), zeros(k_shape), zeros(v_shape), None


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right,
               softcap, deterministic, alibi_slopes=None, dropout_p=0.0, dropout_rng=None):
    if cu_seqlens_q is None and dropout_p != 1.0 and q.numel() and k.numel():
        # A fixed-length call with work, as nearly every one is: straight to the operator (each
        # Python frame on the way is host time that a short call pays in full).
        return _ops.attention(q, k, v, None, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, left,
                              right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng)
    if dropout_p == 1.0:
        # Every weight dropped: out is zeros and so are the gradients (out * 0 carries them); lse is
        # the undropped one, as at any p. The library's rule is p < 1, as flash-attn's kernel's.
        out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                              causal, left, right, softcap, deterministic, alibi_slopes)
        return out * 0.0, lse
    rank = 3 if cu_seqlens_q is not None else 4
    if q.dim() == rank and k.dim() == rank and _is_empty(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        _check_operands(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if cu_seqlens_q is not None:
            _check_empty_offsets(cu_seqlens_q, "cu_seqlens_q", max_seqlen_q, "seqlen_q")
            _check_empty_offsets(cu_seqlens_k, "cu_seqlens_k", max_seqlen_k, "seqlen_k")
        return _EmptyAttention.apply(q, k, v, cu_seqlens_q is not None)
    return _ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          left, right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng)


def _places(cu_seqlens: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Each of ``rows`` packed rows' sequence under ``cu_seqlens`` (batch + 1 offsets; batch for a
    row past the last sequence) and its place from that sequence's start."""
    cu = cu_seqlens.long()
    row = torch.arange(rows, device=cu.device)
    seq = torch.searchsorted(cu[1:], row, right=True)
    return seq, row - cu[seq]


def _attention_probs(q: Tensor, k: Tensor, headdim_v: int, cu_seqlens_q: Optional[Tensor],
                     cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, options: tuple) -> Tensor:
    """The weights P the kernels give each key (every mask, ALiBi and the soft cap; no dropout), as
    (batch, heads, seqlen_q, seqlen_k) in q's dtype (varlen: max_seqlen_q, max_seqlen_k, sequence
    b's in [b, :, :len_q, :len_k]): the attention of one-hot values, so that they are the kernels' own
    weights. A call takes as many keys as the call's own head dim (max of q's and v's, headdim_v), so
    that it runs in the call's head-dim bucket: a build may lack the others. For testing, as
    flash-attn's S_dmask."""
    step = max(q.shape[-1], headdim_v, 1)
    with torch.no_grad():
        varlen = cu_seqlens_q is not None
        if varlen:
            batch, seqlen_k = cu_seqlens_q.shape[0] - 1, max_seqlen_k
            _, key_pos = _places(cu_seqlens_k, k.shape[0])
        else:
            batch, seqlen_k = k.shape[0], k.shape[1]
            key_pos = torch.arange(seqlen_k, device=k.device)
        columns = []
        for j0 in range(0, seqlen_k, step):
            j = torch.arange(j0, min(j0 + step, seqlen_k), device=k.device)
            one_hot = (key_pos[:, None] == j).to(q.dtype)  # (keys, chunk)
            v = one_hot[:, None] if varlen else one_hot[None, :, None]
            v = v.expand(*k.shape[:-1], j.shape[0])
            out, _ = _ops.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options)
            columns.append(out)
        p = torch.cat(columns, -1) if columns else q.new_zeros((*q.shape[:-1], 0))
        if not varlen:
            return p.transpose(1, 2)
        rows = torch.zeros(batch, q.shape[1], max_seqlen_q, seqlen_k, dtype=q.dtype, device=q.device)
        query_seq, query_pos = _places(cu_seqlens_q, q.shape[0])
        # Rows past the last sequence belong to none; places outside [0, max_seqlen_q) come from
        # cu_seqlens_q that break its rules (unchecked on CUDA by default) and are left out.
        inside = (query_seq < batch) & (query_pos >= 0) & (query_pos < max_seqlen_q)
        rows[query_seq[inside], :, query_pos[inside]] = p[inside]
        return rows


def _finish(out: Tensor, lse: Tensor, return_attn_probs: bool, dropout=None, probs=None):
    """What flash-attn's entries return: out, or with return_attn_probs (out, softmax_lse, S_dmask).
    S_dmask has entries only with dropout, as flash-attn's: each key's weight P (``probs()``) with
    the sign bit set where dropout dropped it, shaped (batch, heads, seqlen_q, seqlen_k) rounded up
    to multiples of 128, in q's dtype; without dropout an empty (0,) tensor in q's dtype, as
    flash-attn (2.6 on) returns. softmax_lse is differentiable: its gradient is each row's softmax
    (flash-attn's own softmax_lse gets none)."""
    if not return_attn_probs:
        return out
    lse = _flash_attn_lse(lse)
    if dropout is None:
        return out, lse, out.new_empty((0,))
    keep = dropout_keep_mask(*dropout).to(out.device)  # computed on the host
    s_dmask = torch.where(keep, 1.0, -1.0).to(out.dtype) * probs()
    round_up = lambda n: -(-n // 128) * 128  # noqa: E731
    pad = (0, round_up(s_dmask.shape[-1]) - s_dmask.shape[-1], 0, round_up(s_dmask.shape[-2]) - s_dmask.shape[-2])
    return out, lse, torch.nn.functional.pad(s_dmask, pad)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """Attention over (batch, seqlen, heads, headdim) tensors, as ``flash_attn.flash_attn_func``.

    k and v may have fewer heads than q (GQA/MQA: their count must divide q's). ``causal`` is
    aligned to the bottom-right corner when seqlen_q != seqlen_k; ``window_size=(left, right)``
    limits query i to keys [i + sk - sq - left, i + sk - sq + right] (-1 = unbounded; as in
    flash-attn's kernels, a side of seqlen_k or more is unbounded and a left-only window is bounded
    on the right at seqlen_k: docs/python.md). With ``causal=True`` the right bound is 0 whatever
    ``right`` says and the left bound stays, as in flash-attn. ``alibi_slopes`` (float32,
    (heads,) or (batch, heads), on q's device) adds
    ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scaled (soft-capped) score, as flash-attn;
    in its causal form softmax_lse carries ``slope * (i + seqlen_k - seqlen_q)`` as flash-attn's
    does (docs/python.md).

    Returns out (batch, seqlen_q, heads, headdim_v); with ``return_attn_probs=True`` returns
    (out, softmax_lse, S_dmask), softmax_lse being (batch, heads, seqlen_q) float32 (+inf on rows
    that see no key) and S_dmask flash-attn's testing aid: empty without dropout, else each key's
    weight with the sign bit set where dropout dropped it (``_finish``). fp32 inputs are
    exact unless ``torch.get_float32_matmul_precision()`` is "high" or "medium" (or
    ``torch.backends.cuda.matmul.allow_tf32``), which selects the TF32 fast mode on the GPU.
    """
    p = _dropout(dropout_p)
    left, right = _flash_window(window_size, causal, k.shape[1] if isinstance(k, Tensor) and k.dim() == 4 else None)
    q, k, v = _autocast(q, k, v)
    q, scale = _scaled_query(q, softmax_scale, "softmax_scale")
    cap = _softcap(softcap)
    rng = _dropout_rng(q, p) if p else None
    out, lse = _attention(q, k, v, None, None, 0, 0, scale, bool(causal), left, right, cap, bool(deterministic),
                          alibi_slopes, p, rng)
    if not return_attn_probs:
        return out
    mask = (rng, p, q.shape[0], q.shape[2], q.shape[1], k.shape[1]) if p > 0.0 and q.dim() == 4 else None
    options = (scale, bool(causal), left, right, cap, False, alibi_slopes)
    return _finish(out, lse, return_attn_probs, mask,
                   lambda: _attention_probs(q, k, v.shape[-1], None, None, 0, 0, options))


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None, *,
                           seqused_k: Optional[Tensor] = None):
    """Attention over a variable-length batch, as ``flash_attn.flash_attn_varlen_func``.

    q is (total_q, heads, headdim), k and v (total_k, heads_kv, headdim); sequence b holds rows
    [cu_seqlens[b], cu_seqlens[b + 1]) (int32, batch + 1 entries, on the tensors' device).
    max_seqlen_q/k bound every sequence's length. ``causal`` and ``window_size`` act within each
    sequence as in ``flash_attn_func``, max_seqlen_k taking seqlen_k's place in flash-attn's reading
    of the window. With ``return_attn_probs=True`` returns
    (out, softmax_lse, S_dmask), softmax_lse being (heads, total_q) float32 and S_dmask as in
    ``flash_attn_func``.

    ``block_table`` (batch, max_pages) int32 makes k and v paged caches (num_pages, page_size,
    heads_kv, headdim): the keys of sequence b are its cu_seqlens_k length of rows through its row
    of pages (chunked prefill). ``seqused_k`` (batch,) int32 uses only the first seqused_k[b] keys
    of sequence b. Where gradients are wanted, such a call gathers the keys it reads into a plain
    variable-length batch first (flash-attn's backward does not take these arguments), and the
    gradients of k and v are those of the cache tensors; so does a call with dropout.
    """
    p = _dropout(dropout_p)
    left, right = _flash_window(window_size, causal, _int64(max_seqlen_k, "max_seqlen_k"))
    if block_table is not None or seqused_k is not None:
        from .kvcache import cache_varlen_forward, gathered_keys  # noqa: PLC0415
        if p > 0.0 or torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v)):
            # Gradients or dropout: the keys read, gathered into a plain variable-length batch (whose
            # gradient adds into the caches), through the path below.
            k, v, cu_seqlens_k = gathered_keys(k, v, cu_seqlens_k, seqused_k, block_table)
        else:
            q, scale = _scaled_query(q, softmax_scale, "softmax_scale")
            out, lse = cache_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, _int64(max_seqlen_q, "max_seqlen_q"),
                                            _int64(max_seqlen_k, "max_seqlen_k"), scale, bool(causal), left, right,
                                            _softcap(softcap), alibi_slopes, seqused_k, block_table)
            return _finish(out, lse, return_attn_probs)
    q, k, v = _autocast(q, k, v)
    q, scale = _scaled_query(q, softmax_scale, "softmax_scale")
    cap = _softcap(softcap)
    rng = _dropout_rng(q, p)
    max_q, max_k = _int64(max_seqlen_q, "max_seqlen_q"), _int64(max_seqlen_k, "max_seqlen_k")
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, bool(causal), left, right, cap,
                          bool(deterministic), alibi_slopes, p, rng)
    mask = (rng, p, cu_seqlens_q.shape[0] - 1, q.shape[1], max_q, max_k) if p > 0.0 and q.dim() == 3 else None
    options = (scale, bool(causal), left, right, cap, False, alibi_slopes)
    return _finish(out, lse, return_attn_probs, mask,
                   lambda: _attention_probs(q, k, v.shape[-1], cu_seqlens_q, cu_seqlens_k, max_q, max_k, options))


def _unpack(packed: Tensor, name: str, count: int, rank: int, dims: str) -> tuple[Tensor, ...]:
    # Views into the packed tensor (its strides carry over, nothing is copied); unbind's gradient
    # stacks the parts' gradients into one tensor of the packed shape.
    if packed.dim() != rank or packed.shape[-3] != count:
        raise InvalidArgumentError(
            f"{name} must have {rank} dimensions {dims} with {count} at dimension {rank - 3}, got "
            f"shape {tuple(packed.shape)}")
    return packed.unbind(rank - 3)


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False):
    """``flash_attn.flash_attn_qkvpacked_func``: q, k and v stacked in one (batch, seqlen, 3, heads,
    headdim) tensor, read in place; the gradient is one tensor of qkv's shape. Options and return
    values as ``flash_attn_func`` (q, k and v share their head count here; GQA needs the kvpacked
    or unpacked forms)."""
    q, k, v = _unpack(qkv, "qkv", 3, 5, "(batch, seqlen, 3, heads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False):
    """``flash_attn.flash_attn_kvpacked_func``: q (batch, seqlen_q, heads, headdim) and k, v stacked
    in one (batch, seqlen_k, 2, heads_kv, headdim) tensor, read in place; heads_kv may divide heads
    (GQA/MQA). Options and return values as ``flash_attn_func``."""
    k, v = _unpack(kv, "kv", 2, 5, "(batch, seqlen_k, 2, heads_kv, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False):
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: a variable-length batch with q, k and v
    stacked in one (total, 3, heads, headdim) tensor, read in place; one ``cu_seqlens`` and
    ``max_seqlen`` serve queries and keys. Options and return values as ``flash_attn_varlen_func``."""
    q, k, v = _unpack(qkv, "qkv", 3, 4, "(total, 3, heads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False):
    """``flash_attn.flash_attn_varlen_kvpacked_func``: q (total_q, heads, headdim) and k, v stacked
    in one (total_k, 2, heads_kv, headdim) tensor, read in place; heads_kv may divide heads (GQA).
    Options and return values as ``flash_attn_varlen_func``."""
    k, v = _unpack(kv, "kv", 2, 4, "(total_k, 2, heads_kv, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def top_left_causal(seqlen_q: int, seqlen_k: int) -> tuple[bool, int, int]:
    """(causal, window_right, keys) that give the top-left aligned causal mask (key j <= query i)
    over the first ``keys`` keys.

    Our causal mask is bottom-right aligned (flash-attn >= 2.1); PyTorch's SDPA aligns it to the
    top-left. For seqlen_q >= seqlen_k a right window of seqlen_q - seqlen_k is the same mask. For
    seqlen_q < seqlen_k no query sees a key from seqlen_q on, and over the first seqlen_q keys the
    mask is the square causal one: the caller drops the keys that no query sees.
    """
    if seqlen_q > seqlen_k:
        return False, seqlen_q - seqlen_k, seqlen_k
    return True, 0, seqlen_q


def _one_batch(named: dict, inner: int) -> tuple[list, tuple]:
    """The tensors with their leading dimensions (all but the last ``inner``) broadcast together
    and flattened into one, as torch.matmul and SDPA read them, and the broadcast shape to restore.
    A copy where an expanded batch cannot be viewed."""
    try:
        batch = torch.broadcast_shapes(*(t.shape[:-inner] for t in named.values()))
    except RuntimeError:
        shapes = [f"{name} {tuple(t.shape)}" for name, t in named.items()]
        raise InvalidArgumentError(f"the leading dimensions of {', '.join(shapes[:-1])} and {shapes[-1]} do not "
                                   "broadcast") from None
    flat = math.prod(batch)  # explicit: reshape cannot infer it where a tensor is empty
    return [t.expand(*batch, *t.shape[-inner:]).reshape(flat, *t.shape[-inner:]) for t in named.values()], batch


def _sdpa_operands(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool):
    """query, key and value as (batch, heads, seqlen, headdim) tensors, and a function that gives
    the output its shape, as PyTorch's SDPA reads (..., heads, seqlen, headdim): leading dimensions
    broadcast among the three, a 2-D tensor is one head, and key/value heads match the query's,
    broadcast from one, or with ``enable_gqa`` divide them. 4-D tensors of one batch size pass
    unchanged (no copy); a broadcast batch is copied by reshape where it cannot be viewed."""
    ranks = (query.dim(), key.dim(), value.dim())
    if min(ranks) < 2:
        raise InvalidArgumentError(
            "query, key and value must have at least 2 dimensions (..., seqlen, headdim), got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if ranks == (4, 4, 4) and query.shape[0] == key.shape[0] == value.shape[0]:
        heads_q, heads_kv = query.shape[1], key.shape[1]
        if value.shape[1] == heads_kv and (heads_kv in (1, heads_q) or enable_gqa):
            return query, key, value, None
    elif ranks == (3, 3, 3) and query.shape[0] == key.shape[0] == value.shape[0]:
        # Dim 0 read as a batch of one-head problems: PyTorch's (heads, ...) reading, same values, and
        # the output stays contiguous.
        return query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), lambda out: out.squeeze(1)
    query, key, value = (t.unsqueeze(0) if t.dim() == 2 else t for t in (query, key, value))
    heads_q, heads_k, heads_v = query.shape[-3], key.shape[-3], value.shape[-3]
    heads = heads_q
    if not enable_gqa:
        heads = max(heads_q, heads_k, heads_v)  # a single head broadcasts, as a leading dimension does
        if any(h not in (1, heads) for h in (heads_q, heads_k, heads_v)):
            kv = heads_k if heads_k == heads_v else f"{heads_k}/{heads_v}"
            raise InvalidArgumentError(f"query has {heads_q} heads but key/value have {kv}; pass enable_gqa=True for "
                                       "grouped-query attention")
        if heads_k != heads_v or heads_q != heads:  # else one key/value head serves all: MQA, no copy
            key, value = (t.expand(*t.shape[:-3], heads, *t.shape[-2:]) for t in (key, value))
    elif heads_k != heads_v:
        for name, h in (("heads_k", heads_k), ("heads_v", heads_v)):
            if heads_q % h:
                raise InvalidArgumentError(f"{name}={h} must divide heads_q={heads_q} (GQA)")
        key, value = key.repeat_interleave(heads_q // heads_k, -3), value.repeat_interleave(heads_q // heads_v, -3)
    query = query.expand(*query.shape[:-3], heads, *query.shape[-2:])
    (q, k, v), batch = _one_batch(dict(query=query, key=key, value=value), 3)
    rank = max(ranks)

    def finish(out: Tensor) -> Tensor:
        out = out.reshape(*batch, *out.shape[1:])
        return out.squeeze(0) if rank == 2 else out

    return q, k, v, finish


_warned = set()
_ARBITRARY_MASK = ("a call with attn_mask is computed by torch.nn.functional.scaled_dot_product_attention "
                   "(tileattn's kernels take causal masks, windows, ALiBi and variable-length batches, not an "
                   "arbitrary mask)")
_OTHER_OPERANDS = ("a call in float64 (or another dtype than float16, bfloat16 and float32), or with a head dim "
                   f"outside 1..{_ext.max_headdim}, is computed by torch.nn.functional.scaled_dot_product_attention")


def _kernels_take(query: Tensor, value: Tensor) -> bool:
    # Ranks below 2 are refused by the usual rules, with their message.
    return query.dim() < 2 or value.dim() < 2 or (query.dtype in _KERNEL_DTYPES
                                                   and 0 < query.shape[-1] <= _ext.max_headdim
                                                   and 0 < value.shape[-1] <= _ext.max_headdim)


def _torch_operand(t: Tensor) -> Tensor:
    """t, or a contiguous copy of a CUDA tensor whose rows PyTorch's fused kernels may misread: a last
    dimension that is not unit-stride, or a base or stride that is not a whole 16 bytes. Given rows
    padded by a few elements, they returned wrong values and faulted (misaligned address) on an H100."""
    if not t.is_cuda or t.dim() == 0:
        return t
    unit = max(16 // t.element_size(), 1)
    aligned = (t.stride(-1) == 1 or t.shape[-1] <= 1) and all(
        stride % unit == 0 for stride, size in zip(t.stride()[:-1], t.shape[:-1]) if size > 1)
    if aligned and not torch.compiler.is_compiling():  # a traced tensor has no address
        aligned = t.data_ptr() % 16 == 0
    return t if aligned else t.contiguous()


def _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, why=_ARBITRARY_MASK):
    if why not in _warned and not torch.compiler.is_compiling():  # a traced warn() breaks the graph
        _warned.add(why)
        warnings.warn(f"tileattn.scaled_dot_product_attention: {why} (once per process)", stacklevel=3)
    kwargs = dict(enable_gqa=True) if enable_gqa else {}  # the argument is new in PyTorch 2.5
    query, key, value = (_torch_operand(t) for t in (query, key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, **kwargs)


def _check_sdpa_operands(query: Tensor, key: Tensor, value: Tensor) -> None:
    for t, name in ((key, "key"), (value, "value")):
        if t.dtype != query.dtype:
            raise InvalidTypeError(
                f"{name}.dtype={_dtype_name(t.dtype)} must equal query.dtype={_dtype_name(query.dtype)}")
    if key.shape[-1] != query.shape[-1]:
        raise InvalidArgumentError(f"key.shape={tuple(key.shape)} must end in query's head dim {query.shape[-1]} "
                                   f"(query.shape={tuple(query.shape)})")
    if value.shape[-2] != key.shape[-2]:
        raise InvalidArgumentError(f"value.shape={tuple(value.shape)} must have key's sequence length "
                                   f"{key.shape[-2]} at dimension -2 (key.shape={tuple(key.shape)})")


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on (..., heads, seqlen, headdim) tensors.

    4-D (batch, heads, seqlen, headdim) tensors are read in place through their strides (no copy)
    and the result takes the query's layout. As in PyTorch: leading dimensions
    broadcast among the three tensors, a 3-D tensor is (heads, seqlen, headdim) and a 2-D one
    (seqlen, headdim); key/value with one head serve every query head, and with ``enable_gqa`` any
    head count that divides the query's; ``is_causal`` is top-left aligned; ``scale`` may be any
    finite number. A call with ``attn_mask`` is passed to PyTorch's own SDPA (a warning says so,
    once), as is one of a head dim this build has no kernels for. fp32 follows
    ``torch.get_float32_matmul_precision()`` as PyTorch's own kernels do (module docstring).
    """
    if attn_mask is not None:
        if is_causal:
            raise InvalidArgumentError("attn_mask and is_causal=True: pass one mask, not both (as PyTorch's SDPA)")
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    args = (query, key, value, None, dropout_p, is_causal, scale, enable_gqa, _OTHER_OPERANDS)
    if torch.compiler.is_compiling() and not _kernels_take(query, value):  # eager: decided on a refusal
        return _torch_sdpa(*args)
    query, key, value = _autocast(query, key, value)
    p = _dropout(dropout_p)
    q, k, v, finish = _sdpa_operands(query, key, value, enable_gqa)
    q, q_scale = _scaled_query(q, scale, "scale")
    causal, right = False, -1
    if is_causal and q.numel() > 0 and k.numel() > 0:  # an empty problem has no mask to draw
        causal, right, keys = top_left_causal(q.shape[2], k.shape[2])
        k, v = k[:, :, :keys], v[:, :, :keys]
    try:
        out, _ = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, 0, 0,
                            q_scale, causal, -1, right, 0.0, False, None, p, _dropout_rng(q, p))
    except (ValueError, TypeError, NotImplementedError) as error:
        if not _kernels_take(query, value):
            return _torch_sdpa(*args)
        _check_sdpa_operands(query, key, value)  # the rule in SDPA's names and layout, where it is one of these
        if _not_built(error):
            return _torch_sdpa(*args[:-1], why=f"{error}; the call is computed by "
                                                 "torch.nn.functional.scaled_dot_product_attention")
        raise
    out = out.transpose(1, 2)
    return out if finish is None else finish(out)


def softmax_matmul(x: Tensor, v: Tensor) -> Tensor:
    """softmax(x, dim=-1) @ v without materialising softmax(x), differentiable.

    x is (..., d1, d2) and v (..., d2, d3), their leading dimensions broadcast as in
    ``torch.matmul`` (3-D tensors of one batch size are read in place; others are brought to that
    form, with a copy where an expanded batch cannot be viewed); returns (..., d1, d3). A row of x
    that is -inf throughout gives a zero row and zero gradients (torch.softmax gives NaN). fp32
    inputs use the TF32 fast mode on the GPU when ``torch.get_float32_matmul_precision()`` is
    "high" or "medium" (or ``torch.backends.cuda.matmul.allow_tf32``), exact fp32 otherwise.
    """
    if x.dim() < 2 or v.dim() < 2:
        raise InvalidArgumentError(
            f"x and v must have at least 2 dimensions, (..., d1, d2) and (..., d2, d3), got shapes "
            f"{tuple(x.shape)}, {tuple(v.shape)}")
    if x.shape[-1] != v.shape[-2]:
        raise InvalidArgumentError(f"v.shape[-2]={v.shape[-2]} must equal x.shape[-1]={x.shape[-1]} (d2), got shapes "
                                   f"{tuple(x.shape)}, {tuple(v.shape)}")
    if x.dim() == 3 and v.dim() == 3 and x.shape[0] == v.shape[0]:
        finish = None
    else:
        (x, v), batch = _one_batch(dict(x=x, v=v), 2)

        def finish(out: Tensor) -> Tensor:
            return out.reshape(*batch, *out.shape[-2:])
    if x.numel() == 0 or v.numel() == 0:
        # Nothing to run (d2 = 0 gives zeros, as in torch): torch's own ops keep the gradients.
        out = torch.softmax(x, dim=-1) @ v
    else:
        # The library reads rows: a non-contiguous last dimension, or an expanded batch, is copied.
        x, v = (t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 or t.stride(0) == 0 and t.shape[0] > 1
                else t for t in (x, v))
        out = torch.ops.tileattn.softmax_matmul(x, v)
    return out if finish is None else finish(out)
