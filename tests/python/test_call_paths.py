"""The paths a call takes (tileattn._ops). Where the operator library (python/src/torch_ops.cpp) is
built, an eager call is one dispatcher call into it and builds no tileattn._ext call. The Python
route (the registration used without the library, and tileattn.distributed's partial calls) builds
the extension's call once per pass, whatever its options; a call the extension refuses is redone by
the checked path, which raises its own message. Either way the operator's Autograd kernel gives the
oracle's gradients, and a dispatch mode sees the operator, not the calls inside it."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import naive
import tileattn
from tileattn import _ops


class _Counter:
    """Stands in for the extension module, counting the attention calls built."""

    def __init__(self, ext):
        self._ext, self.built = ext, 0

    def Attention(self, *args, **kwargs):  # noqa: N802 (the extension's class name)
        self.built += 1
        return self._ext.Attention(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ext, name)


@pytest.fixture
def counter(monkeypatch):
    """Counts the extension calls of the Python route (taken as if the operator library were absent)."""
    c = _Counter(_ops._ext)
    monkeypatch.setattr(_ops, "_ext", c)
    monkeypatch.setattr(_ops, "_torch_ops", None)
    return c


_LIBRARY_BUILT = any(name.startswith("_torch_ops.") for name in os.listdir(os.path.dirname(_ops.__file__)))


@pytest.mark.skipif(not _LIBRARY_BUILT, reason="the package was built without the PyTorch operator library")
def test_operator_library_serves_eager_calls(monkeypatch):
    """With the library loaded, forward and backward never build a tileattn._ext call: the
    dispatcher goes straight to the C++ kernels."""
    assert _ops._torch_ops is not None
    c = _Counter(_ops._ext)
    monkeypatch.setattr(_ops, "_ext", c)
    q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
    out = tileattn.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    assert c.built == 0
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive.attention(qd, kd, vd, causal=True)
    ref.sum().backward()
    _assert_close_to_oracle(out, ref.detach(), "out")
    for ours, exact, name in ((q.grad, qd.grad, "dq"), (k.grad, kd.grad, "dk"), (v.grad, vd.grad, "dv")):
        _assert_close_to_oracle(ours, exact, name)


def test_python_registration_without_the_library():
    """TILEATTN_TORCH_OPS=0 (as a PyTorch the library was not built for) registers the operators in
    Python: values, gradients, refusals (a second derivative and forward-mode AD among them) and
    fullgraph compiles (a key/value cache step among them) still hold."""
    script = textwrap.dedent("""
        import torch, tileattn
        from tileattn import _ops
        assert _ops._torch_ops is None
        q, k, v = (torch.randn(2, 7, 2, 16, dtype=torch.float64).float().requires_grad_() for _ in range(3))
        out = tileattn.flash_attn_func(q, k, v, causal=True)
        out.sum().backward()
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / 4.0
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vd)
        ref.sum().backward()
        for ours, exact in ((out, ref), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
            assert (ours.double() - exact).abs().max().item() < 1e-5
        try:
            tileattn.flash_attn_func(q, k.half(), v)
            raise SystemExit("a float16 k was accepted")
        except TypeError as e:
            assert "k.dtype=float16 must equal q.dtype=float32" in str(e)
        f = torch.compile(lambda a, b, c: tileattn.flash_attn_func(a, b, c), fullgraph=True, backend="eager")
        assert torch.equal(f(q, k, v), tileattn.flash_attn_func(q, k, v))
        caches = [torch.zeros(2, 9, 2, 16) for _ in range(4)]
        lengths = torch.tensor([2, 5], dtype=torch.int32)
        step = lambda a, kc, vc: tileattn.flash_attn_with_kvcache(a, kc, vc, k.detach()[:, :1], v.detach()[:, :1],
                                                                  cache_seqlens=lengths)
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(q.detach()[:, :1], caches[0], caches[1])
        assert torch.equal(out, step(q.detach()[:, :1], caches[2], caches[3]))
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        (dq,) = torch.autograd.grad(tileattn.flash_attn_func(q, k, v).sum(), q, create_graph=True)
        try:
            torch.autograd.grad(dq.square().sum(), q)
            raise SystemExit("a second derivative through attention was not refused")
        except NotImplementedError as e:
            assert "attention's backward has no derivative of its own" in str(e)
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            try:
                tileattn.flash_attn_func(fwAD.make_dual(q.detach(), torch.ones_like(q)), k.detach(), v.detach())
                raise SystemExit("forward-mode AD was not refused")
            except NotImplementedError as e:
                assert "forward-mode AD" in str(e)
        print("ok")
    """)
    env = dict(os.environ, TILEATTN_TORCH_OPS="0")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def _assert_close_to_oracle(ours, ref, what):
    err = (ours.double() - ref).abs().max().item()
    assert err < 1e-5, f"{what}: max error {err}"


@pytest.mark.parametrize("case", ["plain", "gqa_window_softcap", "alibi", "varlen", "strided_dout"])
def test_one_extension_call_per_pass(counter, case):
    """No ordinary call falls back to the checked path (which would build the call a second time),
    and its values and gradients are the float64 oracle's."""
    options = {}
    heads_kv = 2
    if case == "gqa_window_softcap":
        heads_kv, options = 1, dict(causal=True, window_size=(3, 0), softcap=5.0)
    q = torch.randn(2, 9, 2, 16, requires_grad=True)
    k, v = (torch.randn(2, 11, heads_kv, 16, requires_grad=True) for _ in range(2))
    if case == "alibi":
        slopes = torch.rand(2)
        out = tileattn.flash_attn_func(q, k, v, alibi_slopes=slopes)
        assert counter.built == 1
        ref_scores = None  # ALiBi's values are checked in test_alibi; here only the path is
    elif case == "varlen":
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
        qv, kv_, vv = q.detach()[0].requires_grad_(), k.detach()[0].requires_grad_(), v.detach()[0].requires_grad_()
        out = tileattn.flash_attn_varlen_func(qv, kv_, vv, cu, cu_k, 5, 6)
        assert counter.built == 1
        ref, _ = naive.varlen_attention(qv.double(), kv_.double(), vv.double(), cu, cu_k)
        _assert_close_to_oracle(out, ref, "varlen out")
        out.sum().backward()
        assert counter.built == 2
        return
    else:
        out = tileattn.flash_attn_func(q, k, v, **options)
        assert counter.built == 1
        ref_scores = naive.attention(q.double(), k.double(), v.double(),
                                     **{("window" if n == "window_size" else n): o for n, o in options.items()})[0]
        _assert_close_to_oracle(out, ref_scores, "out")
    dout = torch.randn(*out.shape[:-1], 2 * out.shape[-1])[..., ::2] if case == "strided_dout" else None
    if dout is None:
        out.sum().backward()  # an expanded (stride 0) gradient, as every .sum() gives
    else:
        out.backward(dout)
    assert counter.built == 2
    if ref_scores is not None:
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = naive.attention(qd, kd, vd, **{("window" if n == "window_size" else n): o for n, o in options.items()})
        ref.backward(torch.ones_like(ref) if dout is None else dout.double())
        for ours, exact, name in ((q.grad, qd.grad, "dq"), (k.grad, kd.grad, "dk"), (v.grad, vd.grad, "dv")):
            _assert_close_to_oracle(ours, exact, name)


@pytest.mark.parametrize("route", ["as_built", "python"])
def test_refused_call_gives_the_checked_message(monkeypatch, route):
    if route == "python":
        monkeypatch.setattr(_ops, "_torch_ops", None)
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"k\.dtype=float16 must equal q\.dtype=float32"):
        tileattn.flash_attn_func(q, k, k)
    k3 = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match=r"k must have 4 dimensions \(batch, seqlen, heads, headdim\), got shape "
                                         r"\(1, 4, 16\)"):
        tileattn.flash_attn_func(q, k3, k3)


def test_operator_call_is_differentiable():
    """torch.ops.tileattn.attention_forward called directly on tensors that require grad: the
    operator's Autograd kernel (C++ or Python, as registered) gives the oracle's gradients."""
    q, k, v = (torch.randn(1, 7, 2, 8, dtype=torch.float32, requires_grad=True) for _ in range(3))
    out, lse = torch.ops.tileattn.attention_forward(q, k, v, None, None, 0, 0, None, True, -1, -1, 0.0, False)
    assert out.requires_grad and lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = naive.attention(qd, kd, vd, causal=True)
    ref.backward(dout.double())
    _assert_close_to_oracle(out, ref.detach(), "out")
    _assert_close_to_oracle(lse, ref_lse.detach(), "lse")
    for ours, exact, name in ((q.grad, qd.grad, "dq"), (k.grad, kd.grad, "dk"), (v.grad, vd.grad, "dv")):
        _assert_close_to_oracle(ours, exact, name)


def test_undefined_output_gradient_gives_zero_gradients():
    """The Function does not materialise zero gradients (lse never has one); an undefined gradient
    of out still gives zeros, not an error."""

    class DropsGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    q, k, v = (torch.randn(1, 5, 1, 8, requires_grad=True) for _ in range(3))
    out = tileattn.flash_attn_func(q, k, v)
    (DropsGradient.apply(out).sum() + 0.0 * q.sum()).backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert k.grad is None or torch.equal(k.grad, torch.zeros_like(k))


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_the_operator():
    """Under a dispatch mode the Autograd kernel calls the operator below autograd, so the mode sees
    the operator (as tracing does) instead of the calls inside its implementation."""
    q, k, v = (torch.randn(1, 6, 1, 8, requires_grad=True) for _ in range(3))
    with _Recording() as mode:
        out, _ = torch.ops.tileattn.attention_forward(q, k, v, None, None, 0, 0, None, False, -1, -1, 0.0, False)
    assert "tileattn.attention_forward.default" in mode.ops
    assert "aten.empty.memory_format" not in mode.ops
    expected, _ = torch.ops.tileattn.attention_forward(q, k, v, None, None, 0, 0, None, False, -1, -1, 0.0, False)
    assert torch.equal(out, expected)
