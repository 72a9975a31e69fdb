"""A readable FlashAttention in plain PyTorch, on (batch, seqlen, headdim) tensors.

The forward walks query tiles and, inside each, key tiles, keeping a running row maximum ``m``,
a running sum ``l`` of exponentials and an unnormalised output; rescaling by ``exp(m_old - m_new)``
whenever the maximum grows keeps every exponential <= 1. It returns O and saves only Q, K, V, O
and the log-sum-exp L = m + log(l), from which the backward rebuilds the probabilities
P = exp(S - L) exactly. It works in any floating dtype (float64 for gradcheck) and is the
readable counterpart of the kernels, not a fast path. The causal mask is top-left aligned
(key j is visible to query i when j <= i), as in PyTorch's SDPA.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["FlashAttentionPytorch", "attention_forward_impl", "attention_backward_impl"]

QUERY_TILE = 16
KEY_TILE = 16


def _causal_mask(q_start: int, q_len: int, k_start: int, k_len: int, device: torch.device) -> Tensor:
    rows = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    cols = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    return cols <= rows


def attention_forward_impl(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False,
                           query_tile: int = QUERY_TILE, key_tile: int = KEY_TILE) -> tuple[Tensor, Tensor]:
    """Tiled forward with an online softmax: returns O (batch, n_q, d_v) and L (batch, n_q)."""
    batch, n_q, d = Q.shape
    n_k = K.shape[1]
    scale = 1.0 / math.sqrt(d)
    O = torch.empty(batch, n_q, V.shape[-1], dtype=Q.dtype, device=Q.device)
    L = torch.empty(batch, n_q, dtype=Q.dtype, device=Q.device)
    for i0 in range(0, n_q, query_tile):
        Qi = Q[:, i0:i0 + query_tile]
        rows = Qi.shape[1]
        m = torch.full((batch, rows), -math.inf, dtype=Q.dtype, device=Q.device)
        l = torch.zeros(batch, rows, dtype=Q.dtype, device=Q.device)
        acc = torch.zeros(batch, rows, V.shape[-1], dtype=Q.dtype, device=Q.device)
        # Under the causal mask, key tiles that start after the tile's last query hold no visible key.
        k_end = min(n_k, i0 + rows) if is_causal else n_k
        for j0 in range(0, k_end, key_tile):
            Kj, Vj = K[:, j0:j0 + key_tile], V[:, j0:j0 + key_tile]
            S = Qi @ Kj.transpose(1, 2) * scale
            if is_causal:
                S = S.masked_fill(~_causal_mask(i0, rows, j0, Kj.shape[1], Q.device), -math.inf)
            m_new = torch.maximum(m, S.amax(dim=-1))
            # A row that has seen no key yet keeps m = -inf; shifting by 0 instead avoids inf - inf.
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            P = torch.exp(S - shift[..., None])
            rescale = torch.exp(m - shift)
            l = rescale * l + P.sum(dim=-1)
            acc = rescale[..., None] * acc + P @ Vj
            m = m_new
        # Rows that saw no key: O = 0 and L = -inf rather than 0/0.
        seen = l > 0
        O[:, i0:i0 + rows] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
        L[:, i0:i0 + rows] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf)
    return O, L


def attention_backward_impl(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, dO: Tensor, L: Tensor,
                            is_causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dQ, dK, dV) from the saved Q, K, V, O, L and the incoming dO.

    P is recomputed from L; D = rowsum(dO * O) equals rowsum(P * dP), which turns the softmax
    Jacobian into dS = P * (dP - D) without a second pass over the keys.
    """
    scale = 1.0 / math.sqrt(Q.shape[-1])
    S = Q @ K.transpose(1, 2) * scale
    if is_causal:
        S = S.masked_fill(~_causal_mask(0, Q.shape[1], 0, K.shape[1], Q.device), -math.inf)
    # exp(-inf - (-inf)) would be NaN for a row that sees no key; such rows have P = 0.
    P = torch.exp(S - torch.where(torch.isinf(L), 0.0, L)[..., None])
    dV = P.transpose(1, 2) @ dO
    dP = dO @ V.transpose(1, 2)
    D = (dO * O).sum(dim=-1, keepdim=True)
    dS = P * (dP - D)
    dQ = dS @ K * scale
    dK = dS.transpose(1, 2) @ Q * scale
    return dQ, dK, dV


class FlashAttentionPytorch(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d)) V for (batch, seqlen, headdim) Q, K, V; saves only Q, K, V, O, L."""

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        O, L = attention_forward_impl(Q, K, V, is_causal)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        Q, K, V, O, L = ctx.saved_tensors
        dQ, dK, dV = attention_backward_impl(Q, K, V, O, dO, L, ctx.is_causal)
        return dQ, dK, dV, None
