"""Inputs at the edges of what PyTorch SDPA accepts, on the CPU backend: tensors expanded over batch
or heads (stride 0), last dimensions that are not contiguous, and empty problems (a size of 0),
each against a float64 reference, torch's own SDPA or the same call on contiguous copies."""

import math

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


def _strided_last(t: torch.Tensor) -> torch.Tensor:
    """The same values with a last-dimension stride of 2 (every other element of a wider tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("route", ["as_built", "python"])
@pytest.mark.parametrize("entry", ["flash_attn_func", "flash_attn_varlen_func", "sdpa"])
def test_strided_last_dimension_is_the_contiguous_call(entry, route, monkeypatch):
    """flash-attn's Python entries copy an operand whose last dimension is not contiguous
    (maybe_contiguous), and PyTorch's SDPA takes any strides: the result and the gradients are
    those of the same call on contiguous tensors, bit for bit, whichever operand is strided."""
    if route == "python":
        monkeypatch.setattr(tileattn._ops, "_torch_ops", None)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    calls = {
        "flash_attn_func": lambda q, k, v: tileattn.flash_attn_func(q, k, v, causal=True),
        "flash_attn_varlen_func": lambda q, k, v: tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 9, 9,
                                                                                   causal=True),
        "sdpa": lambda q, k, v: tileattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                      v.transpose(1, 2), is_causal=True),
    }
    call = calls[entry]
    q, k, v = (torch.randn(1, 16, 2, 24) for _ in range(3))
    dout = torch.randn(call(q, k, v).shape)
    for strided in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        operands = [_strided_last(t) if i == strided else t for i, t in enumerate(leaves)]
        assert operands[strided].stride(-1) == 2
        out = call(*operands)
        grads = torch.autograd.grad(out, leaves, dout)
        dense = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = call(*dense)
        ref_grads = torch.autograd.grad(ref, dense, dout)
        assert torch.equal(out, ref), f"operand {strided}"
        for a, b in zip(grads, ref_grads):
            assert torch.equal(a, b), f"operand {strided}"
    # A strided dout too (it comes from whatever follows attention).
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(call(*leaves), leaves, _strided_last(dout))
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b), "strided dout"


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



# ---- empty problems: what PyTorch's SDPA returns ------------------------------------------------

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
EMPTY_CASES = {
    "seqlen_q_0": (2, 0, 7, 4, 2),
    "seqlen_k_0": (2, 5, 0, 4, 2),
    "batch_0": (0, 5, 7, 4, 2),
    "heads_0": (2, 5, 7, 0, 0),
    "all_0": (0, 0, 0, 2, 2),
}


def _grouped(q, k, v):
    # K/V heads repeated per query group by hand: some torch builds divide by the group size inside
    # enable_gqa even when a dimension is empty, and die on SIGFPE.
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and hkv > 0:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    return q, k, v


def _math_sdpa(q, k, v, is_causal):
    # SDPA's definition in plain ops on (batch, heads, seqlen, headdim): torch's fused CPU kernels
    # die on SIGFPE with an empty batch or head dimension in some builds.
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _sdpa_reference(q, k, v, is_causal):
    # torch's SDPA on (batch, heads, seqlen, headdim), run on copies that collect their own gradients.
    inputs = [t.detach().transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*_grouped(*inputs), is_causal=is_causal)
    return out.transpose(1, 2), inputs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(EMPTY_CASES), ids=list(EMPTY_CASES))
def test_empty_flash_attn_func_matches_torch_sdpa(case, causal):
    batch, sq, sk, hq, hkv = EMPTY_CASES[case]
    q = torch.randn(batch, sq, hq, 16, requires_grad=True)
    k = torch.randn(batch, sk, hkv, 16, requires_grad=True)
    v = torch.randn(batch, sk, hkv, 12, requires_grad=True)
    out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (batch, sq, hq, 12) and out.dtype == q.dtype
    assert lse.shape == (batch, hq, sq) and lse.dtype == torch.float32
    assert torch.isposinf(lse).all()  # flash-attn's mark of a row without keys
    # torch's top-left causal mask and ours differ only where there are rows and keys to mask.
    ref, ref_inputs = _sdpa_reference(q, k, v, is_causal=False)
    assert torch.equal(out, ref) and torch.equal(out, torch.zeros_like(out))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.transpose(1, 2).shape and torch.equal(g, r.transpose(1, 2)), name
        assert torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", list(EMPTY_CASES), ids=list(EMPTY_CASES))
def test_empty_sdpa_entry_matches_torch_sdpa(case, is_causal):
    batch, sq, sk, hq, hkv = EMPTY_CASES[case]
    q = torch.randn(batch, hq, sq, 16, requires_grad=True)
    k = torch.randn(batch, hkv, sk, 16, requires_grad=True)
    v = torch.randn(batch, hkv, sk, 16, requires_grad=True)
    gqa = hq != hkv
    out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = _math_sdpa(*_grouped(*ref_inputs), is_causal=is_causal)
    assert out.shape == ref.shape and torch.equal(out, ref)
    dout = torch.randn_like(out)
    for name, g, r in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                          torch.autograd.grad(ref, ref_inputs, dout)):
        assert g.shape == r.shape and torch.equal(g, r), name


@pytest.mark.parametrize("lens_q,lens_k", [([], []), ([0, 0], [3, 4]), ([2, 3], [0, 0]), ([0], [0])],
                         ids=["batch_0", "total_q_0", "total_k_0", "both_0"])
def test_empty_varlen(lens_q, lens_k):
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 2, 16, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), 2, 16, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), 2, 8, requires_grad=True)
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q, default=0),
                                                  max(lens_k, default=0), return_attn_probs=True)
    assert out.shape == (q.shape[0], 2, 8) and torch.equal(out, torch.zeros_like(out))
    assert lse.shape == (2, q.shape[0]) and torch.isposinf(lse).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for t, g in zip((q, k, v), grads):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(g))


def test_empty_problems_still_check_their_arguments():
    q = torch.randn(2, 0, 4, 16)
    k = torch.randn(2, 7, 2, 16)
    with pytest.raises(ValueError, match=r"k\.shape=\(2, 7, 2, 8\) must be \(2, 7, 2, 16\)"):
        tileattn.flash_attn_func(q, k[..., :8], k[..., :8])
    with pytest.raises(ValueError, match=r"v\.shape=\(2, 6, 2, 16\) must be \(2, 7, 2, 16\)"):
        tileattn.flash_attn_func(q, k, k[:, :6])
    with pytest.raises(TypeError, match=r"v\.dtype=float16 must equal q\.dtype=float32"):
        tileattn.flash_attn_func(q, k, k.half())
    with pytest.raises(TypeError, match=r"q\.dtype=float64 is not supported"):
        tileattn.flash_attn_func(q.double(), k.double(), k.double())
    with pytest.raises(ValueError, match=r"heads_kv=3 must divide heads_q=4 \(GQA\)"):
        tileattn.flash_attn_func(q, k[:, :, :1].expand(2, 7, 3, 16), k[:, :, :1].expand(2, 7, 3, 16))
    with pytest.raises(ValueError, match=r"k\.shape\[0\]=1 must equal q\.shape\[0\]=2 \(batch\)"):
        tileattn.flash_attn_func(q, k[:1], k[:1])
    with pytest.raises(ValueError, match=r"k is on meta but q is on cpu"):
        tileattn.flash_attn_func(q, k.to("meta"), k.to("meta"))
    empty = torch.randn(0, 2, 16)
    cu = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cu_seqlens_k\.dtype=int64 must be int32"):
        tileattn.flash_attn_varlen_func(empty, empty, empty, cu, cu.long(), 0, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\.shape=\(2,\) must be \(1,\)"):
        tileattn.flash_attn_varlen_func(empty, empty, empty, cu, torch.zeros(2, dtype=torch.int32), 0, 0)


@pytest.mark.parametrize("which", ["q", "k"])
def test_varlen_all_sequences_empty_with_rows_after_them(which):
    # max_seqlen 0 on one side: every sequence is empty there, so no query row sees a key; the
    # rows (all past the batch's sequences on that side) come back as zeros with lse +inf (flash-attn's mark).
    lens = [0, 0] if which == "q" else [3, 2]
    cu_q = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32) if which == "k" else torch.tensor([0, 4, 6], dtype=torch.int32)
    q = torch.randn(7, 2, 8, requires_grad=True)
    k = torch.randn(6, 2, 8, requires_grad=True)
    v = torch.randn(6, 2, 8, requires_grad=True)
    max_q, max_k = (0, 4) if which == "q" else (3, 0)
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and out.shape == (7, 2, 8)
    assert torch.equal(lse, torch.full((2, 7), float("inf")))
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_varlen_offsets_longer_than_a_zero_maximum_are_refused():
    cu = torch.tensor([0, 2], dtype=torch.int32)
    q = k = v = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: sequence 0 has length 2 > seqlen_k=0"):
        tileattn.flash_attn_varlen_func(q, k, v, cu, cu, 2, 0)
