"""ALiBi (``alibi_slopes``) through flash_attn_func, flash_attn_varlen_func and the packed forms,
forward and gradients, against a float64 reference written from flash-attn 2's definition with
the 2x rule; a CUDA variant of each (marked gpu); and the argument errors.

flash-attn 2 adds, to the scaled (soft-capped) score of query i and key j of a sequence of
lengths sq, sk, ``-slope * |i + sk - sq - j|``; when its kernel takes the causal branch (right
bound 0, no left bound) it adds ``slope * j`` instead, which gives the same softmax and a
softmax_lse larger by ``slope * (i + sk - sq)``. The reference computes O from the first form and
the LSE of the form flash-attn's kernel uses.
"""

import math

import pytest
import torch

import naive
import tileattn

FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def reference(q, k, v, slopes, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """(batch, seqlen, heads, dim) attention with ALiBi in q's dtype; slopes (batch, heads_q).
    Returns out and flash-attn's softmax_lse (batch, heads, seqlen_q)."""
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    distance = (i + sk - sq - j).abs().to(q.dtype)
    s = s - slopes.to(q.dtype)[:, :, None, None] * distance
    mask = naive.visible_mask(sq, sk, causal, window, q.device)
    s = s.masked_fill(~mask, -math.inf)
    seen = mask.any(dim=-1).expand(batch, hq, sq)
    lse = torch.logsumexp(s.masked_fill(~seen[..., None], 0.0), dim=-1)
    p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    # flash-attn's window normalisation, then its causal branch.
    left, right = window
    right = 0 if causal else right
    left = -1 if left >= sk else left
    if right == 0 and left < 0:
        lse = lse + slopes.double()[:, :, None] * (torch.arange(sq, device=q.device) + sk - sq).double()
    return out, torch.where(seen, lse, -math.inf)


def _slopes(shape, device):
    # flash-attn's tests draw slopes from [0, 0.3); a wider range makes the bias dominate more rows.
    return (torch.rand(shape) * 0.5).to(device)


def _per_batch(slopes, batch):
    return slopes if slopes.dim() == 2 else slopes.expand(batch, -1)


def _check(out, lse, ours_inputs, ref_fn, dtype, inputs_for_ref):
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs_for_ref]
    ref_out, ref_lse = ref_fn(*ref_inputs)
    naive_out, naive_lse = ref_fn(*inputs_for_ref)
    floor = FLOOR[dtype]
    naive.assert_2x_rule(out, naive_out, ref_out, floor, "out")
    naive.assert_2x_rule(lse, naive.flash_lse(naive_lse.float()), naive.flash_lse(ref_lse), floor, "lse")
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, ours_inputs, dout)
    oracle = torch.autograd.grad(ref_out, ref_inputs, dout.double())
    same = torch.autograd.grad(naive_out, inputs_for_ref, dout)
    for name, a, n, r in zip(("dq", "dk", "dv"), ours, same, oracle):
        naive.assert_2x_rule(a, n, r, floor * 2, name)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, headdim, causal, window, softcap, slopes per batch)
CASES = {
    "noncausal": (2, 40, 40, 4, 4, 32, False, (-1, -1), 0.0, False),
    "causal": (2, 40, 40, 4, 4, 32, True, (-1, -1), 0.0, True),
    "noncausal_sq_lt_sk": (2, 24, 70, 2, 2, 16, False, (-1, -1), 0.0, True),
    "causal_sq_gt_sk": (1, 70, 30, 2, 1, 32, True, (-1, -1), 0.0, False),
    "gqa_causal": (2, 33, 50, 6, 2, 24, True, (-1, -1), 0.0, True),
    "softcap": (1, 50, 60, 3, 1, 40, False, (-1, -1), 5.0, True),
    "softcap_causal": (1, 50, 60, 3, 1, 40, True, (-1, -1), 5.0, False),
    "window_right_0": (2, 30, 45, 2, 2, 16, False, (-1, 0), 0.0, True),
    "causal_window_left": (2, 45, 45, 2, 2, 16, True, (10, -1), 0.0, True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_flash_attn_func_alibi(case, dtype, device):
    if device == "cpu" and dtype != torch.float32 and case not in ("causal", "softcap"):
        pytest.skip("16-bit on the CPU: two cases are enough (the C++ sweep covers the rest)")
    batch, sq, sk, hq, hkv, d, causal, window, softcap, per_batch = CASES[case]
    q = torch.randn(batch, sq, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(batch, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(batch, sk, hkv, d, dtype=dtype, device=device, requires_grad=True)
    slopes = _slopes((batch, hq) if per_batch else (hq,), device)
    out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                           alibi_slopes=slopes, return_attn_probs=True)
    full = _per_batch(slopes, batch)
    _check(out, lse, (q, k, v),
           lambda q_, k_, v_: reference(q_, k_, v_, full, causal=causal, window=window, softcap=softcap),
           dtype, (q, k, v))


def test_alibi_changes_the_result():
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    plain = tileattn.flash_attn_func(q, k, v)
    biased = tileattn.flash_attn_func(q, k, v, alibi_slopes=torch.tensor([0.5, 0.25]))
    assert naive.max_error(plain, biased) > 1e-2


def _varlen_reference(q, k, v, cu_q, cu_k, slopes, **options):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        out, lse = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], slopes[b:b + 1], **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_alibi_per_sequence(causal, dtype, device):
    # Lengths differ per sequence, so the bias is aligned to each sequence's own corner.
    lens_q, lens_k = [5, 0, 33, 17], [9, 4, 33, 40]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    hq, hkv, d = 4, 2, 16
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=device, requires_grad=True)
    slopes = _slopes((len(lens_q), hq), device)
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                  alibi_slopes=slopes, return_attn_probs=True)
    _check(out, lse, (q, k, v),
           lambda q_, k_, v_: _varlen_reference(q_, k_, v_, cu_q.cpu(), cu_k.cpu(), slopes, causal=causal),
           dtype, (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_packed_forms_alibi(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batch, n, h, d = 2, 37, 4, 16
    slopes = _slopes((h,), device)
    qkv = torch.randn(batch, n, 3, h, d, dtype=dtype, device=device, requires_grad=True)
    out = tileattn.flash_attn_qkvpacked_func(qkv, causal=True, alibi_slopes=slopes)
    ref_qkv = qkv.detach().double().requires_grad_()
    ref_out, _ = reference(*ref_qkv.unbind(2), _per_batch(slopes, batch), causal=True)
    naive_out, _ = reference(*qkv.unbind(2), _per_batch(slopes, batch), causal=True)
    naive.assert_2x_rule(out, naive_out, ref_out, FLOOR[dtype], "out")
    dout = torch.randn_like(out)
    (ours,) = torch.autograd.grad(out, qkv, dout)
    (oracle,) = torch.autograd.grad(ref_out, ref_qkv, dout.double())
    (same,) = torch.autograd.grad(naive_out, qkv, dout)
    naive.assert_2x_rule(ours, same, oracle, 2 * FLOOR[dtype], "dqkv")

    q = torch.randn(batch, 20, h, d, dtype=dtype, device=device, requires_grad=True)
    kv = torch.randn(batch, n, 2, 2, d, dtype=dtype, device=device, requires_grad=True)
    slopes = _slopes((batch, h), device)
    out = tileattn.flash_attn_kvpacked_func(q, kv, alibi_slopes=slopes)
    ref_q, ref_kv = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    ref_out, _ = reference(ref_q, *ref_kv.unbind(2), slopes)
    naive_out, _ = reference(q, *kv.unbind(2), slopes)
    naive.assert_2x_rule(out, naive_out, ref_out, FLOOR[dtype], "out")
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, kv), dout)
    oracle = torch.autograd.grad(ref_out, (ref_q, ref_kv), dout.double())
    same = torch.autograd.grad(naive_out, (q, kv), dout)
    for name, a, s, r in zip(("dq", "dkv"), ours, same, oracle):
        naive.assert_2x_rule(a, s, r, 2 * FLOOR[dtype], name)

    cu = torch.tensor([0, 11, 37], dtype=torch.int32, device=device)
    qkv = torch.randn(37, 3, h, d, dtype=dtype, device=device)
    slopes = _slopes((2, h), device)
    out = tileattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 26, causal=True, alibi_slopes=slopes)
    ref_out, _ = _varlen_reference(*qkv.double().unbind(1), cu.cpu(), cu.cpu(), slopes, causal=True)
    naive_out, _ = _varlen_reference(*qkv.unbind(1), cu.cpu(), cu.cpu(), slopes, causal=True)
    naive.assert_2x_rule(out, naive_out, ref_out, FLOOR[dtype], "varlen qkvpacked out")


def _qkv(device="cpu"):
    return (torch.randn(2, 8, 4, 16, device=device) for _ in range(3))


def test_alibi_slopes_shape_errors():
    q, k, v = _qkv()
    for bad in (torch.ones(3), torch.ones(4, 4), torch.ones(2, 4, 1), torch.ones(1, 4)):
        with pytest.raises(ValueError, match=r"alibi_slopes\.shape=.* must be \(heads,\)=\(4,\) or "
                                             r"\(batch, heads\)=\(2, 4\)"):
            tileattn.flash_attn_func(q, k, v, alibi_slopes=bad)
    with pytest.raises(ValueError, match=r"alibi_slopes\.stride\(-1\)=2 must be 1"):
        tileattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, 8)[:, ::2])
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"alibi_slopes\.shape=\(3, 4\) must be"):
        tileattn.flash_attn_varlen_func(q[0].repeat(2, 1, 1), k[0].repeat(2, 1, 1), v[0].repeat(2, 1, 1), cu, cu,
                                        11, 11, alibi_slopes=torch.ones(3, 4))


def test_alibi_slopes_dtype_error():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"alibi_slopes\.dtype=float64 must be float32"):
        tileattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"alibi_slopes\.dtype=float16 must be float32"):
        tileattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, 4, dtype=torch.float16))


def test_alibi_slopes_expanded_over_the_batch_equal_per_head():
    q, k, v = _qkv()
    slopes = torch.rand(4)
    a = tileattn.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    b = tileattn.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes.expand(2, 4))
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_alibi_slopes_device_error(cuda):
    q, k, v = _qkv(cuda)
    with pytest.raises(ValueError, match=r"alibi_slopes is on cpu but q is on cuda"):
        tileattn.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4))
