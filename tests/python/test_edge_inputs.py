"""Inputs at the edges of what PyTorch SDPA accepts, on the CPU backend: tensors expanded over batch
or heads (stride 0) and empty problems (a size of 0), each against a float64 reference or against
torch's own SDPA."""

import pytest
import torch
import torch.nn.functional as F

import naive
import tileattn


def _oracle_grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _expanded(base: torch.Tensor, shape, requires_grad=True):
    # The leaf is `base`; the kernel sees `base.expand(shape)` with zero strides.
    base = base.requires_grad_(requires_grad)
    return base, base.expand(shape)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, which dims of k/v are expanded)
EXPAND_CASES = {
    "over_batch": (3, 17, 23, 4, 2, "batch"),
    "over_heads": (2, 17, 23, 4, 4, "heads"),
    "over_both_gqa": (2, 9, 31, 6, 3, "both"),
    "mqa_by_expand": (2, 12, 12, 4, 4, "heads"),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(EXPAND_CASES), ids=list(EXPAND_CASES))
def test_expanded_k_v_forward_and_backward(case, causal, device):
    batch, sq, sk, hq, hkv, which = EXPAND_CASES[case]
    d = 16
    base_shape = (1 if which in ("batch", "both") else batch, sk, 1 if which in ("heads", "both") else hkv, d)
    k0, k = _expanded(torch.randn(base_shape, device=device), (batch, sk, hkv, d))
    v0, v = _expanded(torch.randn(base_shape, device=device), (batch, sk, hkv, d))
    assert 0 in k.stride()
    q = torch.randn(batch, sq, hq, d, device=device, requires_grad=True)
    out = tileattn.flash_attn_func(q, k, v, causal=causal)

    q64, k064, v064 = [t.detach().double().requires_grad_() for t in (q, k0, v0)]
    ref, _ = naive.attention(q64, k064.expand(k.shape), v064.expand(v.shape), causal=causal)
    assert naive.max_error(out, ref) < 1e-5
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k0, v0), dout)
    oracle = _oracle_grads(ref, (q64, k064, v064), dout.double())
    for name, a, r in zip(("dq", "dk (summed over the expanded dims)", "dv"), ours, oracle):
        assert a.shape == r.shape, name
        assert naive.max_error(a, r) < 1e-4, name


def test_expanded_query_and_sdpa_layout():
    # q expanded over batch in SDPA's (batch, heads, seqlen, headdim) layout; k expanded over heads.
    q0, q = _expanded(torch.randn(1, 4, 20, 16), (3, 4, 20, 16))
    k0, k = _expanded(torch.randn(3, 1, 28, 16), (3, 4, 28, 16))
    v = torch.randn(3, 4, 28, 16, requires_grad=True)
    out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=False)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q0, k0, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(ref_inputs[0].expand(q.shape), ref_inputs[1].expand(k.shape),
                                             ref_inputs[2])
    assert naive.max_error(out, ref) < 1e-5
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q0, k0, v), dout)
    oracle = torch.autograd.grad(ref, ref_inputs, dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), ours, oracle):
        assert naive.max_error(a, r) < 1e-4, name


def test_expanded_dout_and_out_as_backward_inputs():
    # Every batch entry is the same problem (q, k, v expanded over batch), so out is the same for
    # each and may come back expanded; dout is expanded over batch too. The backward reads both.
    batch, sq, sk, h, d = 3, 11, 13, 2, 8
    q = torch.randn(1, sq, h, d).expand(batch, sq, h, d)
    k = torch.randn(1, sk, h, d).expand(batch, sk, h, d)
    v = torch.randn(1, sk, h, d).expand(batch, sk, h, d)
    out, lse = torch.ops.tileattn.attention_forward(q, k, v, None, None, 0, 0, None, False, -1, -1, 0.0, False)
    out_expanded = out[:1].expand(out.shape)
    dout = torch.randn(1, sq, h, d).expand(batch, sq, h, d)
    dq, dk, dv = torch.ops.tileattn.attention_backward(dout, q, k, v, out_expanded, lse, None, None, 0, 0, None,
                                                       False, -1, -1, 0.0, False)
    # Outputs are allocated fresh: never expanded, whatever the inputs were.
    assert all(0 not in g.stride() for g in (dq, dk, dv))
    ref_inputs = [t[:1].double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive.attention(*ref_inputs)
    oracle = torch.autograd.grad(ref, ref_inputs, dout[:1].double())
    for name, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), oracle):
        for b in range(batch):
            assert naive.max_error(a[b:b + 1], r) < 1e-4, f"{name}[{b}]"


def test_gqa_grads_are_fresh_when_kv_is_expanded_over_heads():
    # dK/dV of a GQA call sum over each group's query heads into heads_kv slots; with k/v expanded
    # over those heads, autograd then sums the slots into the single stored head.
    q = torch.randn(2, 10, 8, 16, requires_grad=True)
    k0, k = _expanded(torch.randn(2, 10, 1, 16), (2, 10, 4, 16))
    v0, v = _expanded(torch.randn(2, 10, 1, 16), (2, 10, 4, 16))
    out = tileattn.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    dq, dk0, dv0 = torch.autograd.grad(out, (q, k0, v0), dout)
    # The same problem as MQA (one kv head, not expanded).
    q2, k2, v2 = [t.detach().clone().requires_grad_() for t in (q, k0, v0)]
    out2 = tileattn.flash_attn_func(q2, k2, v2)
    assert naive.max_error(out, out2) < 1e-6
    dq2, dk2, dv2 = torch.autograd.grad(out2, (q2, k2, v2), dout)
    for name, a, r in zip(("dq", "dk", "dv"), (dq, dk0, dv0), (dq2, dk2, dv2)):
        assert naive.max_error(a, r) < 1e-5, name

