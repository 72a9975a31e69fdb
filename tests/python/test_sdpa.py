"""scaled_dot_product_attention against PyTorch's own SDPA (math backend) run in float64."""

import pytest
import torch
import torch.nn.functional as F

import naive
import tileattn


def _sdpa64(q, k, v, **kwargs):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, headdim, headdim_v, is_causal, scale)
CASES = {
    "square": (2, 4, 4, 48, 48, 32, 32, False, None),
    "square_causal": (2, 4, 4, 48, 48, 32, 32, True, None),
    "cross_attention": (1, 2, 2, 20, 70, 64, 48, False, 0.2),
    "causal_top_left_lq_gt_lk": (2, 3, 3, 64, 40, 16, 16, True, None),
    "gqa_causal": (1, 8, 2, 33, 33, 40, 40, True, None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_torch_sdpa_in_float64(case):
    batch, hq, hkv, lq, lk, d, dv, is_causal, scale = CASES[case]
    q = torch.randn(batch, hq, lq, d, requires_grad=True)
    k = torch.randn(batch, hkv, lk, d, requires_grad=True)
    v = torch.randn(batch, hkv, lk, dv, requires_grad=True)
    out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    assert out.shape == (batch, hq, lq, dv)

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _sdpa64(*ref_inputs, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    naive_fp32 = _sdpa64(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    naive.assert_2x_rule(out, naive_fp32, ref, 1e-6, "out")

    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), dout)
    oracle = torch.autograd.grad(ref, ref_inputs, dout.double())
    same_precision = torch.autograd.grad(naive_fp32, (q, k, v), dout)
    for name, a, n, r in zip(("dq", "dk", "dv"), ours, same_precision, oracle):
        naive.assert_2x_rule(a, n, r, 2e-6, name)


def test_three_dimensional_inputs_are_one_head():
    q, k, v = (torch.randn(3, 24, 16) for _ in range(3))
    out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (3, 24, 16)
    assert naive.max_error(out, _sdpa64(q.double(), k.double(), v.double(), is_causal=True)) < 1e-5


def test_output_is_a_view_in_the_flash_layout():
    # The result is (batch, heads, seqlen, headdim) seen through the kernel's (batch, seqlen, heads,
    # headdim) buffer, the way PyTorch's flash backend returns it: no transposing copy.
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    out = tileattn.scaled_dot_product_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()


def test_top_left_causal_lq_lt_lk_is_refused():
    q = torch.randn(1, 2, 8, 16)
    kv = torch.randn(1, 2, 12, 16)
    with pytest.raises(NotImplementedError, match=r"is_causal=True with seqlen_q=8 < seqlen_k=12"):
        tileattn.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    # Without the causal mask the same shapes are fine.
    out = tileattn.scaled_dot_product_attention(q, kv, kv)
    assert naive.max_error(out, _sdpa64(q.double(), kv.double(), kv.double())) < 1e-5
