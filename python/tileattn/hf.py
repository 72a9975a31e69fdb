"""Hugging Face transformers integration: tileattn as an attention implementation.

    import tileattn.hf
    tileattn.hf.register()                       # once, registers the name "tileattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tileattn")

Causal masking is done by the kernel (bottom-right aligned, which is also what a KV cache needs
when fewer queries than keys are processed), so no mask tensor is built. Padding masks, dropout
and packed sequences raise NotImplementedError instead of being ignored.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .functional import flash_attn_func

__all__ = ["attention_forward", "register"]

NAME = "tileattn"


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function contract: (batch, heads, seqlen, headdim) in,
    (attn_output (batch, seqlen, heads, headdim), attn_weights=None) out."""
    if attention_mask is not None:
        raise NotImplementedError("attention_mask: tileattn's transformers integration does not take mask tensors "
                                  "(padded batches need flash_attn_varlen_func)")
    if dropout != 0.0:
        raise NotImplementedError(f"dropout={dropout}: tileattn has no attention dropout (use model.eval() or "
                                  "attention_dropout=0)")
    for packed in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(packed) is not None:
            raise NotImplementedError(f"{packed}: packed sequences are not supported by this integration")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    left = -1
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError("sliding_window without a causal mask is not supported by this integration")
        left = sliding_window - 1  # transformers: query i sees keys i - sliding_window < j <= i
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling,
                          causal=bool(causal), window_size=(left, -1), softcap=softcap or 0.0)
    return out, None


def _no_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             **kwargs):
    # The kernel masks causally by itself; a padding mask cannot be honoured, so it is refused.
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("attention_mask with padding: tileattn's transformers integration needs unpadded "
                                  "batches")
    return None


def register(name: str = NAME) -> str:
    """Registers tileattn with transformers' AttentionInterface (and a mask function that builds no
    mask) under `name`; returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        # Versions before the mask interface build a mask tensor, which attention_forward refuses.
        return name
    AttentionMaskInterface.register(name, _no_mask)
    return name
