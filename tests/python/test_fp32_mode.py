"""fp32 fast mode follows PyTorch's own switch, read at every call: torch.set_float32_matmul_precision
("high" or "medium") or torch.backends.cuda.matmul.allow_tf32 selects tensor cores (TF32) for fp32
inputs; "highest" keeps exact fp32. The CPU backend computes fp32 exactly in both modes."""

import pytest
import torch

import naive
import tileattn
from tileattn import _ops


class _Recorder:
    """Stands in for the extension module, recording the fp32_fast each call is built with."""

    def __init__(self, ext):
        self._ext, self.attention, self.softmax_matmul = ext, [], []

    def Attention(self, *args, **kwargs):  # noqa: N802 (the extension's class name)
        self.attention.append(args[7].fp32_fast)  # the call's Options object
        return self._ext.Attention(*args, **kwargs)

    def SoftmaxMatmul(self, *args, **kwargs):  # noqa: N802
        self.softmax_matmul.append(kwargs["fp32_fast"])
        return self._ext.SoftmaxMatmul(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ext, name)


@pytest.mark.parametrize("setting,fast", [("highest", False), ("high", True), ("medium", True), ("tf32", True)])
def test_each_call_reads_the_switch(monkeypatch, precision, setting, fast):
    """On the Python route (the operator library reads the same switch in C++: the GPU test below)."""
    recorder = _Recorder(_ops._ext)
    monkeypatch.setattr(_ops, "_ext", recorder)
    monkeypatch.setattr(_ops, "_torch_ops", None)
    torch.set_float32_matmul_precision("highest")
    if setting == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_float32_matmul_precision(setting)
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    out = tileattn.flash_attn_func(q, k, v)
    out.sum().backward()
    tileattn.softmax_matmul(torch.randn(2, 4, 8), torch.randn(2, 8, 3))
    assert recorder.attention == [fast, fast]  # forward and backward
    assert recorder.softmax_matmul == [fast]
    # Half precision never asks for it: the switch is about fp32 inputs.
    tileattn.flash_attn_func(q.detach().half(), k.detach().half(), v.detach().half())
    assert recorder.attention[-1] is False


def test_cpu_computes_fp32_exactly_in_both_modes(precision):
    q, k, v = (torch.randn(2, 40, 2, 32) for _ in range(3))
    torch.set_float32_matmul_precision("highest")
    exact = tileattn.flash_attn_func(q, k, v, causal=True)
    torch.set_float32_matmul_precision("high")
    fast = tileattn.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(exact, fast)
    ref, _ = naive.attention(q.double(), k.double(), v.double(), causal=True)
    assert naive.max_error(fast, ref) < 1e-5


@pytest.mark.gpu
def test_cuda_fast_mode_is_tf32_and_highest_is_exact(cuda, precision):
    q, k, v = (torch.randn(2, 256, 4, 64, device=cuda) for _ in range(3))
    ref, _ = naive.attention(q.double(), k.double(), v.double())
    naive_fp32, _ = naive.attention(q, k, v)
    torch.set_float32_matmul_precision("highest")
    exact = tileattn.flash_attn_func(q, k, v)
    naive.assert_2x_rule(exact, naive_fp32, ref, 1e-6, "exact fp32")
    torch.set_float32_matmul_precision("high")
    fast = tileattn.flash_attn_func(q, k, v)
    assert not torch.equal(fast, exact), "precision 'high' did not reach the fast mode"
    # TF32 keeps 10 mantissa bits: errors near 2^-11 relative per product.
    assert naive.max_error(fast, ref) < 5e-3
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True
    assert torch.equal(tileattn.flash_attn_func(q, k, v), fast), "allow_tf32 did not reach the fast mode"


@pytest.mark.gpu
def test_cuda_fast_mode_reaches_the_backward(cuda, precision):
    """The switch picks the backward's products too: TF32 gradients within 32 TF32 roundoffs of each
    gradient's largest float64 value, and exact ones within the 2x rule of a naive fp32 backward."""
    q, k, v, dout = (torch.randn(2, 200, 4, 64, device=cuda) for _ in range(4))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive.attention(*ref_leaves, causal=True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    torch.set_float32_matmul_precision("highest")
    naive_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    naive_out, _ = naive.attention(*naive_leaves, causal=True)
    naive_grads = torch.autograd.grad(naive_out, naive_leaves, dout)
    grads = {}
    for setting in ("highest", "high"):
        torch.set_float32_matmul_precision(setting)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = tileattn.flash_attn_func(*leaves, causal=True)
        grads[setting] = torch.autograd.grad(out, leaves, dout)
    for name, exact, fast, naive_grad, want in zip("qkv", grads["highest"], grads["high"], naive_grads, ref_grads):
        naive.assert_2x_rule(exact, naive_grad, want, 1e-6, f"exact d{name}")
        assert not torch.equal(fast, exact), f"precision 'high' did not reach the backward (d{name})"
        err, bound = naive.max_error(fast, want), 32 / 2048 * want.abs().max().item()
        assert err <= bound, f"fast d{name}: error {err:.3g} > TF32 bound {bound:.3g}"
