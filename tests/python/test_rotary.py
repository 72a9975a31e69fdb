"""tileattn.layers.rotary against flash-attn's semantics: every result compared with a float64
reference that multiplies each token by its explicit rotation matrix (2x2 blocks on the pairs
(i, i + rotary_dim / 2), or (2i, 2i + 1) interleaved, the identity past rotary_dim); the
RotaryEmbedding tables against their closed form; gradients by gradcheck; agreement with
flash_attn_with_kvcache's own rotary; the argument errors."""

import math

import pytest
import torch

import tileattn
from tileattn.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,
                                    apply_rotary_emb_qkv_)


def tables(rows, half, dtype=torch.float64):
    angle = torch.rand(rows, half, dtype=torch.float64) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotation(cos_row, sin_row, headdim, interleaved):
    """(headdim, headdim) float64: pair i turned by the angle (cos_row[i], sin_row[i])."""
    half = cos_row.shape[0]
    r = torch.eye(headdim, dtype=torch.float64)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = float(cos_row[i]), float(sin_row[i])
        r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    return r


def reference(x, cos, sin, positions, interleaved):
    """x (tokens, heads, d) in float64, token t turned at positions[t] (None: left as it is)."""
    out = x.double().clone()
    for t, p in enumerate(positions):
        if p is not None:
            out[t] = x[t].double() @ rotation(cos[p].double(), sin[p].double(), x.shape[-1], interleaved).T
    return out


def batch_reference(x, cos, sin, offsets, interleaved):
    batch, seqlen = x.shape[:2]
    positions = [int(offsets[b]) + s for b in range(batch) for s in range(seqlen)]
    return reference(x.flatten(0, 1), cos, sin, positions, interleaved).view(x.shape)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("half", [8, 3], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("offset", [0, 5])
def test_each_pair_turns_by_its_positions_angle(interleaved, half, dtype, offset):
    x = torch.randn(2, 6, 3, 16, dtype=dtype)
    cos, sin = tables(12, half, dtype)
    before = x.clone()
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset)
    want = batch_reference(x, cos, sin, [offset] * 2, interleaved)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    assert out.dtype == dtype and torch.equal(x, before)


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_offset_tensor_moves_each_sequence_by_its_own_offset(offset_dtype, interleaved):
    batch, seqlen, rows = 4, 5, 16
    x = torch.randn(batch, seqlen, 2, 10, dtype=torch.float64)
    cos, sin = tables(rows, 4)
    offsets = torch.randint(0, rows - seqlen + 1, (batch,), dtype=offset_dtype)
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    torch.testing.assert_close(out, batch_reference(x, cos, sin, offsets.tolist(), interleaved), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_varlen_turns_each_sequence_from_its_start_and_leaves_other_tokens(offsets, interleaved):
    lengths = [3, 0, 5, 2]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1]) + 2  # two tokens that no sequence covers
    x = torch.randn(total, 2, 12, dtype=torch.float64)
    cos, sin = tables(9, 5)
    offs = torch.randint(0, 4, (4,)) if offsets == "tensor" else 2
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=max(lengths))
    positions = []
    for b, n in enumerate(lengths):
        start = int(offs[b]) if offsets == "tensor" else offs
        positions += [start + s for s in range(n)]
    positions += [None, None]
    torch.testing.assert_close(out, reference(x, cos, sin, positions, interleaved), rtol=1e-12, atol=1e-12)


def test_inplace_writes_into_x_and_returns_it():
    buffer = torch.randn(2, 7, 3, 8)
    x = buffer[:, :, :2]  # a strided view: the head outside it must stay as it was
    cos, sin = tables(7, 3, torch.float32)
    want = apply_rotary_emb(x, cos, sin, interleaved=True)
    outside = buffer[:, :, 2].clone()
    out = apply_rotary_emb(x, cos, sin, interleaved=True, inplace=True)
    assert out is x and torch.equal(x, want) and torch.equal(buffer[:, :, 2], outside)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rounds_the_tables_to_x_and_the_result_once(dtype):
    # float32 tables are rounded to x's dtype (as flash-attn takes them), the arithmetic is float32,
    # so the result is the exact rotation of the rounded operands within one rounding.
    x = torch.randn(2, 8, 4, 32).to(dtype)
    cos, sin = tables(8, 16, torch.float32)
    out = apply_rotary_emb(x, cos, sin)
    want = batch_reference(x, cos.to(dtype), sin.to(dtype), [0, 0], False)
    eps = torch.finfo(dtype).eps
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=eps, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("form", ["offset_tensor", "varlen", "inplace"])
def test_gradients_in_x_and_the_tables(interleaved, form):
    cos, sin = (t.requires_grad_() for t in tables(7, 2))
    if form == "varlen":
        x = torch.randn(6, 2, 6, dtype=torch.float64, requires_grad=True)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        fn = lambda x, c, s: apply_rotary_emb(x, c, s, interleaved, seqlen_offsets=torch.tensor([3, 1]),  # noqa: E731
                                              cu_seqlens=cu, max_seqlen=4)
        torch.autograd.gradcheck(fn, (x, cos, sin))
        return
    x = torch.randn(2, 3, 2, 6, dtype=torch.float64, requires_grad=True)
    if form == "offset_tensor":
        torch.autograd.gradcheck(
            lambda x, c, s: apply_rotary_emb(x, c, s, interleaved, seqlen_offsets=torch.tensor([4, 0])), (x, cos, sin))
    else:
        # Written in place, x's gradient still flows (the tables', read before the write, too).
        torch.autograd.gradcheck(lambda x: apply_rotary_emb(x.clone(), cos.detach(), sin.detach(), interleaved,
                                                            inplace=True, seqlen_offsets=1), (x,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rotary_embedding_tables_are_the_closed_form_angles(dtype):
    dim, base, seqlen = 12, 500.0, 9
    module = RotaryEmbedding(dim, base=base)
    module(torch.randn(2, seqlen, 3, 2, 16, dtype=dtype))
    p = torch.arange(seqlen, dtype=torch.float64)[:, None]
    i = torch.arange(dim // 2, dtype=torch.float64)
    angle = p * base ** (-2 * i / dim)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert module._cos_cached.dtype == dtype and module._cos_cached.shape == (seqlen, dim // 2)
    torch.testing.assert_close(module._cos_cached.double(), angle.cos(), rtol=0, atol=tol)
    torch.testing.assert_close(module._sin_cached.double(), angle.sin(), rtol=0, atol=tol)


def test_rotary_embedding_takes_flash_attns_arguments_in_order():
    module = RotaryEmbedding(8, 100.0, True, None, False, "cpu")
    assert (module.base, module.interleaved, module.scale_base, module.pos_idx_in_fp32) == (100.0, True, None, False)
    assert module.inv_freq.device.type == "cpu" and module.inv_freq.dtype == torch.float32
    assert RotaryEmbedding(8, pos_idx_in_fp32=True).pos_idx_in_fp32


@pytest.mark.parametrize("pos_idx_in_fp32", [True, False])
def test_rotary_embedding_positions_in_fp32_or_in_the_buffers_dtype(pos_idx_in_fp32):
    # A module cast to bf16 (its inv_freq buffer with it), as a bf16 model is: with pos_idx_in_fp32
    # the angles come from exact positions and float32 frequencies, without it from bf16 ones
    # (positions past 256 rounded to even), as flash-attn's.
    dim, seqlen = 16, 600
    module = RotaryEmbedding(dim, pos_idx_in_fp32=pos_idx_in_fp32).to(torch.bfloat16)
    assert module.inv_freq.dtype == torch.bfloat16
    module(torch.randn(1, seqlen, 3, 1, dim, dtype=torch.bfloat16))
    p = torch.arange(seqlen, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-2 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    exact = p * inv_freq
    # Without it: bf16 positions times bf16 frequencies, each product rounded to bf16.
    angle = exact if pos_idx_in_fp32 else (p.bfloat16() * inv_freq.float().bfloat16()).double()
    assert module._cos_cached.dtype == torch.bfloat16
    cos = module._cos_cached.double()
    torch.testing.assert_close(cos, angle.cos().bfloat16().double(), rtol=0, atol=2 ** -8)
    torch.testing.assert_close(module._sin_cached.double(), angle.sin().bfloat16().double(), rtol=0, atol=2 ** -8)
    assert ((cos - exact.cos()).abs().max() > 0.05) == (not pos_idx_in_fp32)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rotary_embedding_turns_q_and_k_in_place_and_leaves_v(interleaved):
    module = RotaryEmbedding(8, interleaved=interleaved)
    qkv = torch.randn(2, 5, 3, 2, 12, dtype=torch.float64)
    before = qkv.clone()
    out = module(qkv, seqlen_offset=3)
    assert out is qkv
    cos, sin = module._cos_cached, module._sin_cached
    assert cos.shape == (8, 4)  # built for seqlen_offset + seqlen positions
    for j in (0, 1):
        torch.testing.assert_close(qkv[:, :, j], batch_reference(before[:, :, j], cos, sin, [3, 3], interleaved),
                                   rtol=1e-12, atol=1e-12)
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])


def test_rotary_scores_depend_only_on_the_distance_and_keep_norms():
    dim, seqlen = 16, 10
    q, k = torch.randn(2, dim, dtype=torch.float64)
    qkv = torch.stack([q, k, torch.zeros(dim, dtype=torch.float64)])[:, None].expand(1, seqlen, 3, 1, dim).contiguous()
    RotaryEmbedding(dim)(qkv)
    qr, kr = qkv[0, :, 0, 0], qkv[0, :, 1, 0]
    scores = qr @ kr.T
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm().expand(seqlen), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scores[0, 1], scores[0, 2])  # ... and do depend on it


def test_xpos_scales_q_up_and_k_down_by_the_position_power():
    dim, scale_base, seqlen = 8, 16.0, 6
    module = RotaryEmbedding(dim, scale_base=scale_base)
    qkv = torch.randn(1, seqlen, 3, 1, dim, dtype=torch.float64)
    before = qkv.clone()
    module(qkv)
    p = torch.arange(seqlen, dtype=torch.float64)[:, None]
    i = torch.arange(dim // 2, dtype=torch.float64)
    angle = p * 10000.0 ** (-2 * i / dim)
    zeta = ((2 * i + 0.4 * dim) / (1.4 * dim)) ** ((p - seqlen // 2) / scale_base)
    turned = [batch_reference(before[:, :, j], angle.cos(), angle.sin(), [0], False) for j in (0, 1)]
    factor = torch.cat([zeta, zeta], dim=-1)[None, :, None, :]  # pair i is (i, i + dim / 2)
    torch.testing.assert_close(qkv[:, :, 0], turned[0] * factor, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(qkv[:, :, 1], turned[1] / factor, rtol=1e-10, atol=1e-10)


def test_qkv_with_gqa_heads_turns_q_and_k_heads_only():
    heads_q, heads_k = 4, 2
    qkv = torch.randn(2, 5, heads_q + 2 * heads_k, 8, dtype=torch.float64)
    before = qkv.clone()
    cos, sin = tables(7, 3)
    cos_k, sin_k = tables(7, 3)
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=2, num_heads_q=heads_q)
    assert out is qkv
    torch.testing.assert_close(qkv[:, :, :heads_q], batch_reference(before[:, :, :heads_q], cos, sin, [2, 2], False))
    torch.testing.assert_close(qkv[:, :, heads_q:heads_q + heads_k],
                               batch_reference(before[:, :, heads_q:heads_q + heads_k], cos_k, sin_k, [2, 2], False))
    assert torch.equal(qkv[:, :, heads_q + heads_k:], before[:, :, heads_q + heads_k:])


def test_kv_form_turns_k_and_leaves_v():
    kv = torch.randn(3, 4, 2, 2, 6, dtype=torch.float64)
    before = kv.clone()
    cos, sin = tables(9, 3)
    offsets = torch.tensor([0, 5, 2])
    assert apply_rotary_emb_kv_(kv, cos, sin, interleaved=True, seqlen_offsets=offsets) is kv
    torch.testing.assert_close(kv[:, :, 0], batch_reference(before[:, :, 0], cos, sin, offsets, True))
    assert torch.equal(kv[:, :, 1], before[:, :, 1])


def test_rotary_embedding_with_kv_and_an_offset_tensor():
    module = RotaryEmbedding(6)
    q = torch.randn(2, 3, 2, 6, dtype=torch.float64)
    kv = torch.randn(2, 3, 2, 2, 6, dtype=torch.float64)
    q_before, kv_before = q.clone(), kv.clone()
    offsets = torch.tensor([4, 1])
    q_out, kv_out = module(q, kv, seqlen_offset=offsets, max_seqlen=7)
    assert q_out is q and kv_out is kv and module._cos_cached.shape == (7, 3)
    cos, sin = module._cos_cached, module._sin_cached
    torch.testing.assert_close(q, batch_reference(q_before, cos, sin, offsets, False))
    torch.testing.assert_close(kv[:, :, 0], batch_reference(kv_before[:, :, 0], cos, sin, offsets, False))
    assert torch.equal(kv[:, :, 1], kv_before[:, :, 1])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("half", [8, 5], ids=["full_dim", "partial_dim"])
def test_kvcache_rotary_equals_rotating_q_and_k_first(interleaved, causal, half):
    batch, seqlen_q, seqlen_new, heads, d, capacity = 3, 3, 3, 2, 16, 12
    q = torch.randn(batch, seqlen_q, heads, d)
    k, v = torch.randn(2, batch, seqlen_new, heads, d)
    k_cache, v_cache = torch.randn(2, batch, capacity, heads, d)
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), dtype=torch.int32)
    cos, sin = tables(capacity, half, torch.float32)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    out = tileattn.flash_attn_with_kvcache(q, *caches[0], k, v, cos, sin, cache_seqlens=lengths, causal=causal,
                                           rotary_interleaved=interleaved)
    k_rot = apply_rotary_emb(k, cos, sin, interleaved, seqlen_offsets=lengths)
    if causal:
        q_rot = apply_rotary_emb(q, cos, sin, interleaved, seqlen_offsets=lengths)
    else:
        # Not causal: every query of row b is at position cache_seqlens[b] (one position, all heads).
        q_rot = apply_rotary_emb(q.reshape(batch, 1, seqlen_q * heads, d), cos, sin, interleaved,
                                 seqlen_offsets=lengths).view(q.shape)
    want = tileattn.flash_attn_with_kvcache(q_rot, *caches[1], k_rot, v, cache_seqlens=lengths, causal=causal)
    torch.testing.assert_close(caches[0][0], caches[1][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_compiled_rotary_matches_eager():
    x = torch.randn(2, 5, 2, 8)
    cos, sin = tables(9, 3, torch.float32)
    offsets = torch.tensor([1, 4])
    fn = lambda x, c, s, o: (apply_rotary_emb(x, c, s, seqlen_offsets=o),  # noqa: E731
                             apply_rotary_emb(x, c, s, interleaved=True, seqlen_offsets=2))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, cos, sin, offsets), fn(x, cos, sin, offsets)):
        assert torch.equal(got, want)


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(2, 5, 2, 8)
    cos, sin = tables(6, 3, torch.float32)
    err, typ = tileattn.InvalidArgumentError, tileattn.InvalidTypeError
    with pytest.raises(err, match=r"rotary_dim=2 \* cos.shape\[1\]=10 must be at most headdim=x.shape\[-1\]=8"):
        apply_rotary_emb(x, *tables(6, 5, torch.float32))
    with pytest.raises(err, match=r"sin.shape=\(6, 2\) must equal cos.shape=\(6, 3\)"):
        apply_rotary_emb(x, cos, sin[:, :2])
    with pytest.raises(err, match=r"cos must be 2-D \(seqlen_ro, rotary_dim / 2\)"):
        apply_rotary_emb(x, cos[None], sin)
    with pytest.raises(err, match=r"seqlen_offsets \+ seqlen = 2 \+ 5 must be at most cos.shape\[0\]=6"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
    with pytest.raises(err, match=r"seqlen_offsets=-1 must be >= 0"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=-1)
    with pytest.raises(err, match=r"seqlen_offsets\[b\] \+ sequence b's length at most cos.shape\[0\]=6"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 2]))
    with pytest.raises(err, match=r"seqlen_offsets.shape=\(3,\) must be \(batch,\)=\(2,\)"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 0, 0]))
    with pytest.raises(typ, match=r"seqlen_offsets.dtype=float32 must be int32 or int64"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.zeros(2))
    with pytest.raises(typ, match=r"x.dtype=int64 must be a floating type"):
        apply_rotary_emb(x.long(), cos, sin)
    with pytest.raises(typ, match=r"cos.dtype=int64 must be a floating type"):
        apply_rotary_emb(x, cos.long(), sin)
    with pytest.raises(err, match=r"x must have 4 dimensions \(batch, seqlen, heads, headdim\)"):
        apply_rotary_emb(x[0], cos, sin)
    packed = x.flatten(0, 1)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(err, match=r"max_seqlen is needed with cu_seqlens"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=cu)
    with pytest.raises(err, match=r"x must have 3 dimensions \(total_tokens, heads, headdim\) with cu_seqlens"):
        apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=6)
    with pytest.raises(err, match=r"each step \(a sequence's length\) at most max_seqlen=5"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=cu, max_seqlen=5)
    with pytest.raises(err, match=r"cu_seqlens must rise from >= 0 to at most x.shape\[0\]=10"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=torch.tensor([0, 6, 4], dtype=torch.int32), max_seqlen=6)
    with pytest.raises(err, match=r"seqlen_offsets \+ max_seqlen = 1 \+ 6 must be at most cos.shape\[0\]=6"):
        apply_rotary_emb(packed, cos, sin, cu_seqlens=cu, max_seqlen=6, seqlen_offsets=1)
    with pytest.raises(err, match=r"num_heads_q is needed for a 4-D qkv"):
        apply_rotary_emb_qkv_(torch.randn(2, 5, 6, 8), cos, sin)
    with pytest.raises(err, match=r"qkv.shape\[2\]=5 must be num_heads_q \+ 2 \* num_heads_k"):
        apply_rotary_emb_qkv_(torch.randn(2, 5, 5, 8), cos, sin, num_heads_q=2)
    with pytest.raises(err, match=r"kv must be \(batch, seqlen, 2, heads, headdim\)"):
        apply_rotary_emb_kv_(torch.randn(2, 5, 3, 2, 8), cos, sin)
    with pytest.raises(err, match=r"dim=7 must be even and > 0"):
        RotaryEmbedding(7)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_gpu_rotation_matches_the_cpu(cuda, interleaved):
    x = torch.randn(3, 6, 2, 16)
    cos, sin = tables(10, 6, torch.float32)
    offsets = torch.tensor([0, 4, 2])
    want = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    got = apply_rotary_emb(x.to(cuda), cos.to(cuda), sin.to(cuda), interleaved, seqlen_offsets=offsets.to(cuda))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
