"""flash-attn's packed forms (qkvpacked, kvpacked, and their varlen versions) on the CPU backend:
the packed tensor is read in place (no copy in the forward), gradients arrive as one tensor of the
packed shape, and every result matches the float64 reference on the unpacked tensors."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import naive
import tileattn

COPY_OPS = {"clone", "copy_", "contiguous", "_to_copy", "as_strided_copy", "cat", "stack"}


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _check_grads(out, ours_inputs, ref_out, ref_inputs, tol=4e-5):
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, ours_inputs, dout)
    oracle = torch.autograd.grad(ref_out, ref_inputs, dout.double())
    for i, (a, r) in enumerate(zip(ours, oracle)):
        assert a.shape == r.shape, i
        assert naive.max_error(a, r) < tol, i


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_float64(causal):
    qkv = torch.randn(2, 37, 3, 4, 16, requires_grad=True)
    with _OpRecorder() as recorder:
        out, lse, probs = tileattn.flash_attn_qkvpacked_func(qkv, causal=causal, window_size=(9, 2),
                                                             return_attn_probs=True)
    assert not COPY_OPS & set(recorder.ops), recorder.ops
    assert out.shape == (2, 37, 4, 16) and lse.shape == (2, 4, 37) and probs.shape == (0,)
    ref_qkv = qkv.detach().double().requires_grad_()
    ref, ref_lse = naive.attention(ref_qkv[:, :, 0], ref_qkv[:, :, 1], ref_qkv[:, :, 2], causal=causal,
                                   window=(9, 2))
    assert naive.max_error(out, ref) < 1e-5 and naive.max_error(lse, ref_lse) < 1e-5
    _check_grads(out, (qkv,), ref, (ref_qkv,))


@pytest.mark.parametrize("heads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_kvpacked_matches_float64(heads_kv):
    q = torch.randn(2, 21, 4, 16, requires_grad=True)
    kv = torch.randn(2, 30, 2, heads_kv, 16, requires_grad=True)
    with _OpRecorder() as recorder:
        out = tileattn.flash_attn_kvpacked_func(q, kv, causal=True, softmax_scale=0.3)
    assert not COPY_OPS & set(recorder.ops), recorder.ops
    ref_q, ref_kv = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    ref, _ = naive.attention(ref_q, ref_kv[:, :, 0], ref_kv[:, :, 1], causal=True, scale=0.3)
    assert naive.max_error(out, ref) < 1e-5
    _check_grads(out, (q, kv), ref, (ref_q, ref_kv))


def test_varlen_qkvpacked_matches_float64():
    lens = [5, 0, 19, 8]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    qkv = torch.randn(int(cu[-1]), 3, 2, 24, requires_grad=True)
    with _OpRecorder() as recorder:
        out, lse, _ = tileattn.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True,
                                                                return_attn_probs=True)
    assert not COPY_OPS & set(recorder.ops), recorder.ops
    assert lse.shape == (2, qkv.shape[0])
    ref_qkv = qkv.detach().double().requires_grad_()
    ref, ref_lse = naive.varlen_attention(ref_qkv[:, 0], ref_qkv[:, 1], ref_qkv[:, 2], cu, cu, causal=True)
    assert naive.max_error(out, ref) < 1e-5 and naive.max_error(lse, ref_lse) < 1e-5
    _check_grads(out, (qkv,), ref, (ref_qkv,))


def test_varlen_kvpacked_gqa_matches_float64():
    lens_q, lens_k = [3, 11, 7], [9, 11, 2]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 6, 16, requires_grad=True)
    kv = torch.randn(int(cu_k[-1]), 2, 2, 16, requires_grad=True)
    with _OpRecorder() as recorder:
        out = tileattn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                       window_size=(4, 0))
    assert not COPY_OPS & set(recorder.ops), recorder.ops
    ref_q, ref_kv = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    ref, _ = naive.varlen_attention(ref_q, ref_kv[:, 0], ref_kv[:, 1], cu_q, cu_k, causal=True, window=(4, 0))
    assert naive.max_error(out, ref) < 1e-5
    _check_grads(out, (q, kv), ref, (ref_q, ref_kv))


def test_packed_tensor_inside_a_larger_projection_is_read_in_place():
    # The common case: qkv is a view of one projection's output, (batch, seqlen, 3 * heads * d)
    # reshaped, with a non-packed stride between tokens (here a padded row).
    buffer = torch.randn(2, 20, 3 * 2 * 16 + 8)
    qkv = buffer[..., :96].unflatten(-1, (3, 2, 16)).requires_grad_()
    assert not qkv.is_contiguous()
    out = tileattn.flash_attn_qkvpacked_func(qkv)
    ref, _ = naive.attention(*(qkv.detach().double()[:, :, i] for i in range(3)))
    assert naive.max_error(out, ref) < 1e-5


def test_packed_shapes_are_checked():
    with pytest.raises(ValueError, match=r"qkv must have 5 dimensions \(batch, seqlen, 3, heads, headdim\) with 3 "
                                         r"at dimension 2, got shape \(2, 8, 2, 4, 16\)"):
        tileattn.flash_attn_qkvpacked_func(torch.randn(2, 8, 2, 4, 16))
    with pytest.raises(ValueError, match=r"kv must have 5 dimensions .* got shape \(2, 8, 4, 16\)"):
        tileattn.flash_attn_kvpacked_func(torch.randn(2, 8, 4, 16), torch.randn(2, 8, 4, 16))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"qkv must have 4 dimensions \(total, 3, heads, headdim\)"):
        tileattn.flash_attn_varlen_qkvpacked_func(torch.randn(8, 4, 16), cu, 8)
    with pytest.raises(ValueError, match=r"kv must have 4 dimensions \(total_k, 2, heads_kv, headdim\) with 2"):
        tileattn.flash_attn_varlen_kvpacked_func(torch.randn(8, 4, 16), torch.randn(8, 3, 4, 16), cu, cu, 8, 8)
    with pytest.raises(ValueError, match=r"heads_kv=3 must divide heads_q=4 \(GQA\)"):
        tileattn.flash_attn_kvpacked_func(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 3, 16))
