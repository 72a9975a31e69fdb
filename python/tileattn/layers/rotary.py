"""flash-attn's rotary embedding (``flash_attn.layers.rotary``) in PyTorch operations.

The first rotary_dim = 2 * cos.shape[-1] features of each head are turned in pairs and the rest
pass through: pair i is (i, i + rotary_dim / 2) (GPT-NeoX, the default) or, with
``interleaved=True``, (2i, 2i + 1) (GPT-J). A token at position p turns pair i by the angle whose
cosine and sine are cos[p, i] and sin[p, i]; p is the token's place in its sequence plus
``seqlen_offsets`` (an int, or a tensor of one per sequence: a cache's filled lengths). The tables
are rounded to x's dtype and the arithmetic is float32 (float64 for float64 x), rounded once, as
flash-attn's kernel computes it. This is also the rotation ``flash_attn_with_kvcache`` applies
with ``rotary_cos``/``rotary_sin``.

Everything is differentiable, in x and in the tables (flash-attn's gradient is x's alone). With
``inplace=True`` (and in the ``*_`` functions, which always work in place) x is written through
PyTorch's in-place operations, so autograd's rules for them hold: a leaf that requires grad must
be cloned first.

Positions outside the table are refused: an int offset at once, offset tensors and ``cu_seqlens``
where reading them costs no synchronisation (on the CPU) or under ``tileattn.check_cu_seqlens()``.
Unchecked, a token whose position falls outside [0, cos.shape[0]) is left as it is, as
flash-attn's kernel leaves it; so is a token of x that no sequence of ``cu_seqlens`` covers
(flash-attn leaves that output unset).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .._ops import _checks
from ..bert_padding import _count
from ..errors import InvalidArgumentError, InvalidTypeError

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_"]

Offsets = Union[int, Tensor]


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def _int(value, name: str) -> int:
    if torch.compiler.is_compiling():
        return value  # a symbolic int stays symbolic
    return _count(value, name)


def _checked(t: Tensor) -> bool:
    """Whether t's values may be read on the host: always on the CPU, on request on a GPU."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    return _checks["cu_seqlens"] and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _tables(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[int, int]:
    for t, name in ((cos, "cos"), (sin, "sin")):
        if not isinstance(t, Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise InvalidArgumentError(f"{name} must be 2-D (seqlen_ro, rotary_dim / 2), got shape {_shape(t)}")
        if not t.is_floating_point():
            raise InvalidTypeError(f"{name}.dtype={_dtype(t)} must be a floating type")
        if t.device != x.device:
            raise InvalidArgumentError(f"{name} is on {t.device} but x is on {x.device}; all tensors must share "
                                       "one device")
    if sin.shape != cos.shape:
        raise InvalidArgumentError(f"sin.shape={_shape(sin)} must equal cos.shape={_shape(cos)}")
    rows, half = cos.shape
    if 2 * half > x.shape[-1]:
        raise InvalidArgumentError(f"rotary_dim=2 * cos.shape[1]={2 * half} must be at most headdim=x.shape[-1]="
                                   f"{x.shape[-1]}")
    return rows, half


def _offset_tensor(offsets: Tensor, batch: int, x: Tensor) -> Tensor:
    if offsets.dtype not in (torch.int32, torch.int64):
        raise InvalidTypeError(f"seqlen_offsets.dtype={_dtype(offsets)} must be int32 or int64")
    if tuple(offsets.shape) != (batch,):
        raise InvalidArgumentError(f"seqlen_offsets.shape={_shape(offsets)} must be (batch,)=({batch},), or "
                                   "seqlen_offsets an int")
    if offsets.device != x.device:
        raise InvalidArgumentError(f"seqlen_offsets is on {offsets.device} but x is on {x.device}")
    return offsets.long()


def _check_ends(offsets: Tensor, lengths, rows: int) -> None:
    """Every sequence's positions offsets[b] + [0, lengths[b]) within the table of `rows`."""
    if offsets.numel() and not bool(((offsets >= 0) & (offsets + lengths <= rows)).all()):
        raise InvalidArgumentError(
            f"seqlen_offsets must be >= 0 and seqlen_offsets[b] + sequence b's length at most cos.shape[0]={rows} "
            f"(the rotary table's length), got offsets in [{int(offsets.min())}, {int(offsets.max())}]")


def _lookup(cos: Tensor, sin: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """The table rows at positions pos; a position outside the table reads cos 1, sin 0 (no turn)."""
    rows, half = cos.shape
    if rows == 0:
        return cos.new_ones(*pos.shape, half), sin.new_zeros(*pos.shape, half)
    inside = ((pos >= 0) & (pos < rows))[..., None]
    index = pos.clamp(0, rows - 1)
    return torch.where(inside, cos[index], 1.0), torch.where(inside, sin[index], 0.0)


def _batch_angles(x: Tensor, cos: Tensor, sin: Tensor, offsets: Offsets) -> tuple[Tensor, Tensor]:
    """cos, sin per token of x (batch, seqlen, heads, d), shaped to broadcast over the heads."""
    batch, seqlen = x.shape[:2]
    rows = cos.shape[0]
    if isinstance(offsets, Tensor):
        offsets = _offset_tensor(offsets, batch, x)
        if _checked(offsets):
            _check_ends(offsets, seqlen, rows)
        c, s = _lookup(cos, sin, offsets[:, None] + torch.arange(seqlen, device=x.device))
        return c[:, :, None], s[:, :, None]
    start = _int(offsets, "seqlen_offsets")
    if not torch.compiler.is_compiling() and start + seqlen > rows:
        raise InvalidArgumentError(f"seqlen_offsets + seqlen = {start} + {seqlen} must be at most cos.shape[0]={rows} "
                                   "(the rotary table's length)")
    return cos[start:start + seqlen, None], sin[start:start + seqlen, None]


def _varlen_angles(x: Tensor, cos: Tensor, sin: Tensor, offsets: Offsets, cu_seqlens, max_seqlen):
    """cos, sin per token of x (total_tokens, heads, d) packed as cu_seqlens says."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise InvalidArgumentError(f"cu_seqlens must be a 1-D tensor (batch + 1,) of offsets, got {_shape(cu_seqlens)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise InvalidTypeError(f"cu_seqlens.dtype={_dtype(cu_seqlens)} must be int32 or int64")
    if cu_seqlens.device != x.device:
        raise InvalidArgumentError(f"cu_seqlens is on {cu_seqlens.device} but x is on {x.device}")
    if max_seqlen is None:
        raise InvalidArgumentError("max_seqlen is needed with cu_seqlens (the longest sequence's length)")
    longest = _int(max_seqlen, "max_seqlen")
    batch, total, rows = cu_seqlens.shape[0] - 1, x.shape[0], cos.shape[0]
    tensor_offsets = isinstance(offsets, Tensor)
    start = 0 if tensor_offsets else _int(offsets, "seqlen_offsets")
    if not torch.compiler.is_compiling() and start + longest > rows:
        raise InvalidArgumentError(f"seqlen_offsets + max_seqlen = {start} + {longest} must be at most "
                                   f"cos.shape[0]={rows} (the rotary table's length)")
    cu = cu_seqlens.long()
    lengths = cu.diff()
    if _checked(cu) and batch and not bool((cu[0] >= 0) & (lengths >= 0).all() & (cu[-1] <= total)
                                           & (lengths <= longest).all()):
        raise InvalidArgumentError(
            f"cu_seqlens must rise from >= 0 to at most x.shape[0]={total}, each step (a sequence's length) at most "
            f"max_seqlen={longest}; got cu_seqlens[0]={int(cu[0])}, cu_seqlens[-1]={int(cu[-1])} and steps in "
            f"[{int(lengths.min())}, {int(lengths.max())}]")
    if tensor_offsets:
        offsets = _offset_tensor(offsets, batch, x)
        if _checked(offsets):
            _check_ends(offsets, lengths, rows)
    # Sequence `seq` of each token (batch past the last one) and its place in it.
    token = torch.arange(total, device=x.device)
    seq = torch.searchsorted(cu[1:], token, right=True)
    place = token - cu[seq]
    if tensor_offsets:
        place = place + torch.nn.functional.pad(offsets, (0, 1))[seq]
    else:
        place = place + start
    outside = (seq == batch) | (token < cu[0])
    c, s = _lookup(cos, sin, place.masked_fill(outside, -1))
    return c[:, None], s[:, None]


def _turn(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    half = cos.shape[-1]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: Offsets = 0, cu_seqlens: Optional[Tensor] = None,
                     max_seqlen: Optional[int] = None) -> Tensor:
    """x (batch, seqlen, heads, headdim), or (total_tokens, heads, headdim) with ``cu_seqlens``
    (batch + 1,) and ``max_seqlen``, with its first rotary_dim features rotated; cos, sin
    (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim. ``seqlen_offsets``: an int, or int32/int64
    (batch,), added to each sequence's positions. Returns a new tensor, or x itself written in
    place with ``inplace=True``."""
    varlen = cu_seqlens is not None
    if not isinstance(x, Tensor) or x.dim() != (3 if varlen else 4):
        dims = "3 dimensions (total_tokens, heads, headdim) with cu_seqlens" if varlen else \
            "4 dimensions (batch, seqlen, heads, headdim)"
        raise InvalidArgumentError(f"x must have {dims}, got {_shape(x)}")
    if not x.is_floating_point():
        raise InvalidTypeError(f"x.dtype={_dtype(x)} must be a floating type")
    _, half = _tables(x, cos, sin)
    if varlen:
        c, s = _varlen_angles(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    else:
        c, s = _batch_angles(x, cos, sin, seqlen_offsets)
    compute = torch.promote_types(x.dtype, torch.float32)
    c, s = (t.to(x.dtype).to(compute) for t in (c, s))
    head = x[..., :2 * half]
    turned = _turn(head.to(compute), c, s, bool(interleaved)).to(x.dtype)
    if inplace:
        head.copy_(turned)
        return x
    return turned if 2 * half == x.shape[-1] else torch.cat((turned, x[..., 2 * half:]), dim=-1)


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's older name


def apply_rotary_emb_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Optional[Tensor] = None,
                          sin_k: Optional[Tensor] = None, interleaved: bool = False, seqlen_offsets: Offsets = 0,
                          num_heads_q: Optional[int] = None) -> Tensor:
    """Rotates q and k of a packed qkv in place and returns qkv: (batch, seqlen, 3, heads, headdim),
    or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with ``num_heads_q`` (GQA/MQA). k
    uses ``cos_k``/``sin_k`` when given (XPos), else cos/sin."""
    if not isinstance(qkv, Tensor) or qkv.dim() not in (4, 5):
        raise InvalidArgumentError(f"qkv must be (batch, seqlen, 3, heads, headdim) or (batch, seqlen, "
                                   f"num_heads_q + 2 * num_heads_k, headdim), got {_shape(qkv)}")
    if (cos_k is None) != (sin_k is None):
        raise InvalidArgumentError("cos_k and sin_k must be given together")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise InvalidArgumentError(f"qkv.shape[2]={qkv.shape[2]} must be 3 (q, k, v)")
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None:
            raise InvalidArgumentError("num_heads_q is needed for a 4-D qkv (batch, seqlen, num_heads_q + 2 * "
                                       "num_heads_k, headdim)")
        heads_q = _int(num_heads_q, "num_heads_q")
        heads_k = (qkv.shape[2] - heads_q) // 2
        if heads_q == 0 or heads_k < 0 or heads_q + 2 * heads_k != qkv.shape[2]:
            raise InvalidArgumentError(f"qkv.shape[2]={qkv.shape[2]} must be num_heads_q + 2 * num_heads_k with "
                                       f"num_heads_q={num_heads_q} > 0")
        q, k = qkv[:, :, :heads_q], qkv[:, :, heads_q:heads_q + heads_k]
    apply_rotary_emb(q, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    apply_rotary_emb(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved, inplace=True,
                     seqlen_offsets=seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                         seqlen_offsets: Offsets = 0) -> Tensor:
    """Rotates k of a packed kv (batch, seqlen, 2, heads, headdim) in place and returns kv."""
    if not isinstance(kv, Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise InvalidArgumentError(f"kv must be (batch, seqlen, 2, heads, headdim), got {_shape(kv)}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's rotary module (RoFormer): pair i of the first ``dim`` features turns by
    position * base ** (-2i / dim). The cos/sin tables are built for the longest position asked for
    and kept (in the inputs' dtype and device). With ``scale_base`` it is XPos: q's pairs are also
    scaled by zeta_i ** ((p - n // 2) / scale_base) and k's by the inverse, zeta_i =
    (2i + 0.4 dim) / (1.4 dim), n the table's length, so that q . k decays with the distance.

    ``forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None)`` rotates in place
    and returns qkv (see apply_rotary_emb_qkv_), or with ``kv`` q (batch, seqlen, heads, headdim)
    and kv, returning (q, kv). A tensor ``seqlen_offset`` needs ``max_seqlen`` to cover
    offset + seqlen (the table is built to max_seqlen).

    ``pos_idx_in_fp32`` (default True) builds the angles from float32 positions and frequencies
    (recomputed if the module was cast to half precision); False builds them in the ``inv_freq``
    buffer's dtype, as flash-attn does for models trained that way (positions past 256 are then
    rounded in bf16)."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: Optional[float] = None,
                 pos_idx_in_fp32: bool = True, device=None):
        super().__init__()
        dim = _int(dim, "dim")
        if dim == 0 or dim % 2:
            raise InvalidArgumentError(f"dim={dim} must be even and > 0 (the rotary_dim: features turned in pairs)")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.pos_idx_in_fp32 = bool(pos_idx_in_fp32)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = None if scale_base is None else self._zeta(device, torch.float32)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device, dtype) -> Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=dtype) / self.dim)

    def _compute_inv_freq(self, device=None) -> Tensor:  # flash-attn's name: its modules' subclasses call it
        return self._inv_freq(device, torch.float32)

    def _zeta(self, device, dtype) -> Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=dtype) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        cached = self._cos_cached
        if (cached is not None and seqlen <= self._seq_len_cached and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # Angles in float32 at least: positions and their products lose too much in half precision,
        # so a buffer cast down by module.half() is recomputed (unless asked for, as flash-attn).
        inv_freq = self.inv_freq
        if self.pos_idx_in_fp32:
            compute = torch.promote_types(dtype, torch.float32)
            if inv_freq.dtype != compute or inv_freq.device != device:
                inv_freq = self._inv_freq(device, compute)
        else:
            compute = inv_freq.dtype
            inv_freq = inv_freq.to(device)
        positions = torch.arange(seqlen, device=device, dtype=compute)
        angles = torch.outer(positions, inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self._zeta(device, compute) ** ((positions - seqlen // 2) / self.scale_base)[:, None]
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: Tensor, kv: Optional[Tensor] = None, seqlen_offset: Offsets = 0,
                max_seqlen: Optional[int] = None, num_heads_q: Optional[int] = None):
        if not isinstance(qkv, Tensor):
            raise InvalidTypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            length = _int(max_seqlen, "max_seqlen")
        elif isinstance(seqlen_offset, Tensor):
            length = seqlen  # the offsets are not read on the host
        else:
            length = seqlen + _int(seqlen_offset, "seqlen_offset")
        self._update_cos_sin_cache(length, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k if xpos else None,
                                         sin_k if xpos else None, self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)
