"""Gradients through every autograd path, and what the forward keeps for the backward.

How gradients are checked, honestly:
- the pure-PyTorch reference runs in float64, so torch.autograd.gradcheck applies to it directly
  (finite differences at eps=1e-6, tight tolerances);
- the kernels have no float64 mode (float32 is the widest dtype), so for them (1) forward and
  backward are compared with PyTorch's math attention in float64 within the 2x rule (tests
  elsewhere; here for the course function), and (2) gradcheck runs in float32 with a larger step
  and loose tolerances, which still catches a wrong or missing gradient term.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import naive
import tileattn
from tileattn.reference import FlashAttentionPytorch, attention_backward_impl, attention_forward_impl


def _qkv(batch, seqlen_q, seqlen_k, d, dtype=torch.float32):
    return [torch.randn(batch, n, d, dtype=dtype, requires_grad=True) for n in (seqlen_q, seqlen_k, seqlen_k)]


def _math64(Q, K, V, is_causal):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(Q, K, V, is_causal=is_causal)


# ---- the pure-PyTorch reference, float64 ----------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_gradcheck_float64(is_causal):
    Q, K, V = _qkv(1, 18, 18, 4, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: FlashAttentionPytorch.apply(q, k, v, is_causal), (Q, K, V))


def test_reference_gradcheck_float64_rectangular():
    Q, K, V = _qkv(1, 24, 18, 6, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: FlashAttentionPytorch.apply(q, k, v, True), (Q, K, V))


@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_matches_math_attention(is_causal):
    # Several tiles in each direction, with ragged last tiles.
    Q, K, V = _qkv(2, 45, 45, 16, torch.float64)
    O, L = attention_forward_impl(Q, K, V, is_causal)
    expected = _math64(Q, K, V, is_causal)
    assert naive.max_error(O, expected) < 1e-12
    scores = Q @ K.transpose(1, 2) / math.sqrt(16)
    if is_causal:
        scores = scores.masked_fill(torch.ones(45, 45, dtype=torch.bool).triu(1), -math.inf)
    assert naive.max_error(L, torch.logsumexp(scores, dim=-1)) < 1e-12

    dO = torch.randn_like(O)
    ours = attention_backward_impl(Q, K, V, O, dO, L, is_causal)
    oracle = torch.autograd.grad(expected, (Q, K, V), dO)
    for a, r in zip(ours, oracle):
        assert naive.max_error(a, r) < 1e-12


# ---- the kernels ----------------------------------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(50, 50), (30, 50), (50, 30)])
def test_flash_attention_function_matches_float64(is_causal, seqlen_q, seqlen_k):
    # Top-left causal: with seqlen_q < seqlen_k the last keys are seen by no query (zero dK, dV).
    Q, K, V = _qkv(3, seqlen_q, seqlen_k, 32)
    O = tileattn.FlashAttentionFunction.apply(Q, K, V, is_causal)
    ref_inputs = [t.detach().double().requires_grad_() for t in (Q, K, V)]
    ref = _math64(*ref_inputs, is_causal)
    naive_fp32 = _math64(Q, K, V, is_causal)
    naive.assert_2x_rule(O, naive_fp32, ref, 1e-6, "O")
    dO = torch.randn_like(O)
    ours = torch.autograd.grad(O, (Q, K, V), dO)
    oracle = torch.autograd.grad(ref, ref_inputs, dO.double())
    same_precision = torch.autograd.grad(naive_fp32, (Q, K, V), dO)
    for name, a, n, r in zip(("dQ", "dK", "dV"), ours, same_precision, oracle):
        naive.assert_2x_rule(a, n, r, 2e-6, name)


@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", [(2, 0, 4), (2, 4, 0), (0, 3, 3)])
def test_flash_attention_function_empty_problems(batch, seqlen_q, seqlen_k):
    # As PyTorch's SDPA: zeros (or an empty output) and zero gradients.
    Q, K, V = _qkv(batch, seqlen_q, seqlen_k, 8)
    for is_causal in (False, True):
        O = tileattn.FlashAttentionFunction.apply(Q, K, V, is_causal)
        assert O.shape == (batch, seqlen_q, 8) and not O.any()
        grads = torch.autograd.grad(O.sum(), (Q, K, V))
        assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (Q, K, V)))


FLOAT32_GRADCHECK = dict(eps=1e-3, atol=2e-3, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:Input #\\d+ requires gradient and is not a double")
@pytest.mark.parametrize("path", ["flash_attn_func", "flash_attn_varlen_func", "sdpa", "course"])
def test_kernel_gradcheck_float32(path):
    if path == "course":
        inputs = _qkv(2, 6, 6, 4)
        fn = lambda q, k, v: tileattn.FlashAttentionFunction.apply(q, k, v, True)  # noqa: E731
    elif path == "sdpa":
        inputs = [torch.randn(1, 2, n, 4, requires_grad=True) for n in (7, 5, 5)]
        fn = lambda q, k, v: tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif path == "flash_attn_varlen_func":
        cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
        cu_k = torch.tensor([0, 5, 7], dtype=torch.int32)
        inputs = [torch.randn(n, 2, 4, requires_grad=True) for n in (8, 7, 7)]
        fn = lambda q, k, v: tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)  # noqa: E731
    else:
        inputs = [torch.randn(1, n, h, 4, requires_grad=True) for n, h in ((6, 4), (7, 2), (7, 2))]
        fn = lambda q, k, v: tileattn.flash_attn_func(q, k, v, window_size=(3, 1), softcap=2.0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, **FLOAT32_GRADCHECK)


_SECOND_DERIVATIVE = r"attention's backward has no derivative of its own"


def _entry(path):
    """(q, k, v) of shape (2, 5, 2, 8) (one head for the course function) and a function of them
    through one public entry, causal, (B, N, H, D) out."""
    q, k, v = (torch.randn(2, 5, 2, 8, dtype=torch.float64).float().requires_grad_() for _ in range(3))
    if path == "flash_attn_varlen_func":
        cu = torch.tensor([0, 5, 10], dtype=torch.int32)
        fn = lambda a, b, c: tileattn.flash_attn_varlen_func(  # noqa: E731
            a.flatten(0, 1), b.flatten(0, 1), c.flatten(0, 1), cu, cu, 5, 5, causal=True).unflatten(0, (2, 5))
    elif path == "sdpa":
        fn = lambda a, b, c: tileattn.scaled_dot_product_attention(  # noqa: E731
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=True).transpose(1, 2)
    elif path == "course":  # (batch, seqlen, headdim): one head
        q, k, v = (t.detach()[:, :, :1].requires_grad_() for t in (q, k, v))
        fn = lambda a, b, c: tileattn.FlashAttentionFunction.apply(  # noqa: E731
            a.squeeze(2), b.squeeze(2), c.squeeze(2), True).unsqueeze(2)
    else:
        fn = lambda a, b, c: tileattn.flash_attn_func(a, b, c, causal=True)  # noqa: E731
        if path == "compiled":
            fn = torch.compile(fn, fullgraph=True, backend="eager")
    return (q, k, v), fn


@pytest.mark.parametrize("path", ["flash_attn_func", "flash_attn_varlen_func", "sdpa", "course", "compiled"])
def test_second_derivative_is_refused_not_zero(path):
    """A double backward (gradients taken with create_graph=True, then differentiated) raises where it
    reaches the kernels' backward: PyTorch's fallback for an operator without an Autograd kernel
    would let it through as a zero second derivative. The first derivatives themselves, taken with
    create_graph=True, are still the float64 oracle's."""
    (q, k, v), fn = _entry(path)
    dout = torch.randn(2, 5, q.shape[2], 8)
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), dout, create_graph=True)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive.attention(qd, kd, vd, causal=True)
    oracle = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    for ours, exact in zip(grads, oracle):
        assert naive.max_error(ours, exact) < 1e-4
    for g in grads:
        with pytest.raises(NotImplementedError, match=_SECOND_DERIVATIVE):
            torch.autograd.grad((g * g).sum() + q.sum(), (q, k, v), allow_unused=True)


@pytest.mark.parametrize("path", ["flash_attn_func", "flash_attn_varlen_func", "sdpa"])
def test_forward_mode_ad_is_refused(path):
    """Dual tensors (forward-mode AD) raise, as PyTorch's fused SDPA backends do: attention has no
    forward derivative here, and an output without its tangent would be a silent wrong answer."""
    import torch.autograd.forward_ad as fwAD

    (q, k, v), fn = _entry(path)
    for which in range(3):
        args = [t.detach() for t in (q, k, v)]
        with fwAD.dual_level():
            args[which] = fwAD.make_dual(args[which], torch.randn_like(args[which]))
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                fn(*args)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda a: fn(a, k.detach(), v.detach()), (q.detach(),), (torch.ones_like(q),))


@pytest.mark.skipif(tileattn._ops._torch_ops is None, reason="torch.func needs the operator library's autograd node")
@pytest.mark.parametrize("path", ["flash_attn_func", "flash_attn_varlen_func", "sdpa"])
def test_torch_func_grad_and_vjp_match_float64(path):
    """torch.func.grad, vjp, vmap over grad and jacrev run through attention as through PyTorch's
    SDPA, to the float64 oracle's gradients (jacrev to autograd's jacobian); a second derivative
    taken by nesting them is refused, as with create_graph."""
    (q, k, v), fn = _entry(path)
    q, k, v = (t.detach() for t in (q, k, v))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = naive.attention(qd, kd, vd, causal=True)
    dout = torch.randn(ref.shape, dtype=torch.float64).float()
    oracle = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    out, pullback = torch.func.vjp(fn, q, k, v)
    assert naive.max_error(out, ref) < 1e-5
    for ours, exact in zip(pullback(dout), oracle):
        assert naive.max_error(ours, exact) < 1e-4
    dq = torch.func.grad(lambda a: (fn(a, k, v) * dout).sum())(q)
    assert naive.max_error(dq, oracle[0]) < 1e-4
    with warnings.catch_warnings():  # no batching rule: vmap runs the operator once per mapped entry
        warnings.simplefilter("ignore")
        grads = torch.func.vmap(torch.func.grad(lambda a, g: (fn(a, k, v) * g).sum()), in_dims=(None, 0))(
            q, torch.stack([dout, -dout]))
        jacobian = torch.func.jacrev(lambda a: fn(a, k, v))(q)  # vmap over the pullback
    assert naive.max_error(grads[0], oracle[0]) < 1e-4 and naive.max_error(grads[1], -oracle[0].double()) < 1e-4
    assert torch.equal(jacobian, torch.autograd.functional.jacobian(lambda a: fn(a, k, v), q))
    with pytest.raises(NotImplementedError, match=_SECOND_DERIVATIVE):
        torch.func.grad(lambda a: torch.func.grad(lambda b: fn(b, k, v).sum())(a).square().sum())(q)


def test_saved_tensors_follow_pytorchs_rules():
    """What the forward keeps for the backward is checked as PyTorch checks its own: an input or the
    output changed in place since the forward raises, a second backward needs retain_graph (and then
    gives the same gradients), and gradients asked of some inputs only are those of the full call."""
    (q, k, v), fn = _entry("flash_attn_func")
    dout = torch.randn(2, 5, 2, 8)
    full = torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    out = fn(q, k, v)
    once = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    twice = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(full, once, twice))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, (q, k, v), dout)
    for some in ((1,), (2, 0)):
        got = torch.autograd.grad(fn(q, k, v), [(q, k, v)[i] for i in some], dout)
        assert all(torch.equal(g, full[i]) for g, i in zip(got, some))
    for changed in ("input", "output"):
        leaf = torch.randn(2, 5, 2, 8, requires_grad=True)
        q2 = leaf * 1.0  # a non-leaf that may be changed in place
        out = fn(q2, k, v)
        with torch.no_grad():
            (q2 if changed == "input" else out).add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out, (leaf, k, v), dout)


@pytest.mark.filterwarnings("ignore:Input #\\d+ requires gradient and is not a double")
def test_softmax_matmul_gradcheck_float32_and_float64_comparison():
    x = torch.randn(2, 5, 7, requires_grad=True)
    v = torch.randn(2, 7, 3, requires_grad=True)
    assert torch.autograd.gradcheck(tileattn.softmax_matmul, (x, v), **FLOAT32_GRADCHECK)

    out = tileattn.softmax_matmul(x, v)
    x64, v64 = (t.detach().double().requires_grad_() for t in (x, v))
    ref = torch.softmax(x64, dim=-1) @ v64
    assert naive.max_error(out, ref) < 1e-6
    dout = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (x, v), dout), torch.autograd.grad(ref, (x64, v64), dout.double())):
        assert naive.max_error(a, r) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_matmul_backward_gives_its_inputs_dtypes(dtype):
    # The node itself returns dx and dV in the inputs' dtype (computed in fp32): autograd would cast a
    # float32 dx on its own, but only after holding it beside x at twice its size.
    from tileattn import _ops

    x, v = torch.randn(2, 5, 7, dtype=dtype), torch.randn(2, 7, 3, dtype=dtype)
    out = tileattn.softmax_matmul(x, v)
    ctx = type("Ctx", (), {"saved_tensors": (x, v, out)})()
    g = torch.randn_like(out)
    dx, dv = _ops._softmax_matmul_backward(ctx, g)
    assert dx.dtype == dtype and dv.dtype == dtype
    x64, v64 = (t.double().requires_grad_() for t in (x, v))
    want = torch.autograd.grad(torch.softmax(x64, -1) @ v64, (x64, v64), g.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for got, ref in zip((dx, dv), want):
        assert naive.max_error(got, ref) < tol * max(1.0, ref.abs().max().item())


def test_softmax_matmul_two_dimensional():
    x, v = torch.randn(9, 33), torch.randn(33, 5)
    out = tileattn.softmax_matmul(x, v)
    assert out.shape == (9, 5)
    assert naive.max_error(out, torch.softmax(x.double(), -1) @ v.double()) < 1e-6


def test_softmax_matmul_fully_masked_row_is_zero():
    x, v = torch.randn(2, 6, 40), torch.randn(2, 40, 3)
    x[0, 2] = -math.inf  # every key masked
    x[1, 4, ::3] = -math.inf  # some keys masked
    out = tileattn.softmax_matmul(x, v)
    assert torch.equal(out[0, 2], torch.zeros(3))
    ref = torch.softmax(x.double(), -1) @ v.double()  # NaN in the fully masked row
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 2] = False
    assert naive.max_error(out[keep], ref[keep]) < 1e-6


def test_softmax_matmul_fully_masked_row_has_zero_gradients():
    # The row is a constant zero: it passes no gradient to x or v, and the other rows' gradients
    # are the float64 oracle's (torch.softmax's NaN in that row must not reach dV).
    x, v = torch.randn(2, 6, 40), torch.randn(2, 40, 3)
    x[0, 2] = -math.inf
    x.requires_grad_(), v.requires_grad_()
    dout = torch.randn(2, 6, 3)
    dx, dv = torch.autograd.grad(tileattn.softmax_matmul(x, v), (x, v), dout)
    assert torch.equal(dx[0, 2], torch.zeros(40))
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 2] = False
    xd, vd = x.detach().double()[keep].requires_grad_(), v.detach().double().requires_grad_()
    batch = torch.arange(2)[:, None].expand(2, 6)[keep]
    ref = (torch.softmax(xd, -1)[:, None, :] @ vd[batch]).squeeze(1)  # the kept rows alone
    ref_dx, ref_dv = torch.autograd.grad(ref, (xd, vd), dout[keep].double())
    assert naive.max_error(dx[keep], ref_dx) < 1e-6 and naive.max_error(dv, ref_dv) < 1e-6


# (x shape, v shape): torch.matmul's broadcasting of the leading dimensions.
SOFTMAX_MATMUL_SHAPES = {
    "batched_x_2d_v": ((2, 5, 7), (7, 3)),
    "v_batch_one": ((2, 5, 7), (1, 7, 3)),
    "x_batch_one": ((1, 5, 7), (2, 7, 3)),
    "2d_x_batched_v": ((5, 7), (2, 7, 3)),
    "4d": ((2, 3, 5, 7), (2, 3, 7, 4)),
    "4d_broadcast": ((2, 1, 5, 7), (1, 3, 7, 4)),
    "empty_d2": ((2, 5, 0), (2, 0, 3)),
    "empty_d1": ((5, 0, 7), (7, 3)),
}


@pytest.mark.parametrize("case", list(SOFTMAX_MATMUL_SHAPES))
def test_softmax_matmul_broadcasts_as_matmul(case):
    shape_x, shape_v = SOFTMAX_MATMUL_SHAPES[case]
    x, v = torch.randn(shape_x, requires_grad=True), torch.randn(shape_v, requires_grad=True)
    out = tileattn.softmax_matmul(x, v)
    xd, vd = (t.detach().double().requires_grad_() for t in (x, v))
    ref = torch.softmax(xd, -1) @ vd
    assert out.shape == ref.shape
    dout = torch.randn(ref.shape)
    for a, b in zip((out, *torch.autograd.grad(out, (x, v), dout)),
                    (ref, *torch.autograd.grad(ref, (xd, vd), dout.double()))):
        assert naive.max_error(a, b) < 1e-6


def test_softmax_matmul_any_strides():
    # A transposed x, a last dimension of stride 2 and an expanded batch: one copy where needed.
    x = torch.randn(2, 7, 5).transpose(1, 2)
    v = torch.randn(2, 7, 6)[..., ::2]
    v0 = torch.randn(1, 7, 3).expand(2, 7, 3)
    for xs, vs in ((x, v), (x, v0)):
        assert naive.max_error(tileattn.softmax_matmul(xs, vs), torch.softmax(xs.double(), -1) @ vs.double()) < 1e-6


# ---- what the forward keeps -----------------------------------------------------------------

def _saved_tensors(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


SEQ_Q, SEQ_K = 64, 48


def _paths():
    def flash():
        q = torch.randn(1, SEQ_Q, 1, 8, requires_grad=True)
        k, v = (torch.randn(1, SEQ_K, 1, 8, requires_grad=True) for _ in range(2))
        return tileattn.flash_attn_func(q, k, v, causal=True)

    def sdpa():
        q = torch.randn(1, 1, SEQ_Q, 8, requires_grad=True)
        k, v = (torch.randn(1, 1, SEQ_K, 8, requires_grad=True) for _ in range(2))
        return tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)

    def course():
        Q, K, V = _qkv(1, SEQ_Q, SEQ_K, 8)
        return tileattn.FlashAttentionFunction.apply(Q, K, V, True)

    def reference():
        Q, K, V = _qkv(1, SEQ_Q, SEQ_K, 8)
        return FlashAttentionPytorch.apply(Q, K, V, True)

    return {"flash_attn_func": flash, "sdpa": sdpa, "course": course, "reference": reference}


@pytest.mark.parametrize("path", list(_paths()))
def test_nothing_quadratic_is_saved(path):
    out, saved = _saved_tensors(_paths()[path])
    # Q, K, V, O and L: nothing else, and nothing with seq_q * seq_k elements (an fp32 CUDA forward
    # also keeps its row statistics, two floats a row of L; these run on the CPU).
    assert len(saved) == 5, [tuple(t.shape) for t in saved]
    assert max(t.numel() for t in saved) < SEQ_Q * SEQ_K, [tuple(t.shape) for t in saved]
    out.sum().backward()


@pytest.mark.parametrize("fn", [tileattn.FlashAttentionFunction, FlashAttentionPytorch], ids=["kernel", "reference"])
def test_course_functions_save_logsumexp(fn):
    Q, K, V = _qkv(2, 32, 32, 16)
    _, saved = _saved_tensors(lambda: fn.apply(Q, K, V, True))
    L = [t for t in saved if t.shape == (2, 32)]
    assert len(L) == 1
    scores = (Q @ K.transpose(1, 2)).double() / 4.0
    scores = scores.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), -math.inf)
    assert naive.max_error(L[0], torch.logsumexp(scores, dim=-1)) < 1e-5
