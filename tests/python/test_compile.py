"""torch.library registration and torch.compile(fullgraph=True): forward and backward trace without
graph breaks and give the eager results.

Most tests compile with the aot_eager backend (Dynamo + AOTAutograd: the same tracing of the
operators' fake implementations and autograd formulas, without code generation); one runs the
default Inductor backend end to end.
"""

import pytest
import torch
import torch._dynamo.testing

import tileattn


def _opcheck(op, args):
    # Schema, fake implementation, autograd registration and AOT dispatch, as PyTorch checks them.
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_opcheck_attention_forward():
    q = torch.randn(2, 16, 4, 8, requires_grad=True)
    k = torch.randn(2, 12, 2, 8, requires_grad=True)
    v = torch.randn(2, 12, 2, 8, requires_grad=True)
    _opcheck(torch.ops.tileattn.attention_forward.default,
             (q, k, v, None, None, 0, 0, None, True, -1, -1, 0.0, False))


def test_opcheck_attention_forward_varlen():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 2, 8, requires_grad=True) for _ in range(3))
    _opcheck(torch.ops.tileattn.attention_forward.default, (q, k, v, cu, cu, 7, 7, 0.5, False, 3, 0, 0.0, False))


def test_opcheck_attention_backward():
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    out, lse = torch.ops.tileattn.attention_forward(q, k, v, None, None, 0, 0, None, False, -1, -1, 0.0, False)
    _opcheck(torch.ops.tileattn.attention_backward.default,
             (torch.randn_like(out), q, k, v, out, lse, None, None, 0, 0, None, False, -1, -1, 0.0, False))


def test_opcheck_cache_forward():
    # The key/value cache operator: caches k and v written in place (k_new appended at the lengths).
    q, k_new, v_new = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    k, v = torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    seqused = torch.tensor([4, 7], dtype=torch.int32)
    _opcheck(torch.ops.tileattn.cache_forward.default,
             (q, k, v, None, None, 1, 10, None, True, -1, -1, 0.0, None, seqused, None, None, None, 0, k_new, v_new))


def test_opcheck_softmax_matmul():
    _opcheck(torch.ops.tileattn.softmax_matmul.default,
             (torch.randn(2, 5, 9, requires_grad=True), torch.randn(2, 9, 4, requires_grad=True)))


def _loss_and_grads(fn, inputs):
    loss = (fn(*inputs) ** 2).sum()
    return loss, torch.autograd.grad(loss, inputs)


def _assert_compiled_matches_eager(fn, inputs, backend="aot_eager"):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    loss, grads = _loss_and_grads(compiled, inputs)
    loss_eager, grads_eager = _loss_and_grads(fn, inputs)
    torch.testing.assert_close(loss, loss_eager, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, grads_eager):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _fixed_inputs(heads_q=4, heads_kv=2):
    return [torch.randn(2, 24, h, 16, requires_grad=True) for h in (heads_q, heads_kv, heads_kv)]


def test_compile_flash_attn_func():
    _assert_compiled_matches_eager(
        lambda q, k, v: tileattn.flash_attn_func(q, k, v, causal=True, window_size=(8, 0), softcap=3.0),
        _fixed_inputs())


def test_compile_flash_attn_func_returning_lse():
    def fn(q, k, v):
        out, lse, _ = tileattn.flash_attn_func(q, k, v, return_attn_probs=True)
        return out * lse.transpose(1, 2)[..., None]

    _assert_compiled_matches_eager(fn, _fixed_inputs())


def test_compile_flash_attn_varlen_func():
    cu_q = torch.tensor([0, 7, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 16], dtype=torch.int32)
    inputs = [torch.randn(n, 2, 16, requires_grad=True) for n in (20, 16, 16)]
    _assert_compiled_matches_eager(
        lambda q, k, v: tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 9, causal=True), inputs)


def test_compile_sdpa():
    inputs = [torch.randn(2, h, 24, 16, requires_grad=True) for h in (4, 2, 2)]
    _assert_compiled_matches_eager(
        lambda q, k, v: tileattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), inputs)


@pytest.mark.parametrize("argument", ["softmax_scale", "softcap", "sdpa_scale"])
def test_compile_with_a_float_argument_that_changes(argument):
    """A float passed into the compiled function, then another: dynamo makes it symbolic on the
    second call, and the entry's own checks must not turn it into a graph break."""
    torch._dynamo.reset()
    if argument == "sdpa_scale":
        inputs = [torch.randn(2, h, 24, 16) for h in (4, 2, 2)]
        fn = lambda q, k, v, x: tileattn.scaled_dot_product_attention(q, k, v, scale=x, enable_gqa=True)  # noqa: E731
    else:
        inputs = _fixed_inputs()
        fn = lambda q, k, v, x: tileattn.flash_attn_func(q, k, v, causal=True, **{argument: x})  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    for x in (0.3, 0.2, 2.5):
        torch.testing.assert_close(compiled(*inputs, x), fn(*inputs, x), rtol=0, atol=0)


def test_compile_varlen_with_changing_max_seqlen_does_not_recompile_each_time():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda q, k, v, cu, n: tileattn.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True),
                       fullgraph=True, backend=counter, dynamic=True)
    for lengths in ([3, 5], [4, 4, 6], [2, 9], [1, 7], [5, 5, 5], [12, 1]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.randn(sum(lengths), h, 16) for h in (4, 2, 2))
        out = fn(q, k, v, cu, max(lengths))
        ref = tileattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert counter.frame_count <= 2  # the first shapes, then one dynamic graph


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_flash_attn_with_kvcache(backend):
    """A decoding step -- new keys appended with the rotary embedding, then attention over the
    cache -- compiles as one graph: output and both caches as in eager mode, bit for bit."""
    torch._dynamo.reset()
    angle = torch.rand(10, 4)
    q, k_new, v_new = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    lengths = torch.tensor([3, 6], dtype=torch.int32)

    def step(q, k_cache, v_cache, k_new, v_new, lengths):
        return tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=angle.cos(),
                                                rotary_sin=angle.sin(), cache_seqlens=lengths, causal=True)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    expected = step(q, *caches[0], k_new, v_new, lengths)
    got = torch.compile(step, fullgraph=True, backend=backend)(q, *caches[1], k_new, v_new, lengths)
    assert torch.equal(got, expected)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert not torch.equal(caches[0][0], k_cache)  # the step did append


def test_compile_varlen_over_a_paged_cache():
    torch._dynamo.reset()
    k, v = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 5, 14], dtype=torch.int32)
    q = torch.randn(5, 4, 16)

    def call(q, k, v):
        return tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 9, causal=True, block_table=table)

    assert torch.equal(torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v), call(q, k, v))


def test_compile_course_function():
    inputs = [torch.randn(2, 24, 16, requires_grad=True) for _ in range(3)]
    _assert_compiled_matches_eager(lambda q, k, v: tileattn.FlashAttentionFunction.apply(q, k, v, True), inputs)


def test_compile_softmax_matmul():
    inputs = [torch.randn(2, 6, 10, requires_grad=True), torch.randn(2, 10, 3, requires_grad=True)]
    _assert_compiled_matches_eager(tileattn.softmax_matmul, inputs)


def test_compile_inside_a_module_with_inductor():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)

        def forward(self, x):
            q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 16).unbind(2)
            return tileattn.flash_attn_func(q, k, v, causal=True).flatten(2)

    block = Block()
    x = torch.randn(2, 20, 32, requires_grad=True)
    _assert_compiled_matches_eager(block, [x], backend="inductor")
