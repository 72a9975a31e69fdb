"""flash_attn_func / flash_attn_varlen_func on the CPU backend against the float64 oracle.

Every case checks out, lse and the three gradients with flash-attn's 2x rule: our error against
float64 is at most twice that of a naive implementation in the input dtype, plus a small floor.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import naive
import tileattn

# Absolute floors of the 2x rule, per dtype (about 8 units in the last place at unit magnitude);
# gradients get twice the floor. Cases where both errors are ~0 (one visible key) need a floor.
FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, headdim, headdim_v, causal, window, softcap, scale)
CASES = {
    "plain": (2, 33, 33, 4, 4, 32, 32, False, (-1, -1), 0.0, None),
    "gqa_causal_sk_gt_sq": (2, 40, 72, 6, 2, 24, 16, True, (-1, -1), 0.0, None),
    "causal_sq_gt_sk_empty_rows": (1, 70, 30, 2, 1, 64, 64, True, (-1, -1), 0.0, None),
    "sliding_window": (2, 64, 64, 2, 2, 16, 16, False, (8, 4), 0.0, None),
    "softcap_scale_mqa": (1, 50, 50, 3, 1, 40, 40, False, (-1, -1), 5.0, 0.3),
    "window_one_key": (1, 17, 129, 2, 2, 8, 12, False, (0, 0), 0.0, None),
    "headdim_256": (1, 20, 24, 1, 1, 256, 256, True, (-1, -1), 0.0, None),
}


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, dv, dtype):
    q = torch.randn(batch, seqlen_q, heads_q, d, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, d, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, dv, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _varlen_inputs(lens_q, lens_k, heads_q, heads_kv, d, dv):
    """cu_seqlens_q and _k from the sequences' lengths, and packed fp32 q, k, v that need grads."""
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads_q, d, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), heads_kv, d, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), heads_kv, dv, requires_grad=True)
    return cu_q, cu_k, q, k, v


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _assert_grads_near_float64(out, inputs, ref_out, ref_inputs, what=None):
    """dq, dk, dv of out within 4e-5 of the float64 reference's, for one fresh random dout;
    returns ours."""
    dout = torch.randn_like(out)
    ours = _grads(out, inputs, dout)
    oracle = _grads(ref_out, ref_inputs, dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), ours, oracle):
        assert naive.max_error(a, r) < 4e-5, name if what is None else (what, name)
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_flash_attn_func_matches_float64(case, dtype):
    batch, sq, sk, hq, hkv, d, dv, causal, window, softcap, scale = CASES[case]
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dv, dtype)
    options = dict(causal=causal, window=window, softcap=softcap, scale=scale)

    out, lse, probs = tileattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                               softcap=softcap, return_attn_probs=True)
    assert probs.shape == (0,) and probs.dtype == dtype  # flash-attn's empty S_dmask without dropout
    assert out.shape == (batch, sq, hq, dv) and out.dtype == dtype
    assert lse.shape == (batch, hq, sq) and lse.dtype == torch.float32 and lse.requires_grad
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive.attention(*ref_inputs, **options)
    naive_out, naive_lse = naive.attention(q, k, v, **options)

    floor = FLOOR[dtype]
    naive.assert_2x_rule(out, naive_out, ref_out, floor, "out")
    naive.assert_2x_rule(lse, naive.flash_lse(naive_lse.float()), naive.flash_lse(ref_lse), floor, "lse")

    dout = torch.randn_like(out)
    ours = _grads(out, (q, k, v), dout)
    oracle = _grads(ref_out, ref_inputs, dout.double())
    same_precision = _grads(naive_out, (q, k, v), dout)
    for name, a, n, r in zip(("dq", "dk", "dv"), ours, same_precision, oracle):
        naive.assert_2x_rule(a, n, r, floor * 2, name)


def test_fully_masked_rows_give_zero_output_plus_inf_lse_and_zero_grads():
    # Bottom-right causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    q, k, v = _inputs(2, 24, 8, 2, 2, 16, 16, torch.float32)
    out, lse, _ = tileattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    empty = 24 - 8
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    # flash-attn's mark of a row without keys: +inf, so that exp(score - lse) is 0 there.
    assert torch.isposinf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))


def test_default_scale_is_inverse_sqrt_headdim():
    q, k, v = _inputs(1, 16, 16, 2, 2, 48, 48, torch.float32)
    default = tileattn.flash_attn_func(q, k, v)
    explicit = tileattn.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(48))
    assert torch.equal(default, explicit)
    assert not torch.equal(default, tileattn.flash_attn_func(q, k, v, softmax_scale=0.5))


def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v = _inputs(2, 48, 48, 4, 2, 32, 32, torch.float32)
    out = tileattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence_float64(causal):
    lens_q, lens_k = [5, 0, 31, 17], [9, 4, 31, 3]
    cu_q, cu_k, q, k, v = _varlen_inputs(lens_q, lens_k, 4, 2, 32, 24)
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                  return_attn_probs=True)
    assert lse.shape == (4, q.shape[0])
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive.varlen_attention(*ref_inputs, cu_q, cu_k, causal=causal)
    assert naive.max_error(out, ref_out) < 1e-5
    assert naive.max_error(lse, naive.flash_lse(ref_lse)) < 1e-5
    _assert_grads_near_float64(out, (q, k, v), ref_out, ref_inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_offsets_may_start_past_row_zero(causal):
    # flash-attn's kernels start sequence b at cu_seqlens[b]: rows before the first offset, like
    # rows from the last on, belong to no sequence and come back as a row without keys (zeros, lse
    # +inf, zero gradients), the rest as the same call over the rows the sequences cover.
    cu_q = torch.tensor([3, 8, 25], dtype=torch.int32)
    cu_k = torch.tensor([2, 11, 14], dtype=torch.int32)
    q = torch.randn(27, 4, 32, requires_grad=True)
    k = torch.randn(16, 2, 32, requires_grad=True)
    v = torch.randn(16, 2, 24, requires_grad=True)
    out, lse, _ = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 9, causal=causal, return_attn_probs=True)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive.varlen_attention(*ref_inputs, cu_q, cu_k, causal=causal)
    ref_out = torch.cat([ref_out.new_zeros(3, 4, 24), ref_out, ref_out.new_zeros(2, 4, 24)])
    ref_lse = torch.cat([ref_lse.new_full((4, 3), -math.inf), ref_lse, ref_lse.new_full((4, 2), -math.inf)], dim=1)
    assert naive.max_error(out, ref_out) < 1e-5
    assert naive.max_error(lse, naive.flash_lse(ref_lse)) < 1e-5
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and torch.equal(out[25:], torch.zeros_like(out[25:]))
    dq, dk, dv = _assert_grads_near_float64(out, (q, k, v), ref_out, ref_inputs)
    for g, begin, end in ((dq, 3, 25), (dk, 2, 14), (dv, 2, 14)):
        assert torch.equal(g[:begin], torch.zeros_like(g[:begin])) and torch.equal(g[end:], torch.zeros_like(g[end:]))


@pytest.mark.parametrize("window", [(5, 3), (-1, 7), (0, 1), (2, 1 << 20)], ids=str)
def test_causal_with_window_keeps_left_and_sets_right_to_zero(window):
    # flash-attn's rule: causal=True with window_size=(left, right) is the window (left, 0).
    q, k, v = _inputs(2, 21, 30, 4, 2, 16, 16, torch.float32)
    out = tileattn.flash_attn_func(q, k, v, causal=True, window_size=window)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = naive.attention(*ref_inputs, causal=False, window=(window[0], 0))
    assert naive.max_error(out, ref_out) < 1e-5
    _assert_grads_near_float64(out, (q, k, v), ref_out, ref_inputs)


def test_varlen_causal_with_window_keeps_left_and_sets_right_to_zero():
    lens_q, lens_k = [7, 12, 3], [9, 12, 20]
    cu_q, cu_k, q, k, v = _varlen_inputs(lens_q, lens_k, 2, 2, 16, 16)
    out = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                          window_size=(4, 6))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = naive.varlen_attention(*ref_inputs, cu_q, cu_k, window=(4, 0))
    assert naive.max_error(out, ref_out) < 1e-5
    _assert_grads_near_float64(out, (q, k, v), ref_out, ref_inputs)


# flash-attn's kernels read a window against the key count its C++ entry sees (seqlen_k, or
# max_seqlen_k): a side of that count or more is unbounded, and a window bounded on the left only
# is bounded on the right at it. Both show only where seqlen_q > seqlen_k (here 10 over 2).
@pytest.mark.parametrize("window,applied", [((-1, 3), (-1, -1)), ((1, -1), (1, 2)), ((1, 5), (1, 2)), ((3, 0), (3, 0)),
                                            ((2, 1), (2, 1))], ids=str)
def test_window_reads_as_flash_attn_kernels_read_it(window, applied):
    q, k, v = _inputs(2, 10, 2, 2, 1, 16, 8, torch.float32)
    out, lse, _ = tileattn.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive.attention(*ref_inputs, window=applied)
    assert naive.max_error(out, ref_out) < 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(naive.flash_lse(ref_lse)))
    assert naive.max_error(lse, naive.flash_lse(ref_lse)) < 1e-5
    _assert_grads_near_float64(out, (q, k, v), ref_out, ref_inputs)


def test_left_only_window_leaves_early_rows_without_keys_as_flash_attn():
    # (1, -1) with 10 queries over 2 keys is (1, 2): queries 0-5 see no key.
    q, k, v = _inputs(1, 10, 2, 1, 1, 8, 8, torch.float32)
    out, lse, _ = tileattn.flash_attn_func(q, k, v, window_size=(1, -1), return_attn_probs=True)
    assert torch.equal(out[0, :6], torch.zeros_like(out[0, :6]))
    assert torch.isposinf(lse[0, 0, :6]).all() and torch.isfinite(lse[0, 0, 6:]).all()


def test_varlen_window_reads_against_max_seqlen_k():
    # max_seqlen_k = 3 (not each sequence's own count) bounds a left-only window on the right.
    lens_q, lens_k = [10, 4, 9], [2, 3, 1]
    cu_q, cu_k, q, k, v = _varlen_inputs(lens_q, lens_k, 2, 2, 16, 16)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    for window, applied in (((1, -1), (1, 3)), ((-1, 3), (-1, -1)), ((0, 2), (0, 2))):
        out = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_size=window)
        ref_out, _ = naive.varlen_attention(*ref_inputs, cu_q, cu_k, window=applied)
        assert naive.max_error(out, ref_out) < 1e-5, window
        _assert_grads_near_float64(out, (q, k, v), ref_out, ref_inputs, window)


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


COPY_OPS = {"clone", "copy_", "contiguous", "_to_copy", "as_strided_copy"}


def test_strided_inputs_are_read_in_place():
    # SDPA's (batch, heads, seqlen, headdim) memory seen as flash-attn's layout: no copy is made.
    q = torch.randn(2, 4, 40, 32).transpose(1, 2)
    k = torch.randn(2, 2, 56, 32).transpose(1, 2)
    v = torch.randn(2, 2, 56, 32).transpose(1, 2)
    with _OpRecorder() as recorder:
        out = tileattn.flash_attn_func(q, k, v)
    assert not COPY_OPS & set(recorder.ops), recorder.ops
    ref, _ = naive.attention(q.double(), k.double(), v.double())
    assert naive.max_error(out, ref) < 1e-5
