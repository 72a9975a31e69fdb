"""The independent references the tests compare against: attention written directly from its
definition (one einsum, an explicit mask, logsumexp), in whatever dtype it is given — float64 for
the oracle, the input dtype for the "same-precision naive implementation" of the 2x rule."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int], device) -> Tensor:
    """(seqlen_q, seqlen_k) bool: key j visible to query i, bottom-right aligned (flash-attn)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    shift = seqlen_k - seqlen_q
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= i + shift - left
    if right >= 0:
        visible &= j <= i + shift + right
    return visible


def flash_window(window: tuple[int, int], causal: bool, keys: int) -> tuple[int, int]:
    """The window flash-attn's kernels apply for `window_size` against the key count its C++ entry
    sees (seqlen_k, max_seqlen_k, or the cache's keys per sequence): a side of `keys` or more is
    unbounded, and a window bounded on the left only is bounded on the right at `keys`."""
    left, right = window
    left = -1 if left < 0 or left >= keys else left
    right = -1 if right < 0 or right >= keys else right
    if not causal and left >= 0 and right < 0:
        right = keys
    return left, right


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window=(-1, -1), softcap: float = 0.0,
              scale: float | None = None, mask: Tensor | None = None,
              delta_from_out: bool = False, stats: dict | None = None) -> tuple[Tensor, Tensor]:
    """(batch, seqlen, heads, headdim) attention; returns out and lse (batch, heads, seqlen_q).

    Differentiable (autograd gives the reference gradients). Rows that see no key give out = 0 and
    lse = -inf without NaN in values or gradients. `mask` overrides causal/window when given.
    `delta_from_out`: the gradient of the scores is P (dP - D) with D = rowsum(dO * O), as a
    backward that keeps no score matrix forms it, instead of autograd's rowsum(P * dP)
    (_WeightsTimesV). `stats`: when given, its "max_abs_score" is raised to the largest visible |s|
    (before the cap).
    """
    batch, seqlen_q, heads_q, d = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.repeat_interleave(heads_q // heads_kv, dim=2)
    v = v.repeat_interleave(heads_q // heads_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is None:
        mask = visible_mask(seqlen_q, seqlen_k, causal, window, q.device)
    if stats is not None and s.numel():
        # Before the cap: a capped score is only as exact as the product it came from, whose
        # rounding follows the product's size (fp32, cap 2 over products to ~100: the naive dK's
        # error moved from 6e-7 to 1.4e-5 with the head dim's summation order alone).
        largest = float(s.detach().masked_fill(~mask, 0.0).abs().max())
        stats["max_abs_score"] = max(stats.get("max_abs_score", 0.0), largest)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -math.inf)
    seen = mask.any(dim=-1).expand(batch, heads_q, seqlen_q)
    lse = torch.logsumexp(s.masked_fill(~seen[..., None], 0.0), dim=-1)
    if delta_from_out:
        out = _WeightsTimesV.apply(s, torch.where(seen, lse, 0.0).detach(), v)
    else:
        p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
        out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out, torch.where(seen, lse, -math.inf)


class _WeightsTimesV(torch.autograd.Function):
    """out = exp(s - lse) v, every operation in the inputs' dtype, with the memory-efficient
    backward's score gradient P (dP - D), D = rowsum(dO * out): D comes from the output, not from
    the P and dP it is subtracted from, so it does not carry dP's rounding (docs/accuracy.md)."""

    @staticmethod
    def forward(ctx, s, lse, v):
        p = torch.exp(s - lse[..., None])
        out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
        ctx.save_for_backward(p, v, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        p, v, out = ctx.saved_tensors
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, v)
        delta = (dout * out).sum(dim=-1).transpose(1, 2)[..., None]
        ds = p * (dp - delta.to(p.dtype))
        dv = torch.einsum("bhqk,bqhd->bkhd", p.to(dout.dtype), dout)
        return ds, None, dv


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **options) -> tuple[Tensor, Tensor]:
    """Packed (total, heads, headdim) attention, one sequence at a time; lse is (heads, total_q)."""
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        out, lse = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def flash_lse(lse: Tensor) -> Tensor:
    """A reference lse as flash-attn's entries return it: +inf on rows that see no key (log(0) =
    -inf here)."""
    return torch.where(torch.isneginf(lse), math.inf, lse)


def max_error(actual: Tensor, expected: Tensor) -> float:
    """Largest absolute difference, treating matching infinities (lse = -inf) as equal."""
    a, e = actual.detach().double(), expected.detach().double()
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(same_inf, 0.0, (a - e).abs())
    return float(diff.max()) if diff.numel() else 0.0


def assert_2x_rule(actual: Tensor, naive_same_precision: Tensor, oracle: Tensor, floor: float, what: str) -> None:
    """flash-attn's rule: our error against the float64 oracle is at most twice the error of a naive
    implementation in the same precision, plus an absolute floor."""
    ours = max_error(actual, oracle)
    theirs = max_error(naive_same_precision, oracle)
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result"
    assert ours <= 2 * theirs + floor, f"{what}: error {ours:.3g} > 2 x naive {theirs:.3g} + {floor:g}"
