"""FlashAttentionFunction: the (batch, seqlen, headdim) autograd function on tileattn's kernels.

Same contract as ``tileattn.reference.FlashAttentionPytorch``: softmax(Q K^T / sqrt(d)) V with an
optional top-left aligned causal mask, saving only Q, K, V, O and L = logsumexp of the scaled
scores, shaped (batch, seqlen_q).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import InvalidArgumentError
from . import _ops  # noqa: F401  (registers torch.ops.tileattn.*)
from .functional import top_left_causal

__all__ = ["FlashAttentionFunction"]


def _check_3d(t: Tensor, name: str) -> None:
    if t.dim() != 3:
        raise InvalidArgumentError(
            f"{name} must have 3 dimensions (batch, seqlen, headdim), got shape {tuple(t.shape)}")


def _mask(Q: Tensor, K: Tensor, is_causal: bool) -> tuple[bool, int, int]:
    return top_left_causal(Q.shape[1], K.shape[1]) if is_causal else (False, -1, K.shape[1])


class FlashAttentionFunction(torch.autograd.Function):
    """``FlashAttentionFunction.apply(Q, K, V, is_causal)`` for (batch, seqlen, headdim) tensors."""

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        for t, name in ((Q, "Q"), (K, "K"), (V, "V")):
            _check_3d(t, name)
        ctx.is_causal = is_causal
        if Q.shape[0] == 0 or Q.shape[1] == 0 or K.shape[1] == 0:
            # Nothing to attend: zeros (empty without queries), as PyTorch's SDPA, and L = -inf.
            ctx.save_for_backward(Q, K, V, None, None, None)
            return Q.new_zeros((*Q.shape[:-1], V.shape[-1]))
        causal, right, keys = _mask(Q, K, is_causal)  # keys past `keys` are seen by no query
        # One head: (batch, seqlen, 1, headdim) is the same memory. S: the row statistics the forward
        # hands to the backward (fp32 on CUDA; empty elsewhere).
        O, L, S = torch.ops.tileattn.attention_forward_stats(Q.unsqueeze(2), K[:, :keys].unsqueeze(2),
                                                             V[:, :keys].unsqueeze(2), None, None, 0, 0, None, causal,
                                                             -1, right, 0.0, False)
        O, L = O.squeeze(2), L.squeeze(1)
        ctx.save_for_backward(Q, K, V, O, L, S if S.numel() else None)
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        Q, K, V, O, L, S = ctx.saved_tensors
        if O is None:  # an empty problem: its output did not depend on the inputs
            return torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V), None
        causal, right, keys = _mask(Q, K, ctx.is_causal)
        dQ, dK, dV = torch.ops.tileattn.attention_backward(dO.unsqueeze(2), Q.unsqueeze(2), K[:, :keys].unsqueeze(2),
                                                           V[:, :keys].unsqueeze(2), O.unsqueeze(2), L.unsqueeze(1),
                                                           None, None, 0, 0, None, causal, -1, right, 0.0, False,
                                                           softmax_stats=S)
        dQ, dK, dV = dQ.squeeze(2), dK.squeeze(2), dV.squeeze(2)
        if keys < K.shape[1]:  # the keys no query sees: zero gradients (a pad of none would copy)
            unseen = (0, 0, 0, K.shape[1] - keys)
            dK, dV = F.pad(dK, unseen), F.pad(dV, unseen)
        return dQ, dK, dV, None
