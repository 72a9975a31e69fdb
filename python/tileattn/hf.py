"""Hugging Face transformers integration: tileattn as an attention implementation.

    import tileattn.hf
    tileattn.hf.register()                       # once, registers the name "tileattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tileattn")

Causal masking is done by the kernel (bottom-right aligned, which is also what a KV cache needs
when fewer queries than keys are processed), so no mask tensor is built. The three batch forms of
transformers' own flash-attention path are served:

- a padded batch (a 2-D ``attention_mask`` with zeros): the real tokens are gathered into one
  variable-length batch, attended with ``flash_attn_varlen_func`` and scattered back; padded
  positions of the output are zeros. As in transformers, fewer queries than keys (decoding with a
  cache) assume left padding: the queries are the last tokens of each row. In cross-attention
  (a decoder attending to an encoder) the mask is the keys' alone: every query row attends to the
  real keys of its row. A static cache's unfilled slots are left out the same way, whether or not
  the batch is padded.
- packed sequences (rows holding several sequences, from ``DataCollatorWithFlattening``): the
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments, or else ``position_ids`` that
  restart at each sequence (in any row of the batch), give the boundaries, and no token attends
  across one.
- everything else: one ``flash_attn_func`` call.

Attention dropout (``attention_dropout`` of the config, in training mode) is applied with the
library's dropout (flash-attn's semantics). A sliding window is transformers' flash one:
``sliding_window - 1`` keys on each side (causal: the left side only). What the kernels cannot
apply -- attention sinks (``s_aux``), an additive ``position_bias``, a 4-D mask -- is refused with
``NotImplementedError`` rather than left out.

Under ``torch.compile`` (``fullgraph=True`` included) nothing reads a tensor's values on the host:
a padding mask is kept even when it is all ones, the padded batch is laid out with static shapes
(each row's real tokens, then each row's padding as a sequence of its own, whose outputs are
zeroed), a static cache's filled length stays a tensor in the graph, and the queries of a cache
step are the slots that end at each row's last real key (left padding's last columns, as above).
Packing marked by ``position_ids`` alone cannot be laid out there: a graph that meets it raises when
it runs (on a GPU, a device-side assertion); pass the flash keyword arguments instead.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from .bert_padding import _offsets, index_first_axis, pad_input, unpad_input
from .functional import flash_attn_func, flash_attn_varlen_func

__all__ = ["attention_forward", "register"]

NAME = "tileattn"


def _padded(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, masks_queries: bool, **options) -> Tensor:
    batch, seqlen_q = query.shape[:2]
    mask = mask.bool()
    if key.shape[1] > mask.shape[1]:
        # A static cache holds more key slots than the mask has seen; the rest are unused.
        key, value = key[:, :mask.shape[1]], value[:, :mask.shape[1]]
    k, indices_k, cu_k, max_k, _ = unpad_input(key, mask)
    v = index_first_axis(value.reshape(-1, *value.shape[2:]), indices_k)
    if not masks_queries:
        # The mask is the keys' alone (cross-attention): every query row attends to its row's keys.
        q = query.reshape(-1, *query.shape[2:])
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=query.device)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqlen_q, max_k, **options)
        return out.view(batch, seqlen_q, *out.shape[1:])
    # Fewer queries than keys (a cache): the queries are the last positions of each row.
    q, indices_q, cu_q, max_q, _ = unpad_input(query, mask[:, -seqlen_q:])
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    return pad_input(out, indices_q, batch, seqlen_q)


def _real_first(mask: Tensor):
    """unpad_input's layout with static shapes (traceable): for the flattened (batch, seqlen) mask,
    the order that puts every row's real tokens first (as unpad_input), then each row's padding; its
    inverse; and cu_seqlens (2 * batch + 1): one sequence of real tokens per row, then one of
    padding per row."""
    flat = mask.flatten()
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    real, padding = flat.cumsum(0), flat.logical_not().cumsum(0)
    dest = torch.where(flat, real - 1, flat.sum() + padding - 1)
    order = torch.zeros_like(dest).scatter(0, dest, torch.arange(dest.shape[0], device=dest.device))
    return order, dest, _offsets(torch.cat([lengths, mask.shape[1] - lengths]))


def _trailing_queries(mask: Tensor, seqlen_q: int) -> Tensor:
    """Which of seqlen_q queries (fewer than the keys) are real: the queries are the seqlen_q slots
    ending at each row's last real key. With left padding that is _padded's last columns; traced,
    a static cache's mask covers its unfilled slots too, and they are passed over."""
    slots = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    end = torch.where(mask, slots, 0).amax(dim=-1, keepdim=True)
    q_slots = end - seqlen_q + torch.arange(seqlen_q, device=mask.device)
    return (q_slots >= 0) & mask.gather(1, q_slots.clamp(min=0))


def _padded_traceable(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, masks_queries: bool,
                      **options) -> Tensor:
    """_padded under torch.compile: nonzero and the longest length would be data-dependent shapes.
    The padding rides along as sequences of its own (each query of one sees a key of it, so all
    stay finite) and max_seqlen is the padded length, which bounds every sequence."""
    batch, seqlen_q = query.shape[:2]
    mask = mask.bool()
    if key.shape[1] > mask.shape[1]:
        key, value = key[:, :mask.shape[1]], value[:, :mask.shape[1]]
    seqlen_k = mask.shape[1]
    order_k, _, cu_k = _real_first(mask)
    k, v = (x.reshape(-1, *x.shape[2:]).index_select(0, order_k) for x in (key, value))
    if not masks_queries:
        # Every query row is real; the padding sequences hold keys only.
        q = query.reshape(-1, *query.shape[2:])
        rows = torch.arange(2 * batch + 1, device=query.device).clamp(max=batch)
        out = flash_attn_varlen_func(q, k, v, (rows * seqlen_q).to(torch.int32), cu_k, seqlen_q, seqlen_k, **options)
        return out.view(batch, seqlen_q, *out.shape[1:])
    q_mask = mask if seqlen_q == seqlen_k else _trailing_queries(mask, seqlen_q)
    order_q, dest_q, cu_q = _real_first(q_mask)
    q = query.reshape(-1, *query.shape[2:]).index_select(0, order_q)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, **options).index_select(0, dest_q)
    out = torch.where(q_mask.reshape(-1, 1, 1), out, 0)  # zeros at padding, as _padded
    return out.view(batch, seqlen_q, *out.shape[1:])


_PACKED_UNDER_COMPILE = ("tileattn.hf: position_ids restart inside a row (packed sequences) in a torch.compile "
                         "graph, where they cannot steer the layout; pass cu_seq_lens_q/k and max_length_q/k "
                         "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))")


def _packed_boundaries(position_ids: Optional[Tensor], batch: int, seqlen: int):
    """cu_seqlens over the flattened batch and the longest length when position_ids restart inside
    a row (the flattening collator's output; transformers reads any batch so); None for ordinary
    rows."""
    if position_ids is None or seqlen == 1 or position_ids.shape[-1] != seqlen:
        return None
    positions = position_ids.expand(batch, seqlen)
    steps = positions.diff(dim=-1) == 1
    if torch.compiler.is_compiling():
        # The number of sequences would be a data-dependent shape: packing is refused when the
        # graph runs rather than attended as one sequence (module docstring).
        torch._assert_async(steps.all(), _PACKED_UNDER_COMPILE)
        return None
    if bool(steps.all()):
        return None
    # A sequence starts at each row's first token and wherever the position does not step by one.
    starts = torch.cat([steps.new_zeros(batch, 1), steps], dim=-1).logical_not().flatten()
    cu = torch.cat([starts.nonzero().flatten(), starts.new_tensor([batch * seqlen], dtype=torch.int64)])
    cu = cu.to(torch.int32)
    return cu, int(cu.diff().max())


def _packed(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
            **options) -> Tensor:
    batch, seqlen_q = query.shape[:2]
    q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (query, key, value))
    if torch.compiler.is_compiling():
        # A tensor's value can't be read while tracing; the flattened lengths bound every sequence.
        max_q = q.shape[0] if isinstance(max_q, Tensor) else max_q
        max_k = k.shape[0] if isinstance(max_k, Tensor) else max_k
    else:
        max_q, max_k = int(max_q), int(max_k)
    cu_q, cu_k = (cu.to(device=q.device, dtype=torch.int32) for cu in (cu_q, cu_k))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    return out.view(batch, seqlen_q, *out.shape[1:])


_warned = {"output_attentions": False}

# Arguments of transformers' attention functions that change the scores; the kernels take neither.
_NOT_APPLIED = {"s_aux": "attention sinks", "position_bias": "an additive position bias"}


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function contract: (batch, heads, seqlen, headdim) in,
    (attn_output (batch, seqlen, heads, headdim), attn_weights=None) out. ``attention_mask`` is
    the 2-D padding mask (batch, kv_length) this module's mask function hands over, or None."""
    if kwargs.get("output_attentions") and not _warned["output_attentions"]:
        _warned["output_attentions"] = True  # as transformers' sdpa function: said once
        warnings.warn("tileattn does not return attention weights (output_attentions=True): the kernels never form "
                      "them; use attn_implementation='eager' for those", stacklevel=2)
    for name in _NOT_APPLIED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}: {_NOT_APPLIED[name]} is not supported by tileattn's kernels; use "
                                      "attn_implementation='sdpa' or 'eager' for this model")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    left = right = -1
    if sliding_window is not None:
        # transformers' flash window: sliding_window - 1 keys on each side (causal drops the right).
        left = right = sliding_window - 1
    options = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=bool(causal), window_size=(left, right),
                   softcap=softcap or 0.0)
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise NotImplementedError(f"attention_mask of shape {tuple(attention_mask.shape)}: this integration takes "
                                      "the 2-D padding mask (batch, kv_length) that its mask function returns")
        # Cross-attention's mask is the encoder's: it says nothing of the queries.
        cross = not causal and (getattr(module, "is_cross_attention", False) or getattr(module, "is_decoder", False)
                                or attention_mask.shape[1] != query.shape[1])
        padded = _padded_traceable if torch.compiler.is_compiling() else _padded
        return padded(query, key, value, attention_mask, not cross, **options), None
    boundaries = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(b is not None for b in boundaries):
        return _packed(query, key, value, *boundaries, **options), None
    packed = _packed_boundaries(kwargs.get("position_ids"), query.shape[0], query.shape[1])
    if packed is not None and query.shape[1] == key.shape[1]:
        cu, longest = packed
        return _packed(query, key, value, cu, cu, longest, longest, **options), None
    return flash_attn_func(query, key, value, **options), None


def _causal_pattern(mask_function) -> bool:
    """Whether transformers' mask function hides key 1 from query 0, as every causal pattern does
    (plain, sliding, chunked) and a bidirectional one does not."""
    zero, one = torch.tensor(0), torch.tensor(1)
    return not bool(mask_function(zero, zero, zero, one))


def _unfilled_traceable(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, device):
    """_padding_mask's cache-slot mask under torch.compile: a static cache's offset is a tensor and
    transformers' combined mask functions answer with tensors, so neither can steer Python; the
    mask of filled slots (all of them where the pattern is not causal) is built in the graph."""
    if mask_function is None:
        return None
    filled = q_offset + q_length - kv_offset
    if not isinstance(filled, Tensor) and filled >= kv_length:
        return None  # no cache, or one that grows: every key is real
    zero = torch.zeros((), dtype=torch.long, device=device)
    not_causal = mask_function(zero, zero, zero, zero + 1)
    visible = (torch.arange(kv_length, device=device) < filled) | not_causal
    return visible.expand(batch_size, kv_length)


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                  device=None, **kwargs):
    # The kernel masks causally by itself: a mask is handed over only when there is padding, and
    # then as the 2-D (batch, kv_length) padding mask that attention_forward unpads with.
    if attention_mask is None:
        if torch.compiler.is_compiling():
            return _unfilled_traceable(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, device)
        # A static cache has more key slots than tokens seen, and generate() drops an all-ones mask:
        # a mask of the filled length tells attention_forward to leave the rest out. Only causal
        # self-attention has a cache to fill (cross-attention's keys, also longer than its queries,
        # are all real). A static cache's offset is a tensor, read here once per forward (the model
        # builds each mask once for all its layers).
        if mask_function is not None and _causal_pattern(mask_function):
            filled = int(q_offset) + q_length - kv_offset
            if filled < kv_length:
                return torch.ones(batch_size, filled, dtype=torch.bool, device=device)
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if torch.compiler.is_compiling():
        return attention_mask  # all ones or not can't steer a trace; the padded path is exact either way
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register(name: str = NAME) -> str:
    """Registers tileattn with transformers' AttentionInterface (and a mask function that builds no
    mask, only passing a padding mask on) under `name`; returns the name to pass as
    attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        # Versions before the mask interface build a 4-D mask tensor, which attention_forward refuses.
        return name
    AttentionMaskInterface.register(name, _padding_mask)
    return name
