"""Attention dropout through the Python API (flash-attn 2 semantics, docs/python.md "Dropout"):
forward and gradients against a float64 reference that applies the keep mask read from the
returned S_dmask (flash-attn's: each weight, its sign bit set where dropped), the 2x
rule against the same computation in the inputs' precision, binomial kept fractions, the
generator (torch.manual_seed reproduces, each call advances), bitwise repeats, p = 0 and p = 1,
the argument errors, and fp32 on CUDA in exact and TF32 mode."""

from __future__ import annotations

import math

import pytest
import torch

import tileattn

_FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def _keep(s_dmask, seqlen_q, seqlen_k):
    """The keep mask in S_dmask: its sign bits (a dropped weight of 0 is -0.0), cropped from the
    shape rounded up to multiples of 128."""
    assert s_dmask.shape[-2:] == (-(-seqlen_q // 128) * 128, -(-seqlen_k // 128) * 128)
    return ~torch.signbit(s_dmask[..., :seqlen_q, :seqlen_k])


def _reference(q, k, v, keep, p, causal=False, scale=None, dtype=torch.float64):
    """softmax(Q K^T scale) with flash-attn's bottom-right causal mask, then P * M / (1 - p), then V,
    in `dtype` ((batch, seqlen, heads, dim) tensors; GQA by repetition). Returns (out, lse)."""
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (qh @ kh.transpose(-1, -2)) * scale
    sq, sk = s.shape[-2:]
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    lse = torch.logsumexp(s, -1)
    prob = torch.softmax(s, -1)
    out = (prob * keep.to(dtype) / (1 - p)) @ vh
    return out.transpose(1, 2), lse


def _inputs(b, sq, sk, h, hk, d, dtype, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    return q, k, v, dout


def _max_err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_forward_and_gradients_against_float64(dtype, causal, p):
    q, k, v, dout = _inputs(2, 70, 90, 4, 2, 32, dtype)
    out, lse, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=p, causal=causal, return_attn_probs=True)
    assert s_dmask.dtype == dtype and s_dmask.shape == (2, 4, 128, 128)
    keep = _keep(s_dmask, 70, 90)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _reference(*leaves, keep, p, causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    naive, _ = _reference(*low, keep, p, causal, dtype=dtype)
    naive_grads = torch.autograd.grad(naive, low, dout)

    floor = _FLOOR[dtype]
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-5, atol=1e-5), "lse is the undropped LSE"
    for name, got, want, base, f in (("out", out, ref, naive, floor), ("dq", dq, ref_grads[0], naive_grads[0], 2 * floor),
                                     ("dk", dk, ref_grads[1], naive_grads[1], 2 * floor),
                                     ("dv", dv, ref_grads[2], naive_grads[2], 2 * floor)):
        err, naive_err = _max_err(got, want), _max_err(base, want)
        assert err <= 2 * naive_err + f, f"{name}: error {err:.3g} > 2 x naive {naive_err:.3g} + {f}"


def test_s_dmask_probes_stay_in_the_calls_head_dim_bucket(monkeypatch):
    # S_dmask's weights come from attention calls on one-hot values; each must run in the head-dim
    # bucket of the call itself (max of q's and v's head dims), which a build that has the call's
    # bucket has, whatever else it lacks. 300 keys at head dims 24/40: probes of at most 40 columns.
    from tileattn import _ops
    widths, attention = [], _ops.attention

    def recording(q, k, v, *args, **kwargs):
        widths.append(v.shape[-1])
        return attention(q, k, v, *args, **kwargs)

    q, k = torch.randn(1, 50, 2, 24), torch.randn(1, 300, 2, 24)
    v = torch.randn(1, 300, 2, 40)
    monkeypatch.setattr(_ops, "attention", recording)
    _, _, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert widths[0] == 40 and max(widths) <= 40 and sum(widths[1:]) == 300  # the call, then its probes
    s = torch.einsum("qhd,khd->hqk", q[0].double(), k[0].double()) / math.sqrt(24)
    assert torch.allclose(s_dmask[0, :, :50, :300].abs().double(), torch.softmax(s, -1), atol=1e-6)


@pytest.mark.parametrize("varlen", [False, True])
def test_s_dmask_holds_each_weight_with_its_drop_in_the_sign(varlen):
    # flash-attn's S_dmask: |S| is each key's softmax weight (masked keys 0), the sign bit says
    # dropped, the shape is rounded up to multiples of 128 with zeros past the sequences.
    q, k, v, _ = _inputs(2, 70, 90, 4, 2, 32, torch.float32)
    if varlen:
        cu_q, cu_k = torch.tensor([0, 30, 70], dtype=torch.int32), torch.tensor([0, 50, 90], dtype=torch.int32)
        _, _, s_dmask = tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 40, 50, dropout_p=0.4,
                                                        causal=True, return_attn_probs=True)
        parts = [(q[0, :30], k[0, :50], 30, 50), (q[0, 30:], k[0, 50:], 40, 40)]
    else:
        _, _, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=0.4, causal=True, return_attn_probs=True)
        parts = [(q[b], k[b], 70, 90) for b in range(2)]
    assert s_dmask.shape == (2, 4, 128, 128) and s_dmask.dtype == torch.float32
    for b, (qb, kb, n_q, n_k) in enumerate(parts):
        s = torch.einsum("qhd,khd->hqk", qb.double(), kb.double().repeat_interleave(2, 1)) / math.sqrt(32)
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1), -math.inf)
        weights = torch.softmax(s, -1).nan_to_num()
        assert torch.allclose(s_dmask[b, :, :n_q, :n_k].abs().double(), weights, atol=1e-6)
        assert not s_dmask[b, :, n_q:].any() and not s_dmask[b, :, :, n_k:].any()
    dropped = torch.signbit(s_dmask).sum().item() / (2 * 4 * 128 * 128)
    assert 0.0 < dropped < 0.4


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7])
def test_kept_fraction_is_binomial(p):
    q, k, v, _ = _inputs(2, 64, 200, 3, 3, 8, torch.float32)
    _, _, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    keep = _keep(s_dmask, 64, 200)
    n = keep.numel()
    sd = math.sqrt(n * p * (1 - p))
    assert abs(keep.sum().item() - n * (1 - p)) <= 5 * sd
    # The mask is what the forward applied: with Q = 0 every weight is 1/sk, so with V = 1 each output
    # row is its kept count / (sk (1 - p)).
    ones = torch.ones(2, 200, 3, 1)
    out, _, s_dmask = tileattn.flash_attn_func(torch.zeros(2, 64, 3, 8), torch.randn(2, 200, 3, 8), ones,
                                               dropout_p=p, return_attn_probs=True)
    keep = _keep(s_dmask, 64, 200)
    want = keep.double().sum(-1).transpose(1, 2) / (200 * (1 - p))
    assert torch.allclose(out[..., 0].double(), want, atol=1e-5)


def test_manual_seed_reproduces_and_calls_advance():
    q, k, v, dout = _inputs(1, 40, 50, 2, 2, 16, torch.bfloat16, seed=3)

    def run():
        out = tileattn.flash_attn_func(q, k, v, dropout_p=0.4)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.manual_seed(1234)
    first, second = run(), run()
    torch.manual_seed(1234)
    again = run()
    for a, b in zip(first, again):
        assert torch.equal(a, b), "same seed: bitwise the same output and gradients"
    assert not torch.equal(first[0], second[0]), "each call advances the generator"
    torch.manual_seed(1235)
    assert not torch.equal(run()[0], first[0]), "another seed, another mask"


def test_deterministic_is_bitwise():
    q, k, v, dout = _inputs(2, 100, 100, 4, 1, 32, torch.float32, seed=5)
    results = []
    for _ in range(2):
        torch.manual_seed(9)
        out = tileattn.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, deterministic=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_p_zero_is_no_dropout_exactly():
    q, k, v, dout = _inputs(2, 33, 47, 2, 1, 24, torch.float16, seed=7)
    out0, lse0, s_dmask = tileattn.flash_attn_func(q, k, v, return_attn_probs=True)
    out1 = tileattn.flash_attn_func(q, k, v, dropout_p=0.0)
    assert s_dmask.numel() == 0 and torch.equal(out0, out1)
    assert torch.equal(torch.autograd.grad(out0, q, dout)[0], torch.autograd.grad(out1, q, dout)[0])


def test_p_one_gives_zeros_and_zero_gradients():
    q, k, v, dout = _inputs(1, 20, 30, 2, 2, 16, torch.float32, seed=11)
    out, lse, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=1.0, return_attn_probs=True)
    keep = _keep(s_dmask, 20, 30)
    assert torch.equal(out, torch.zeros_like(out)) and not keep.any()
    _, ref_lse = _reference(q.detach().double(), k.detach().double(), v.detach().double(), keep, 0.0)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    for g in torch.autograd.grad(out, (q, k, v), dout):
        assert torch.equal(g, torch.zeros_like(g))


def test_varlen_and_packed_forms_use_positions_within_sequences():
    torch.manual_seed(0)
    lens = [13, 40, 7]
    cu = torch.tensor([0, 13, 53, 60], dtype=torch.int32)
    qkv = torch.randn(60, 3, 2, 16, dtype=torch.float64).float().requires_grad_()
    out, _, s_dmask = tileattn.flash_attn_varlen_qkvpacked_func(qkv, cu, 40, dropout_p=0.3, causal=True,
                                                                return_attn_probs=True)
    assert s_dmask.shape == (3, 2, 128, 128)
    keep = _keep(s_dmask, 40, 40)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    leaf = qkv.detach().double().requires_grad_()
    parts = []
    for b, n in enumerate(lens):
        rows = leaf[cu[b]:cu[b + 1]].unsqueeze(0)
        o, _ = _reference(rows[:, :, 0], rows[:, :, 1], rows[:, :, 2], keep[b:b + 1, :, :n, :n], 0.3, causal=True)
        parts.append(o[0])
    ref = torch.cat(parts)
    (ref_grad,) = torch.autograd.grad(ref, leaf, dout.double())
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(dqkv.double(), ref_grad, atol=1e-4)


def test_sdpa_dropout_matches_flash_attn_with_the_same_generator_state():
    q, k, v, _ = _inputs(1, 30, 30, 2, 2, 16, torch.float32, seed=13)
    torch.manual_seed(21)
    a = tileattn.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.2, is_causal=True)
    torch.manual_seed(21)
    b = tileattn.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    assert torch.equal(a.transpose(1, 2), b)


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf])
def test_dropout_p_outside_0_1_is_a_value_error(value):
    q, k, v, _ = _inputs(1, 8, 8, 1, 1, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match=rf"dropout_p={value!r} must be in \[0, 1\]"):
        tileattn.flash_attn_func(q, k, v, dropout_p=value)


def test_seqused_k_with_dropout_drops_as_the_keys_it_reads():
    # A call with seqused_k (or block_table) and dropout runs as the plain call over the keys it
    # reads: the same seed gives the same mask, so the same output.
    q, kv = torch.randn(12, 2, 8), torch.randn(20, 2, 8)
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 20], dtype=torch.int32)
    used = torch.tensor([6, 11], dtype=torch.int32)
    torch.manual_seed(5)
    out = tileattn.flash_attn_varlen_func(q, kv, kv, cu_q, cu_k, 7, 11, dropout_p=0.5, seqused_k=used)
    dense = torch.cat([kv[:6], kv[9:20]])
    torch.manual_seed(5)
    want = tileattn.flash_attn_varlen_func(q, dense, dense, cu_q, torch.tensor([0, 6, 17], dtype=torch.int32), 7, 11,
                                           dropout_p=0.5)
    assert torch.equal(out, want)


def test_compiled_dropout_runs_forward_and_backward():
    # fullgraph: the seed/offset draw and the operator trace without a graph break.
    q, k, v, dout = _inputs(1, 32, 32, 2, 2, 16, torch.float32, seed=17)
    f = torch.compile(lambda q, k, v: tileattn.flash_attn_func(q, k, v, dropout_p=0.5), fullgraph=True)
    out = f(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.isfinite(g).all() for g in grads)
    assert not torch.equal(out, tileattn.flash_attn_func(q, k, v)), "dropout took effect"


CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not tileattn._ext.built_with_cuda,
                          reason="needs a CUDA build and GPU")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_dropout_matches_cpu_with_the_same_mask(dtype, causal):
    # The GPU draws the same mask as the CPU from the same seed: the keep mask it returns rebuilds
    # a float64 reference that its output and gradients must follow (the 2x rule's floor).
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 70, 4, 64, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    out, lse, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=causal, return_attn_probs=True)
    assert s_dmask.device == out.device
    keep = _keep(s_dmask, 70, 70)
    kept = keep.float().mean().item()
    assert abs(kept - 0.7) < 0.02, kept
    dout = torch.randn_like(out)
    out.backward(dout)
    qd, kd, vd, dd = (x.detach().double().requires_grad_() for x in (q, k, v, dout))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / 8.0
    if causal:
        s = s.masked_fill(torch.ones(70, 70, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1) * keep.double() / 0.7, vd)
    ref.backward(dd)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    for got, want in ((out, ref), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        err = (got.double() - want.detach()).abs().max().item()
        assert err <= tol * max(1.0, want.detach().abs().max().item()), err


@CUDA
def test_cuda_dropout_is_reproducible_from_the_seed():
    q = torch.randn(1, 40, 2, 64, device="cuda", dtype=torch.float16)
    torch.manual_seed(11)
    a = tileattn.flash_attn_func(q, q, q, dropout_p=0.2)
    torch.manual_seed(11)
    b = tileattn.flash_attn_func(q, q, q, dropout_p=0.2)
    assert torch.equal(a, b)
    assert not torch.equal(a, tileattn.flash_attn_func(q, q, q, dropout_p=0.2))


@CUDA
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_fp32_dropout_against_float64_with_the_returned_mask(precision, fast, causal):
    # fp32 on the GPU: the returned keep mask rebuilds the float64 reference, and the 2x rule holds
    # against the same computation in fp32 on the CPU. Fast mode (TF32 products) bounds out and lse by
    # 16 TF32 roundoffs of the largest value instead, and each gradient by 32 of its largest element.
    torch.set_float32_matmul_precision("high" if fast else "highest")
    torch.backends.cuda.matmul.allow_tf32 = fast
    q, k, v, dout = (t.detach().cuda() for t in _inputs(2, 70, 90, 4, 2, 64, torch.float32))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, s_dmask = tileattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=causal, return_attn_probs=True)
    assert s_dmask.device == out.device
    keep = _keep(s_dmask, 70, 90)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.set_float32_matmul_precision("highest")  # the references below in exact fp32
    torch.backends.cuda.matmul.allow_tf32 = False

    keep = keep.cpu()
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _reference(*leaves, keep, 0.3, causal)
    ref_grads = torch.autograd.grad(ref, leaves, dout.cpu().double())
    low = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    naive, _ = _reference(*low, keep, 0.3, causal, dtype=torch.float32)
    naive_grads = torch.autograd.grad(naive, low, dout.cpu())

    floor = _FLOOR[torch.float32]
    checks = [("dq", dq, ref_grads[0], naive_grads[0], 2 * floor), ("dk", dk, ref_grads[1], naive_grads[1], 2 * floor),
              ("dv", dv, ref_grads[2], naive_grads[2], 2 * floor)]
    if fast:
        tf32 = 16 / 2048
        for name, got, want in (("out", out, ref), ("lse", lse, ref_lse)):
            err, bound = _max_err(got.cpu(), want), tf32 * max(1.0, want.abs().max().item())
            assert err <= bound, f"{name}: error {err:.3g} > TF32 bound {bound:.3g}"
        for name, got, want in (("dq", dq, ref_grads[0]), ("dk", dk, ref_grads[1]), ("dv", dv, ref_grads[2])):
            err, bound = _max_err(got.cpu(), want), 2 * tf32 * want.abs().max().item()
            assert err <= bound, f"{name}: error {err:.3g} > TF32 bound {bound:.3g}"
        checks = []
    else:
        assert torch.allclose(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5), "lse is the undropped LSE"
        checks.append(("out", out, ref, naive, floor))
    for name, got, want, base, f in checks:
        err, naive_err = _max_err(got.cpu(), want), _max_err(base, want)
        assert err <= 2 * naive_err + f, f"{name}: error {err:.3g} > 2 x naive {naive_err:.3g} + {f}"


_DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _op_forward(q, k, v, rng, p=0.3, deterministic=True):
    return torch.ops.tileattn.attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], None, False, -1, -1, 0.0,
                                                deterministic, None, p, rng)


def _op_backward(dout, q, k, v, out, lse, rng, p=0.3):
    return torch.ops.tileattn.attention_backward(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], None,
                                                 False, -1, -1, 0.0, True, None, p, rng)


@pytest.mark.parametrize("device", _DEVICES)
def test_seed_and_offset_are_read_when_the_call_runs(device):
    # dropout_rng is read by the run, not when the call is made: a pair written into the same tensor
    # after one call gives the next call exactly the mask a fresh tensor with that pair gives.
    q, k, v, dout = (t.detach().to(device) for t in _inputs(2, 33, 47, 2, 2, 16, torch.float16))
    rng = torch.tensor([123456789, -987654321], dtype=torch.int64, device=device)
    first, _ = _op_forward(q, k, v, rng)
    rng.copy_(torch.tensor([-5, 2**40 + 7], dtype=torch.int64))
    second, lse = _op_forward(q, k, v, rng)
    fresh, _ = _op_forward(q, k, v, torch.tensor([-5, 2**40 + 7], dtype=torch.int64, device=device))
    assert torch.equal(second, fresh)
    assert not torch.equal(first, second)
    grads = _op_backward(dout, q, k, v, second, lse, rng)
    fresh_grads = _op_backward(dout, q, k, v, second, lse, torch.tensor([-5, 2**40 + 7], device=device))
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh_grads))


@pytest.mark.parametrize("device", _DEVICES)
def test_dropout_rng_errors_name_the_argument(device):
    q = torch.randn(1, 8, 1, 16, device=device)
    with pytest.raises(TypeError, match=r"dropout_rng.dtype=int32 must be int64"):
        _op_forward(q, q, q, torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"dropout_rng.shape=\(3,\) must be \(2,\) and contiguous"):
        _op_forward(q, q, q, torch.zeros(3, dtype=torch.int64, device=device))


@CUDA
def test_dropout_in_a_cuda_graph_draws_a_fresh_mask_per_replay():
    # The seed/offset draw and the kernels are captured together; each replay draws a new pair on
    # the device, and the forward and backward of that replay use it: replaying eagerly with the
    # pair the replay drew gives the same output and gradients, bit for bit (deterministic mode).
    q, k, v, dout = (t.detach().cuda() for t in _inputs(2, 100, 130, 4, 2, 64, torch.bfloat16))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (plans, allocator)
        rng = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device="cuda")
        out, lse = _op_forward(q, k, v, rng)
        _op_backward(dout, q, k, v, out, lse, rng)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rng = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device="cuda")
        out, lse = _op_forward(q, k, v, rng)
        grads = _op_backward(dout, q, k, v, out, lse, rng)
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = _op_forward(q, k, v, rng.clone())
        want_grads = _op_backward(dout, q, k, v, want, want_lse, rng.clone())
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        seen.append(out.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


@CUDA
def test_flash_attn_func_with_dropout_captures_into_a_cuda_graph():
    # The public call draws its pair inside the capture (no host copy, no sync) and trains.
    q, k, v, dout = (t.detach().cuda() for t in _inputs(1, 64, 64, 2, 2, 64, torch.float16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tileattn.flash_attn_func(q, k, v, dropout_p=0.25).backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    q.grad = k.grad = v.grad = None
    with torch.cuda.graph(graph):
        out = tileattn.flash_attn_func(q, k, v, dropout_p=0.25)
        out.backward(dout)
    outs, grads = [], []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
        grads.append(q.grad.clone())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(grads[0], grads[1])
    assert all(torch.isfinite(t).all() for t in outs + grads)
