"""softmax_lse is differentiable: a loss that reads it gives each row's scores dL_i * P_ij on top of
what out gives them (the gradient of a log-sum-exp is its softmax), on the CPU backend, against
float64 autograd through logsumexp. flash-attn's entries return softmax_lse with no gradient; here
a merge of partial attentions by their lse (as ring attention does) differentiates like the whole.
"""

import pytest
import torch

import naive
import tileattn

FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, headdim, causal, window, softcap)
CASES = {
    "plain": (2, 33, 33, 4, 4, 32, False, (-1, -1), 0.0),
    "gqa_causal_sk_gt_sq": (2, 40, 72, 6, 2, 24, True, (-1, -1), 0.0),
    "causal_sq_gt_sk_empty_rows": (1, 70, 30, 2, 1, 64, True, (-1, -1), 0.0),
    "window_softcap": (2, 64, 64, 2, 2, 16, False, (8, 4), 5.0),
}


def _inputs(batch, sq, sk, hq, hkv, d, dtype):
    shapes = ((batch, sq, hq, d), (batch, sk, hkv, d), (batch, sk, hkv, d))
    return [torch.randn(s, dtype=dtype).requires_grad_() for s in shapes]


def _read(lse):
    """lse where a row sees a key, 0 elsewhere (+inf in flash-attn's form, -inf in the oracle's)."""
    return torch.where(torch.isfinite(lse), lse, 0.0)


def _grads(out, lse, inputs, dout, dlse, retain_graph=False):
    loss = (out.double() * dout).sum() + (_read(lse).double() * dlse).sum()
    return torch.autograd.grad(loss, inputs, retain_graph=retain_graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_loss_of_out_and_lse_within_2x_of_naive(case, dtype):
    batch, sq, sk, hq, hkv, d, causal, window, softcap = CASES[case]
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dtype)
    out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                           return_attn_probs=True)
    assert lse.requires_grad
    options = dict(causal=causal, window=window, softcap=softcap)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive.attention(*ref_inputs, **options)
    naive_out, naive_lse = naive.attention(q, k, v, **options)
    dout = torch.randn(out.shape, dtype=torch.float64)
    dlse = torch.randn(lse.shape, dtype=torch.float64)
    ours = _grads(out, lse, (q, k, v), dout, dlse, retain_graph=True)
    oracle = _grads(ref_out, ref_lse, ref_inputs, dout, dlse)
    same_precision = _grads(naive_out, naive_lse, (q, k, v), dout, dlse)
    for name, a, n, r in zip(("dq", "dk", "dv"), ours, same_precision, oracle):
        naive.assert_2x_rule(a, n, r, 2 * FLOOR[dtype], name)
    # The lse term is no rounding: without it dq and dk are off by far more than the rule allows.
    without = _grads(out, lse, (q, k, v), dout, torch.zeros_like(dlse))
    assert naive.max_error(without[0], oracle[0]) > 10 * naive.max_error(ours[0], oracle[0]) + 1e-4


def test_loss_of_lse_alone():
    """out unused: its gradient is None, and the backward runs on lse's alone (dv is then zero)."""
    q, k, v = _inputs(2, 29, 41, 4, 2, 32, torch.float32)
    _, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, ref_lse = naive.attention(*ref_inputs, causal=True)
    rq, rk, _ = torch.autograd.grad(_read(ref_lse).sum(), ref_inputs, allow_unused=True)
    assert naive.max_error(dq, rq) < 4e-5 and naive.max_error(dk, rk) < 4e-5
    assert torch.equal(dv, torch.zeros_like(dv))


def test_varlen_loss_of_out_and_lse():
    lens_q, lens_k = [5, 0, 31, 17], [9, 4, 31, 0]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 32, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 32, requires_grad=True) for _ in range(2))
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                  return_attn_probs=True)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive.varlen_attention(*ref_inputs, cu_q, cu_k, causal=True)
    dout, dlse = torch.randn(out.shape, dtype=torch.float64), torch.randn(lse.shape, dtype=torch.float64)
    for name, a, r in zip(("dq", "dk", "dv"), _grads(out, lse, (q, k, v), dout, dlse),
                          _grads(ref_out, ref_lse, ref_inputs, dout, dlse)):
        assert naive.max_error(a, r) < 4e-5, name


@pytest.mark.parametrize("causal", [False, True])
def test_merge_of_two_key_halves_differentiates_as_the_whole(causal):
    """Attention over the first and the second half of the keys, merged by their lse, is attention
    over all keys; so are its gradients, only if the halves' lse carry theirs."""
    q, k, v = _inputs(2, 48, 48, 3, 3, 32, torch.float32)
    whole = tileattn.flash_attn_func(q, k, v, causal=causal)
    call = lambda q_, keys, **o: tileattn.flash_attn_func(q_, k[:, keys], v[:, keys], return_attn_probs=True, **o)[:2]  # noqa: E731
    half, rest = slice(0, 24), slice(24, 48)
    if causal:  # the first half: causal for the first 24 queries, whole for the rest
        (oa, la), (ob, lb) = call(q[:, half], half, causal=True), call(q[:, rest], half)
        first = torch.cat([oa, ob], 1), torch.cat([la, lb], 2)
    else:
        first = call(q, half)
    # The second half, bottom-right causal over 48 queries: query i sees key 24 + j for j <= i - 24.
    parts = [(o, torch.where(torch.isinf(l), -torch.inf, l)) for o, l in (first, call(q, rest, causal=causal))]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    w1, w2 = (torch.exp(l - lse).transpose(1, 2)[..., None] for l in (l1, l2))
    merged = w1 * o1 + w2 * o2
    assert naive.max_error(merged, whole) < 1e-5
    dout = torch.randn_like(whole)
    expected = torch.autograd.grad(whole, (q, k, v), dout)
    got = torch.autograd.grad(merged, (q, k, v), dout)
    for name, a, e in zip(("dq", "dk", "dv"), got, expected):
        assert naive.max_error(a, e) < 2e-5, name


def test_compiled_loss_of_out_and_lse_matches_eager():
    q, k, v = _inputs(1, 20, 20, 2, 2, 16, torch.float32)
    dlse = torch.randn(1, 2, 20, dtype=torch.float64)

    def loss(a, b, c):
        out, lse, _ = tileattn.flash_attn_func(a, b, c, causal=True, return_attn_probs=True)
        return out.double().sum() + (lse.double() * dlse).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_operator_refuses_a_misshapen_dlse():
    q, k, v = (torch.randn(1, 7, 2, 8) for _ in range(3))
    out, lse = torch.ops.tileattn.attention_forward(q, k, v, None, None, 0, 0, None, False, -1, -1, 0.0, False)
    with pytest.raises(tileattn.InvalidArgumentError, match=r"dlse"):
        torch.ops.tileattn.attention_backward(torch.randn_like(out), q, k, v, out, lse, None, None, 0, 0, None, False,
                                              -1, -1, 0.0, False, dlse=torch.zeros(1, 2, 8))
