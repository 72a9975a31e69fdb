"""flash-attn's padding helpers (``flash_attn.bert_padding``): a padded batch (batch, seqlen, ...)
and its mask to the packed (total_tokens, ...) layout of the variable-length functions, and back.

    from tileattn.bert_padding import pad_input, unpad_input
    q, indices, cu_seqlens, max_seqlen, seqused = unpad_input(q_padded, attention_mask)
    out = tileattn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out_padded = pad_input(out, indices, batch, seqlen)

Every function is differentiable: a gather's gradient is scattered back (adding where an index
repeats) and a scatter's is gathered. The functions that build a layout read the mask's lengths on
the host, as flash-attn's do; an index tensor is checked for range when it is on the CPU (a CUDA
one would cost a synchronisation).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor

from .errors import InvalidArgumentError, InvalidTypeError

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]


def _tensor(t, name: str, min_dim: int, dims: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        raise InvalidArgumentError(f"{name} must have at least {min_dim} dimension(s) {dims}, got shape "
                                   f"{tuple(t.shape)}")
    return t


def _count(value, name: str) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidTypeError(f"{name}={value!r} must be an integer") from None
    if n < 0:
        raise InvalidArgumentError(f"{name}={n} must be >= 0")
    return n


def _indices(indices, rows: int, like: Tensor, name: str, what: str) -> Tensor:
    if not isinstance(indices, Tensor):
        raise InvalidTypeError(f"indices must be a torch.Tensor of int64, got {type(indices).__name__}")
    if indices.dim() != 1:
        raise InvalidArgumentError(f"indices must be 1-D (total_nnz,), got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise InvalidTypeError(f"indices.dtype={str(indices.dtype).removeprefix('torch.')} must be int64 or int32")
    if indices.device != like.device:
        raise InvalidArgumentError(f"indices is on {indices.device} but {name} is on {like.device}; all tensors "
                                   "must share one device")
    if indices.device.type == "cpu" and indices.numel() and not torch.compiler.is_compiling():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= rows:
            raise InvalidArgumentError(f"indices must be in [0, {rows}) ({what}), got values "
                                       f"in [{low}, {high}]")
    return indices


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """``input[indices]`` along the first axis: (n, ...) -> (len(indices), ...)."""
    _tensor(input, "input", 1, "(n, ...)")
    return input.index_select(0, _indices(indices, input.shape[0], input, "input", "input.shape[0]"))


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """A (first_axis_dim, ...) tensor of zeros with ``out[indices] = values``; indices must not repeat."""
    _tensor(values, "values", 1, "(total_nnz, ...)")
    return _scatter(values, indices, _count(first_axis_dim, "first_axis_dim"), "values", "first_axis_dim")


def _scatter(values: Tensor, indices: Tensor, rows: int, name: str, what: str) -> Tensor:
    indices = _indices(indices, rows, values, name, what)
    if indices.shape[0] != values.shape[0]:
        raise InvalidArgumentError(f"indices.shape[0]={indices.shape[0]} must equal {name}.shape[0]="
                                   f"{values.shape[0]} (one index a row)")
    return values.new_zeros(rows, *values.shape[1:]).index_copy(0, indices.long(), values)


def _mask(mask, name: str, hidden_states: Tensor) -> Tensor:
    if not isinstance(mask, Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    # A float mask is refused: an additive one (0 = keep, -inf = drop) would be read inverted.
    if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()):
        raise InvalidTypeError(f"{name}.dtype={str(mask.dtype).removeprefix('torch.')} must be bool or an integer "
                               "type (nonzero = a token, 0 = padding)")
    if tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise InvalidArgumentError(f"{name}.shape={tuple(mask.shape)} must be (batch, seqlen)="
                                   f"{tuple(hidden_states.shape[:2])}, the first two dims of hidden_states")
    if mask.device != hidden_states.device:
        raise InvalidArgumentError(f"{name} is on {mask.device} but hidden_states is on {hidden_states.device}")
    return mask if mask.dtype == torch.bool else mask != 0


def _offsets(lengths: Tensor) -> Tensor:
    """cu_seqlens (int32, batch + 1) from per-sequence lengths."""
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states: Tensor, attention_mask: Tensor, unused_mask: Optional[Tensor] = None):
    """The tokens of a padded batch as one variable-length batch.

    hidden_states is (batch, seqlen, ...); attention_mask (batch, seqlen), bool or integer, is
    nonzero at tokens. unused_mask (same form), when given, marks slots that are allocated but
    unused: they are gathered too (after each row's tokens, where they lie) and counted in
    cu_seqlens, but not in the last value returned. Returns

    - hidden_states (total_nnz, ...), the selected rows in row-major order;
    - indices (total_nnz,) int64, their positions in the flattened (batch * seqlen) batch;
    - cu_seqlens (batch + 1,) int32, the offsets of each row's selected tokens;
    - max_seqlen_in_batch, a Python int (0 for an empty batch);
    - used_seqlens_in_batch (batch,) int32, each row's count of attention_mask tokens (flash-attn's
      ``seqused``).
    """
    _tensor(hidden_states, "hidden_states", 2, "(batch, seqlen, ...)")
    used = _mask(attention_mask, "attention_mask", hidden_states)
    mask = used if unused_mask is None else used | _mask(unused_mask, "unused_mask", hidden_states)
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = mask.flatten().nonzero().flatten()
    longest = int(lengths.max()) if lengths.numel() else 0
    rows = hidden_states.flatten(0, 1).index_select(0, indices)
    return rows, indices, _offsets(lengths), longest, used.sum(dim=-1, dtype=torch.int32)


def unpad_input_for_concatenated_sequences(hidden_states: Tensor, attention_mask_in_length: Tensor):
    """unpad_input for rows that each hold several sequences back to back.

    attention_mask_in_length (batch, seqlen), integer: row b's nonzero entries are the lengths of
    the sequences packed at the start of row b of hidden_states, in order (flash-attn's form, e.g.
    ``[[2, 3, 0, 0], [4, 0, 0, 0]]``). Returns (hidden_states (total_nnz, ...), indices, cu_seqlens
    (num_sequences + 1,) int32, max_seqlen_in_batch), with one entry of cu_seqlens per sequence.
    """
    _tensor(hidden_states, "hidden_states", 2, "(batch, seqlen, ...)")
    lengths = attention_mask_in_length
    if not isinstance(lengths, Tensor) or lengths.dtype == torch.bool or lengths.is_floating_point() \
            or lengths.is_complex():
        raise InvalidTypeError("attention_mask_in_length must be an integer tensor (the lengths of each row's "
                               "sequences)")
    _mask(lengths, "attention_mask_in_length", hidden_states)
    seqlen = hidden_states.shape[1]
    used = lengths.sum(dim=-1)
    # One read on the host, which nonzero below needs anyway.
    if lengths.numel() and not bool(((lengths >= 0).all() & (used <= seqlen).all())):
        raise InvalidArgumentError(f"attention_mask_in_length: the lengths must be >= 0 and each row's must sum to "
                                   f"at most seqlen={seqlen}")
    mask = torch.arange(seqlen, device=lengths.device) < used[:, None]
    indices = mask.flatten().nonzero().flatten()
    flat = lengths.flatten()
    seqlens = flat[flat != 0]
    longest = int(seqlens.max()) if seqlens.numel() else 0
    rows = hidden_states.flatten(0, 1).index_select(0, indices)
    return rows, indices, _offsets(seqlens), longest


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of unpad_input: (total_nnz, ...) rows placed at ``indices`` of a zero
    (batch, seqlen, ...) tensor."""
    _tensor(hidden_states, "hidden_states", 1, "(total_nnz, ...)")
    batch, seqlen = _count(batch, "batch"), _count(seqlen, "seqlen")
    out = _scatter(hidden_states, indices, batch * seqlen, "hidden_states", "batch * seqlen")
    return out.view(batch, seqlen, *out.shape[1:])
