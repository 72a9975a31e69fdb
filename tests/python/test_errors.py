"""Bad input raises the Python exception of its kind, with a message naming the argument and rule:
ValueError (shapes, values, devices), TypeError (dtypes), NotImplementedError (unsupported), each
also a RuntimeError, as flash-attn's and PyTorch's checks raise."""

import math

import pytest
import torch

import tileattn


def qkv(batch=1, seqlen=16, heads=2, d=16, dtype=torch.float32, device="cpu"):
    return [torch.randn(batch, seqlen, heads, d, dtype=dtype, device=device) for _ in range(3)]


def test_meta_tensors_give_shapes_only():
    # Meta tensors go to the fake implementation (shape inference), never to a kernel.
    q, k, v = qkv(heads=4, device="meta")
    out, lse, _ = tileattn.flash_attn_func(q, k[..., :2, :], v[..., :2, :8], return_attn_probs=True)
    assert out.device.type == "meta" and out.shape == (1, 16, 4, 8) and lse.shape == (1, 4, 16)


def test_tensors_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k is on meta but q is on cpu; all tensors must share one device"):
        tileattn.flash_attn_func(q, k.to("meta"), v)
    with pytest.raises(ValueError, match=r"k is on cpu but q is on meta"):
        tileattn.flash_attn_func(q.to("meta"), k, v.to("meta"))


@pytest.mark.gpu
def test_tensors_on_cpu_and_cuda(cuda):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v is on cpu but q is on cuda:\d.*one device"):
        tileattn.flash_attn_func(q.to(cuda), k.to(cuda), v)


def test_cache_with_a_strided_last_dimension_is_refused_by_its_name():
    # Operands that are only read are copied (test_edge_inputs.py); a cache is written in place, so
    # its rows must be contiguous, and the message names it as the caller passed it.
    q, cache = torch.randn(2, 1, 4, 16), torch.randn(2, 12, 2, 16)
    strided = torch.randn(2, 12, 2, 32)[..., ::2]
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^k_cache\.stride\(-1\)=2 must be 1"):
        tileattn.flash_attn_with_kvcache(q, strided, cache, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match=r"^v_cache\.stride\(-1\)=2 must be 1"):
        tileattn.flash_attn_with_kvcache(q, cache, strided, cache_seqlens=seqlens)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"v\.dtype=float16 must equal q\.dtype=float32"):
        tileattn.flash_attn_func(q, k, v.half())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float64], ids=str)
def test_unsupported_dtypes(dtype):
    q, k, v = [t.to(dtype) for t in qkv()]
    with pytest.raises(TypeError, match=r"q\.dtype=\w+ is not supported \(float16, bfloat16 or float32\)"):
        tileattn.flash_attn_func(q, k, v)


def test_integer_softmax_matmul():
    with pytest.raises(TypeError, match=r"x\.dtype=int64 is not supported"):
        tileattn.softmax_matmul(torch.ones(2, 3, 4, dtype=torch.int64), torch.ones(2, 4, 5, dtype=torch.int64))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank(which):
    tensors = dict(zip("qkv", qkv()))
    tensors[which] = tensors[which][0]
    with pytest.raises(ValueError, match=rf"{which} must have 4 dimensions \(batch, seqlen, heads, headdim\)"):
        tileattn.flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


def test_wrong_rank_varlen_and_course_function():
    q, k, v = qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_tokens, heads, headdim\)"):
        tileattn.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16)
    with pytest.raises(ValueError, match=r"Q must have 3 dimensions \(batch, seqlen, headdim\)"):
        tileattn.FlashAttentionFunction.apply(q, k, v, False)
    with pytest.raises(ValueError, match=r"x and v must have at least 2 dimensions"):
        tileattn.softmax_matmul(q.flatten(), v)
    with pytest.raises(ValueError, match=r"v\.shape\[-2\]=2 must equal x\.shape\[-1\]=16 \(d2\)"):
        tileattn.softmax_matmul(q, v)


def test_shape_mismatches_name_the_tensor():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k\.shape=\(1, 16, 2, 8\) must be \(1, 16, 2, 16\)"):
        tileattn.flash_attn_func(q, k[..., :8], v)
    with pytest.raises(ValueError, match=r"v\.shape=\(1, 12, 2, 16\) must be \(1, 16, 2, 16\)"):
        tileattn.flash_attn_func(q, k, v[:, :12])
    with pytest.raises(ValueError, match=r"k\.shape\[0\]=2 must equal q\.shape\[0\]=1 \(batch\)"):
        tileattn.flash_attn_func(q, torch.cat([k, k]), torch.cat([v, v]))


@pytest.mark.parametrize("path", ["python", "library", "operator"])
def test_refusals_are_runtime_errors_of_their_kind(path):
    # Code written against flash-attn or SDPA catches RuntimeError; code written against tileattn
    # catches ValueError or TypeError. Each refusal is both, whichever layer makes it: the Python
    # layer, the library through the eager entry, or the library through torch.ops (compiled graphs).
    q, k, v = qkv(d=16)
    wide = torch.randn(1, 16, 2, 32)
    options = (None, None, 0, 0, None, False, -1, -1, 0.0, False)
    calls = {"python": [(ValueError, lambda: tileattn.flash_attn_func(q, k, v, window_size=(1, 2, 3))),
                        (TypeError, lambda: tileattn.flash_attn_func(q, k.half(), v))],
             "library": [(ValueError, lambda: tileattn.flash_attn_func(q, wide, wide))],
             "operator": [(ValueError, lambda: torch.ops.tileattn.attention_forward(q, wide, wide, *options))]}
    for kind, call in calls[path]:
        with pytest.raises(RuntimeError) as caught:
            call()
        assert isinstance(caught.value, kind), type(caught.value).__mro__
        assert isinstance(caught.value, (tileattn.InvalidArgumentError, tileattn.InvalidTypeError))


def test_library_rules_reach_python():
    q, k, v = qkv(heads=3)
    k2, v2 = qkv(heads=2)[1:]
    with pytest.raises(ValueError, match=r"heads_kv=2 must divide heads_q=3 \(GQA\)"):
        tileattn.flash_attn_func(q, k2, v2)
    with pytest.raises(ValueError, match=r"softmax_scale=nan must be finite"):
        tileattn.flash_attn_func(q, k, v, softmax_scale=math.nan)
    big = torch.randn(1, 4, 1, 264)
    with pytest.raises(NotImplementedError, match=r"headdim_qk=264 exceeds 256"):
        tileattn.flash_attn_func(big, big, big)


@pytest.mark.parametrize("value,text", [(1e40, r"softmax_scale=1e\+40 is outside float32's range"),
                                        (-1e39, r"softmax_scale=-1e\+39 is outside float32's range")])
def test_softmax_scale_outside_float32_is_reported_as_passed(value, text):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=text):
        tileattn.flash_attn_func(q, k, v, softmax_scale=value)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=text):
        tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16, softmax_scale=value)
    sdpa = [t.transpose(1, 2) for t in (q, k, v)]
    with pytest.raises(ValueError, match=text.replace("softmax_scale", "scale")):
        tileattn.scaled_dot_product_attention(*sdpa, scale=value)


def test_softcap_outside_float32_is_reported_as_passed():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softcap=1e\+300 is outside float32's range"):
        tileattn.flash_attn_func(q, k, v, softcap=1e300)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf")], ids=str)
def test_dropout_p_outside_0_1_is_a_value_error(value):
    q, k, v = qkv()
    text = rf"dropout_p={value!r} must be in \[0, 1\]"
    with pytest.raises(ValueError, match=text):
        tileattn.flash_attn_func(q, k, v, dropout_p=value)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=text):
        tileattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16, dropout_p=value)
    with pytest.raises(ValueError, match=text):
        tileattn.scaled_dot_product_attention(*[t.transpose(1, 2) for t in (q, k, v)], dropout_p=value)


@pytest.mark.parametrize("window,text", [((2**70, 0), r"window_size\[0\]=1180591620717411303424 does not fit in int64"),
                                         ((0, -2**64), r"window_size\[1\]=-18446744073709551616 does not fit"),
                                         ((1.5, 0), r"window_size\[0\]=1\.5 must be an integer")], ids=str)
def test_window_outside_int64_names_window_size(window, text):
    q, k, v = qkv()
    with pytest.raises((ValueError, TypeError), match=text) as info:
        tileattn.flash_attn_func(q, k, v, window_size=window)
    assert "Invalid function signature" not in str(info.value) and "nanobind" not in str(info.value)


def test_huge_window_in_int64_masks_nothing():
    # Past every key, a bound is the same as unbounded (the library clamps it).
    q, k, v = qkv()
    assert torch.equal(tileattn.flash_attn_func(q, k, v, window_size=(2**62, 2**62)), tileattn.flash_attn_func(q, k, v))


def test_max_seqlen_outside_int64_is_named():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_k=1180591620717411303424 does not fit in int64"):
        tileattn.flash_attn_varlen_func(q, q, q, cu, cu, 10, 2**70)


def test_varlen_offsets_are_checked():
    q = torch.randn(10, 2, 16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cu_seqlens_q\.dtype=int64 must be int32"):
        tileattn.flash_attn_varlen_func(q, q, q, good.long(), good, 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[2\]=3 is less than cu_seqlens_k\[1\]=4"):
        tileattn.flash_attn_varlen_func(q, q, q, good, torch.tensor([0, 4, 3], dtype=torch.int32), 6, 6)
    with pytest.raises(ValueError, match=r"sequence 1 has length 6 > seqlen_q=5"):
        tileattn.flash_attn_varlen_func(q, q, q, good, good, 5, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\.shape=\(2,\) must be \(3,\)"):
        tileattn.flash_attn_varlen_func(q, q, q, good, good[:2], 6, 6)


def test_sdpa_refusals_name_the_rule():
    q, k, v = qkv()
    sdpa = [t.transpose(1, 2) for t in (q, k, v)]
    with pytest.raises(ValueError, match=r"attn_mask and is_causal=True: pass one mask, not both"):
        tileattn.scaled_dot_product_attention(*sdpa, attn_mask=torch.ones(16, 16, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match=r"scale=nan must be finite"):
        tileattn.scaled_dot_product_attention(*sdpa, scale=float("nan"))
    with pytest.raises(ValueError, match=r"must have at least 2 dimensions"):
        tileattn.scaled_dot_product_attention(sdpa[0].flatten(), *sdpa[1:])


def test_sdpa_heads_mismatch_without_enable_gqa():
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"query has 4 heads but key/value have 2; pass enable_gqa=True"):
        tileattn.scaled_dot_product_attention(q, kv, kv)


@pytest.mark.parametrize("exc", [ValueError, TypeError])
def test_backward_errors_do_not_corrupt_autograd(exc):
    # A rejected call leaves no graph behind: the next valid call differentiates normally.
    q, k, v = [t.requires_grad_() for t in qkv()]
    bad_k = k.detach()[..., :8] if exc is ValueError else k.detach().half()
    with pytest.raises(exc):
        tileattn.flash_attn_func(q, bad_k, v)
    out = tileattn.flash_attn_func(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_check_cu_seqlens_takes_a_bool():
    with pytest.raises(TypeError, match=r"enabled='no' must be a bool"):
        tileattn.check_cu_seqlens("no")
    tileattn.check_cu_seqlens(False)  # the default, left as it was
