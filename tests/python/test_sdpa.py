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


def _matches_torch_with_gradients(shapes, **kwargs):
    """Output and gradients of one call against PyTorch's SDPA (math) in float64, within 1e-5."""
    inputs = [torch.randn(*shape, requires_grad=True) for shape in shapes]
    out = tileattn.scaled_dot_product_attention(*inputs, **kwargs)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = _sdpa64(*ref_inputs, **kwargs)
    assert out.shape == ref.shape and out.dtype == inputs[0].dtype
    dout = torch.randn(ref.shape)
    ours = torch.autograd.grad(out, inputs, dout)
    oracle = torch.autograd.grad(ref, ref_inputs, dout.double())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *ours), (ref, *oracle)):
        assert naive.max_error(a, r) < 1e-5, name


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(8, 12), (1, 5), (12, 8)])
def test_top_left_causal_any_lengths(seqlen_q, seqlen_k):
    # With seqlen_q < seqlen_k the keys from seqlen_q on are seen by no query: zero dk and dv.
    _matches_torch_with_gradients([(2, 3, seqlen_q, 16), (2, 3, seqlen_k, 16), (2, 3, seqlen_k, 8)], is_causal=True)


# (query, key, value shapes, enable_gqa): PyTorch's SDPA reads (..., heads, seqlen, headdim) and
# broadcasts the leading dimensions, and a single key/value head, among the three.
BROADCAST_CASES = {
    "two_d": ([(6, 16), (9, 16), (9, 16)], False),
    "five_d_causal": ([(2, 3, 2, 6, 16), (2, 3, 2, 9, 16), (2, 3, 2, 9, 16)], False),
    "five_d_gqa": ([(2, 3, 4, 6, 16), (2, 3, 2, 9, 16), (2, 3, 2, 9, 16)], True),
    "three_d_gqa_heads_first": ([(4, 6, 16), (2, 9, 16), (2, 9, 16)], True),
    "key_value_batch_one": ([(3, 4, 6, 16), (1, 4, 9, 16), (1, 4, 9, 16)], False),
    "query_batch_one": ([(1, 4, 6, 16), (3, 4, 9, 16), (3, 4, 9, 16)], False),
    "query_4d_key_value_3d": ([(2, 4, 6, 16), (4, 9, 16), (4, 9, 16)], False),
    "one_key_head_without_gqa_flag": ([(2, 4, 6, 16), (2, 1, 9, 16), (2, 1, 9, 16)], False),
    "one_query_head": ([(2, 1, 6, 16), (2, 4, 9, 16), (2, 4, 9, 16)], False),
    "key_value_heads_differ": ([(2, 4, 6, 16), (2, 2, 9, 16), (2, 4, 9, 8)], True),
}


@pytest.mark.parametrize("case", list(BROADCAST_CASES))
def test_shapes_broadcast_as_torch(case):
    shapes, enable_gqa = BROADCAST_CASES[case]
    _matches_torch_with_gradients(shapes, enable_gqa=enable_gqa, is_causal=case.endswith("causal"))


@pytest.mark.parametrize("scale", [0.0, -0.3, 1e-3])
def test_any_finite_scale(scale):
    # scale <= 0 is legal in PyTorch: 0 weighs every visible key alike, a negative one favours the
    # least similar keys.
    _matches_torch_with_gradients([(1, 2, 7, 16), (1, 2, 10, 16), (1, 2, 10, 16)], scale=scale, is_causal=True)


@pytest.mark.filterwarnings("ignore:tileattn.scaled_dot_product_attention. a call with attn_mask")
@pytest.mark.parametrize("mask", ["bool", "float", "float_requires_grad"])
def test_attn_mask_gives_torch_results(mask):
    """A call with attn_mask is computed by PyTorch's SDPA: its values and gradients, the mask's
    gradient included."""
    q, k, v = (torch.randn(2, 3, n, 16, requires_grad=True) for n in (5, 7, 7))
    if mask == "bool":
        attn_mask = torch.rand(5, 7) > 0.4
        attn_mask[:, 0] = True  # no row without keys
        ref_mask = attn_mask
    else:
        attn_mask = torch.randn(2, 1, 5, 7, requires_grad=mask == "float_requires_grad")
        ref_mask = attn_mask.detach().double().requires_grad_(attn_mask.requires_grad)
    out = tileattn.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    ref_qkv = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _sdpa64(*ref_qkv, attn_mask=ref_mask)
    with_mask = [attn_mask] if attn_mask.requires_grad else []
    dout = torch.randn(out.shape)
    ours = (out, *torch.autograd.grad(out, [q, k, v] + with_mask, dout))
    oracle = (ref, *torch.autograd.grad(ref, ref_qkv + ([ref_mask] if with_mask else []), dout.double()))
    assert len(ours) == len(oracle) == 4 + len(with_mask)
    for a, r in zip(ours, oracle):
        assert naive.max_error(a, r) < 1e-5


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:tileattn.scaled_dot_product_attention. a call with attn_mask")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_attn_mask_on_rows_padded_by_a_few_elements(dtype, cuda):
    """The call PyTorch's SDPA computes (attn_mask) takes rows whose stride is not a whole 16 bytes
    (each row of a wider tensor, as a slice leaves them) and still gives the float64 result."""
    def padded(n):
        return torch.randn(2, 3, n, 40 + 3, dtype=dtype, device=cuda)[..., :40].requires_grad_()

    q, k, v = padded(37), padded(29), padded(29)
    attn_mask = torch.rand(37, 29, device=cuda) > 0.3
    attn_mask[:, 0] = True
    out = tileattn.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    ref_qkv = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _sdpa64(*ref_qkv, attn_mask=attn_mask)
    dout = torch.randn_like(out)
    ours = (out, *torch.autograd.grad(out, (q, k, v), dout))
    oracle = (ref, *torch.autograd.grad(ref, ref_qkv, dout.double()))
    tolerance = 2e-2 if dtype == torch.float16 else 1e-3  # wrong rows were off by more than 1
    for a, r in zip(ours, oracle):
        assert naive.max_error(a, r) < tolerance


def test_attn_mask_warns_once(recwarn):
    import tileattn.functional as functional
    functional._warned.clear()
    q = torch.randn(1, 2, 4, 8)
    for _ in range(2):
        tileattn.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert [str(w.message) for w in recwarn].count(str(recwarn[0].message)) == 1
    assert "attn_mask is computed by torch.nn.functional.scaled_dot_product_attention" in str(recwarn[0].message)


@pytest.mark.parametrize("case", ["float64", "headdim_300", "headdim_0", "headdim_v_0"])
def test_calls_the_kernels_do_not_take_are_computed_by_torch(case):
    # PyTorch's SDPA takes any dtype and head dim; such a call is handed to it (with one warning)
    # rather than refused, gradients included.
    d, dv, dtype = {"float64": (16, 16, torch.float64), "headdim_300": (300, 24, torch.float32),
                    "headdim_0": (0, 8, torch.float32), "headdim_v_0": (8, 0, torch.float32)}[case]
    q, k = torch.randn(2, 3, 5, d, dtype=dtype), torch.randn(2, 3, 7, d, dtype=dtype)
    v = torch.randn(2, 3, 7, dv, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(True)
    with pytest.warns(UserWarning, match="is computed by torch.nn.functional.scaled_dot_product_attention"):
        import tileattn.functional as functional
        functional._warned.clear()
        out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == want.shape and out.dtype == dtype
    assert torch.allclose(out, want)
    if out.numel():
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))


def test_a_call_this_build_cannot_run_is_computed_by_torch(monkeypatch):
    # A build without the call's head-dim bucket (TILEATTN_HEADDIMS) refuses it with
    # NotImplementedError; as a drop-in SDPA the call goes to PyTorch's, with one warning naming why.
    import tileattn.functional as functional

    def unbuilt(*args, **kwargs):
        raise NotImplementedError("headdim_qk=24 exceeds every head-dim bucket of this build (TILEATTN_HEADDIMS=16)")

    monkeypatch.setattr(functional, "_attention", unbuilt)
    functional._warned.clear()
    q, k, v = (torch.randn(2, 3, 9, 24, requires_grad=True) for _ in range(3))
    with pytest.warns(UserWarning, match=r"bucket of this build \(TILEATTN_HEADDIMS=16\); the call is computed by torch"):
        out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    # Bad operands are still refused with the rule, and any other refusal stands: not handed over.
    with pytest.raises(ValueError, match="must end in query's head dim 24"):
        tileattn.scaled_dot_product_attention(q, k[..., :8], v)

    def unsupported(*args, **kwargs):
        raise NotImplementedError("an option this backend does not run")

    monkeypatch.setattr(functional, "_attention", unsupported)
    with pytest.raises(NotImplementedError, match="an option this backend does not run"):
        tileattn.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("layout", ["contiguous", "viewed_from_bshd"])
def test_output_and_gradients_take_their_operands_layout(layout):
    # As PyTorch's SDPA: a contiguous query gives a contiguous result (so .view works on it), one
    # viewed from (batch, seqlen, heads, headdim) a view of such a buffer; gradients take the
    # layouts of their operands, so the leaves' .grad need no copy.
    b, h, n, d = 2, 3, 5, 8
    if layout == "contiguous":
        q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    else:
        q, k, v = (torch.randn(b, n, h, d).transpose(1, 2).requires_grad_(True) for _ in range(3))
    out = tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.stride() == q.stride()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, want, atol=1e-5)
    if layout == "contiguous":
        assert out.view(b, -1).shape == (b, h * n * d)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
    compiled = torch.compile(tileattn.scaled_dot_product_attention, fullgraph=True, backend="aot_eager")
    assert compiled(q, k, v).stride() == q.stride()
