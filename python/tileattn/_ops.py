"""The torch.library operators every public function goes through.

Three operators, each with a fake (meta) implementation and, where it has a gradient, an autograd
formula, so that torch.compile(fullgraph=True) traces forward and backward without graph breaks:

- ``tileattn::attention_forward``  -> (out, lse)
- ``tileattn::attention_backward`` -> (dq, dk, dv)
- ``tileattn::softmax_matmul``     -> out

Tensors use flash-attn's layout: (batch, seqlen, heads, headdim), or (total_tokens, heads, headdim)
when ``cu_seqlens_q``/``cu_seqlens_k`` describe a variable-length batch. Any strides are accepted;
an operand whose last dimension is not contiguous is copied once (the library reads rows). Outputs
and workspaces are allocated with torch, so the caching allocator and CUDA-graph capture see every
byte, and kernels run on the current stream.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import warnings
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.utils.dlpack
from torch import Tensor

from .errors import InvalidArgumentError, InvalidTypeError
from . import _ext


def _load_torch_ops():
    """The PyTorch operator library, tileattn._torch_ops (python/src/torch_ops.cpp): both attention
    operators with their CPU, CUDA and Autograd kernels in C++, built against the PyTorch present
    when the package was built. None where it was not built, where it does not load (another PyTorch
    since), or where TILEATTN_TORCH_OPS=0 asks for the Python registration below; that one computes
    the same results over _ext, at a higher host cost per call."""
    if os.environ.get("TILEATTN_TORCH_OPS", "1") == "0":
        return None
    try:
        from . import _torch_ops as module
    except ModuleNotFoundError:
        return None  # built without it
    except (ImportError, OSError) as e:
        warnings.warn(f"tileattn: the PyTorch operator library did not load ({e}); the operators are "
                      "registered in Python instead, which costs more host time per call", RuntimeWarning)
        return None
    return module


_torch_ops = _load_torch_ops()

__all__ = ["attention_forward", "attention_backward", "softmax_matmul", "attention"]

_SUPPORTED_DEVICES = ("cpu", "cuda")


_to_dlpack = getattr(torch._C, "_to_dlpack", torch.utils.dlpack.to_dlpack)


def _capsule(t: Tensor):
    # to_dlpack never synchronises streams: `__dlpack__()` may make the legacy default stream wait
    # on the current one, which is both a needless dependency and illegal under graph capture. It
    # exports a tensor that requires grad as it is (only `__dlpack__` refuses those), so no
    # detach() -- which costs more than the export itself.
    return _to_dlpack(t)


def _check_device(t: Tensor, name: str) -> None:
    if t.device.type not in _SUPPORTED_DEVICES:
        raise InvalidArgumentError(f"{name} is on {t.device}; tileattn runs on cpu and cuda tensors")


# torch.cuda.current_stream() and torch.cuda.device() build Python objects on every call (about
# 10 us each on an H100 host, as much as a short sequence's kernel); the raw accessors below, which
# torch's own compiled code uses, return the same stream handle and device index directly.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _device_context(device: torch.device):
    if device.type != "cuda" or (_current_device is not None and device.index == _current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _stream(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    if _raw_stream is not None and device.index is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


# Device cu_seqlens are checked against their rules only on request: reading them on the host
# copies them back and synchronises the stream on every call. Unchecked, offsets that break the
# rules give unspecified values but never an access outside the tensors (the kernels clamp).
_checks = {"cu_seqlens": False}


def check_cu_seqlens(enabled: bool = True) -> None:
    """Check CUDA ``cu_seqlens`` on the host at every varlen call (one copy and stream sync each),
    and likewise the key/value cache tables of ``flash_attn_with_kvcache`` and of paged
    ``flash_attn_varlen_func`` (cache lengths, batch indices, left padding, page tables).

    Off by default. CPU tables are always checked (they need no copy); while a CUDA graph is
    being captured the check is skipped.
    """
    if not isinstance(enabled, (bool, int)):  # bool("no") would switch it on
        raise InvalidTypeError(f"enabled={enabled!r} must be a bool")
    _checks["cu_seqlens"] = bool(enabled)
    if _torch_ops is not None:
        _torch_ops.set_check_cu_seqlens(bool(enabled))


def _num_threads(device: torch.device) -> int:
    return torch.get_num_threads() if device.type == "cpu" else 0


# The raw getters behind torch.get_float32_matmul_precision() and
# torch.backends.cuda.matmul.allow_tf32; the latter goes through a module __getattr__ that costs
# more than the rest of this check.
_matmul_precision = getattr(torch._C, "_get_float32_matmul_precision", torch.get_float32_matmul_precision)
_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32)


def _fp32_fast(t: Tensor) -> bool:
    # PyTorch's own switch for fp32 matmuls, read at each call: "high" or "medium" precision (or
    # allow_tf32) lets fp32 inputs use tensor cores (TF32); "highest" keeps exact fp32 products.
    # The CPU backend computes fp32 exactly either way.
    return t.dtype == torch.float32 and (_matmul_precision() != "highest" or _allow_tf32())


def _workspace(nbytes: int, device: torch.device) -> Optional[Tensor]:
    return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > 0 else None


def _lse_shape(q: Tensor, varlen: bool) -> tuple:
    # (batch, heads, seqlen_q) like flash-attn; (heads, total_q) for a variable-length batch.
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _empty_like(like: Tensor, last: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A tensor shaped as ``like`` but for its last dimension, laid out as ``like`` is: the other
    dimensions in the order of their strides (flash-attn allocates with empty_like, and PyTorch's
    SDPA returns the query's layout), the last one contiguous; plain contiguous where ``like`` is
    expanded or in the usual order. torch_ops.cpp's empty_like_layout, the same rule (the fake
    kernels use this one for both)."""
    strides = like.stride()[:-1]
    shape = (*like.shape[:-1], last)
    dtype = like.dtype if dtype is None else dtype
    order = sorted(range(len(strides)), key=lambda d: -strides[d])  # stable: ties keep their order
    if 0 in strides or order == sorted(order):
        return like.new_empty(shape, dtype=dtype)
    order.append(len(strides))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return like.new_empty([shape[d] for d in order], dtype=dtype).permute(inverse)


def _check_same_device(named: dict) -> None:
    # The fake (meta) implementations check this too, so torch.compile reports it at trace time.
    tensors = [(name, t) for name, t in named.items() if t is not None]
    first_name, first = tensors[0]
    for name, t in tensors[1:]:
        if t.device != first.device:
            raise InvalidArgumentError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                                       "all tensors must share one device")


def _check_rank(t: Tensor, name: str, rank: int, dims: str) -> None:
    # Ranks are checked before outputs are shaped from them; the extension checks the rest.
    if t.dim() != rank:
        raise InvalidArgumentError(f"{name} must have {rank} dimensions {dims}, got shape {tuple(t.shape)}")


def _check_attention_ranks(q: Tensor, k: Tensor, v: Tensor, varlen: bool) -> None:
    rank, dims = (3, "(total_tokens, heads, headdim)") if varlen else (4, "(batch, seqlen, heads, headdim)")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_rank(t, name, rank, dims)


def _make_options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                  fp32_fast, num_threads, check_cu_seqlens, num_splits=0, dropout_p=0.0, dropout_seed=0,
                  dropout_offset=0, partial_keys=False, rotary_interleaved=True):
    o = _ext.Options()
    o.max_seqlen_q, o.max_seqlen_k, o.softmax_scale, o.causal = max_seqlen_q, max_seqlen_k, softmax_scale, causal
    o.window_left, o.window_right, o.softcap, o.deterministic = window_left, window_right, softcap, deterministic
    o.fp32_fast, o.num_threads, o.check_cu_seqlens = fp32_fast, num_threads, check_cu_seqlens
    o.num_splits = num_splits
    o.dropout_p, o.dropout_seed, o.dropout_offset = dropout_p, dropout_seed, dropout_offset
    o.partial_keys = partial_keys
    o.rotary_interleaved = rotary_interleaved
    return o


# One options object per distinct set (a model calls attention with a handful), built once and
# shared: never modified after it is made. Calls with dropout build their own (a fresh seed each).
_options = functools.lru_cache(maxsize=256)(_make_options)


# The cached options are extension objects: release them before the extension's own teardown,
# which otherwise reports them as leaked.
atexit.register(_options.cache_clear)


_UINT64_MASK = 2**64 - 1


def dropout_seed_offset(rng: Optional[Tensor]) -> tuple[int, int]:
    """The (seed, offset) pair of src/common/philox.hpp's mask rule from a dropout_rng tensor (two
    int64 values drawn per call; their bits read as uint64), read back to the host (a device
    tensor waits for its stream). None gives (0, 0)."""
    if rng is None:
        return 0, 0
    seed, offset = rng.tolist()
    return seed & _UINT64_MASK, offset & _UINT64_MASK


def _attention(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
               causal, window_left, window_right, softcap, deterministic, grads=None, alibi_slopes=None,
               dropout_p=0.0, dropout_rng=None, partial_keys=False, softmax_stats=None, dlse=None):
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"),
                    (alibi_slopes, "alibi_slopes"), (dropout_rng, "dropout_rng"), (dlse, "dlse")):
        if t is not None:
            _check_device(t, name)
    options = _options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                       deterministic, _fp32_fast(q), _num_threads(q.device), _checks["cu_seqlens"], 0, dropout_p,
                       partial_keys=partial_keys)
    cu_q, cu_k = _optional_capsule(cu_seqlens_q), _optional_capsule(cu_seqlens_k)
    alibi, rng = _optional_capsule(alibi_slopes), _optional_capsule(dropout_rng)
    stats = _stats_capsule(softmax_stats, _capsule)
    if grads is None:
        return _ext.Attention(_capsule(q), _capsule(k), _capsule(v), _capsule(out), _capsule(lse), cu_q, cu_k,
                              options, alibi_slopes=alibi, dropout_rng=rng, softmax_stats=stats)
    dout, dq, dk, dv = grads
    return _ext.Attention(_capsule(q), _capsule(k), _capsule(v), _capsule(out), _capsule(lse), cu_q, cu_k, options,
                          _capsule(dout), _capsule(dq), _capsule(dk), _capsule(dv), alibi_slopes=alibi,
                          dropout_rng=rng, softmax_stats=stats, dlse=_optional_capsule(dlse))


def _stats_capsule(softmax_stats: Optional[Tensor], capsule):
    """The forward's row statistics for the extension: attention_forward_stats' third output, which
    is empty where that forward hands none over (torch_ops.cpp's hands_stats: fp32 on CUDA)."""
    return None if softmax_stats is None or softmax_stats.numel() == 0 else capsule(softmax_stats)


def _new_stats(lse: Tensor, q: Tensor) -> Tensor:
    """Room for the forward's row statistics (problem.hpp's softmax_stats), or an empty tensor."""
    if q.dtype == torch.float32 and q.is_cuda:
        return torch.empty(*lse.shape, 2, dtype=torch.float32, device=lse.device)
    return lse.new_empty(0)


# The unchecked calls below (_forward_impl, _backward_impl) are a tiny call's whole host cost, so
# they do no Python-side check: the extension checks every rule, and whatever it refuses (or any
# other surprise before the run) is done again by the checked path, which raises what it always
# raised, in its order.


def _call_options(q: Tensor, cuda: bool, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                  window_right, softcap, deterministic, dropout_p, partial_keys=False):
    return _options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                    deterministic, _fp32_fast(q), 0 if cuda else torch.get_num_threads(), _checks["cu_seqlens"], 0,
                    dropout_p, partial_keys=partial_keys)


def _optional_capsule(t: Optional[Tensor]):
    return None if t is None else _to_dlpack(t)


def _plan_and_run(call, plan, cuda: bool, device: torch.device) -> bool:
    """Plans `call` (plan: its plan_forward or plan_backward) and runs it with the workspace the
    plan asks for. False, having run nothing, where planning raised (the checked path redoes it)."""
    try:
        if cuda:
            with _device_context(device):
                nbytes = plan(_stream(device))
        else:
            nbytes = plan(0)
    except Exception:
        return False
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
    if cuda:
        with _device_context(device):
            call.run(workspace)
    else:
        call.run(workspace)
    return True


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                  softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                  softcap: float, deterministic: bool,
                  alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                  dropout_rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Forward: returns (out, lse). ``deterministic`` is only carried to the backward. With
    ``dropout_p`` > 0, ``dropout_rng`` (int64 (2,), on q's device) holds the call's seed and offset."""
    return _forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng)[:2]


def _forward_stats_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_left, window_right, softcap, deterministic, alibi_slopes=None, dropout_p=0.0,
                        dropout_rng=None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: (out, lse, the row statistics it hands to the backward: empty where it hands none)."""
    return _forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng,
                         stats=True)


def _forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng,
                  stats: bool = False):
    cuda = q.is_cuda
    try:
        dtype, device = q.dtype, q.device
        # Sizes as separate arguments: torch.empty parses them faster than a tuple.
        out = _empty_like(q, v.shape[-1])
        if cu_seqlens_q is None:
            batch, seqlen, heads, _ = q.shape
            lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device=device)
        else:
            total, heads, _ = q.shape
            lse = torch.empty(heads, total, dtype=torch.float32, device=device)
        row_stats = _new_stats(lse, q) if stats else None
        options = _call_options(q, cuda, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                                window_right, softcap, deterministic, dropout_p)
        call = _ext.Attention(_to_dlpack(q), _to_dlpack(k), _to_dlpack(v), _to_dlpack(out), _to_dlpack(lse),
                              _optional_capsule(cu_seqlens_q), _optional_capsule(cu_seqlens_k), options,
                              alibi_slopes=_optional_capsule(alibi_slopes),
                              dropout_rng=_optional_capsule(dropout_rng),
                              softmax_stats=_stats_capsule(row_stats, _to_dlpack))
    except Exception:
        pass
    else:
        if _plan_and_run(call, call.plan_forward, cuda, device):
            return out, lse, row_stats
    return _checked_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng,
                            stats)


def _rows_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    """flash-attn's entries (maybe_contiguous) and PyTorch's SDPA take operands of any strides; the
    library reads rows, so a last dimension that is not contiguous is copied once (torch_ops.cpp's
    rows_contiguous)."""
    return t.contiguous() if t is not None and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1 else t


def _checked_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p, dropout_rng,
                     stats=False):
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    _check_device(q, "q")
    varlen = cu_seqlens_q is not None
    _check_attention_ranks(q, k, v, varlen)
    out = _empty_like(q, v.shape[-1])
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    row_stats = _new_stats(lse, q) if stats else None
    call = _attention(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal, window_left, window_right, softcap, deterministic, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p, dropout_rng=dropout_rng, softmax_stats=row_stats)
    with _device_context(q.device):
        call.run(_workspace(call.plan_forward(_stream(q.device)), q.device))
    return out, lse, row_stats


def cache_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                  max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                  window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                  seqused_k: Optional[Tensor], leftpad_k: Optional[Tensor], kv_batch_idx: Optional[Tensor],
                  block_table: Optional[Tensor], num_splits: int, k_new: Optional[Tensor] = None,
                  v_new: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                  rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = True) -> tuple[Tensor, Tensor]:
    """A forward over keys in a cache (seqused_k, leftpad_k, kv_batch_idx, block_table, and the
    append of k_new, v_new with the rotary embedding: problem.hpp's key/value cache fields): returns
    (out, lse). Every rule is checked before anything runs, so a refused call leaves the cache as it
    was. Inference only: nothing is recorded for autograd. Under torch.compile it is the
    ``tileattn::cache_forward`` operator, which mutates k and v."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, seqused_k, leftpad_k, kv_batch_idx, block_table, num_splits, k_new,
            v_new, rotary_cos, rotary_sin, bool(rotary_interleaved))
    if _is_compiling():
        return torch.ops.tileattn.cache_forward(*args)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_device(t, name)  # the other tensors are checked against q's device by the binding
    if _torch_ops is not None:
        return _torch_ops.cache_forward(*args)
    return _cache_forward_impl(*args)


def _cache_forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_left, window_right, softcap, alibi_slopes, seqused_k, leftpad_k, kv_batch_idx,
                        block_table, num_splits, k_new=None, v_new=None, rotary_cos=None, rotary_sin=None,
                        rotary_interleaved=True):
    # The operator's CPU and CUDA kernel where the operator library is not loaded.
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"), (alibi_slopes, "alibi_slopes"),
                    (seqused_k, "seqused_k"), (leftpad_k, "leftpad_k"), (kv_batch_idx, "kv_batch_idx"),
                    (block_table, "block_table"), (k_new, "k_new"), (v_new, "v_new"), (rotary_cos, "rotary_cos"),
                    (rotary_sin, "rotary_sin")):
        if t is not None:
            _check_device(t, name)  # DLPack export of another device's tensor fails less clearly
    varlen = cu_seqlens_q is not None
    _check_rank(q, "q", 3 if varlen else 4, "(total_tokens, heads, headdim)" if varlen else
                "(batch, seqlen, heads, headdim)")
    q, k_new, v_new = _rows_contiguous(q), _rows_contiguous(k_new), _rows_contiguous(v_new)  # not the caches
    out = _empty_like(q, v.shape[-1])
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    options = _options(max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, False,
                       _fp32_fast(q), _num_threads(q.device), _checks["cu_seqlens"], num_splits,
                       rotary_interleaved=bool(rotary_interleaved))
    cap = lambda t: None if t is None else _capsule(t)  # noqa: E731
    call = _ext.Attention(_capsule(q), _capsule(k), _capsule(v), _capsule(out), _capsule(lse), cap(cu_seqlens_q),
                          cap(cu_seqlens_k), options, alibi_slopes=cap(alibi_slopes), seqused_k=cap(seqused_k),
                          leftpad_k=cap(leftpad_k), kv_batch_idx=cap(kv_batch_idx), block_table=cap(block_table),
                          k_new=cap(k_new), v_new=cap(v_new), rotary_cos=cap(rotary_cos), rotary_sin=cap(rotary_sin))
    with _device_context(q.device):
        call.run(_workspace(call.plan_forward(_stream(q.device)), q.device))
    return out, lse


# Without the operator library the two attention operators are registered here, with
# torch.library.Library directly rather than through torch.library.custom_op: custom_op wraps every
# call in an aliasing check and a dynamo guard that cost about 110 us a call on an H100 host (more
# than the rest of the call), and these implementations return fresh tensors by construction. The
# schemas are torch_ops.cpp's, word for word.
_lib = torch.library.Library("tileattn", "FRAGMENT")


def _define(name: str, schema: str, impl) -> None:
    if _torch_ops is not None:
        return
    _lib.define(f"{name}{schema}")
    for key in ("CPU", "CUDA"):
        _lib.impl(name, impl, key)


# The arguments of both forward operators.
_FORWARD_ARGS = ("(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
                 "SymInt max_seqlen_k, float? softmax_scale, bool causal, SymInt window_left, SymInt window_right, "
                 "float softcap, bool deterministic, Tensor? alibi_slopes=None, float dropout_p=0.0, "
                 "Tensor? dropout_rng=None)")
_define("attention_forward", _FORWARD_ARGS + " -> (Tensor, Tensor)", _forward_impl)
attention_forward = torch.ops.tileattn.attention_forward


@torch.library.register_fake("tileattn::attention_forward")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
      window_right, softcap, deterministic, alibi_slopes=None, dropout_p=0.0, dropout_rng=None):
    varlen = cu_seqlens_q is not None
    _check_same_device(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            alibi_slopes=alibi_slopes, dropout_rng=dropout_rng))
    _check_attention_ranks(q, k, v, varlen)
    out = _empty_like(_rows_contiguous(q), v.shape[-1])  # as the operator's copy of a strided last dimension
    lse = q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)
    return out, lse


# attention_forward with the row statistics it hands to attention_backward (empty where it hands
# none over); no gradient of its own: the attention's autograd and FlashAttentionFunction call it.
_define("attention_forward_stats", _FORWARD_ARGS + " -> (Tensor, Tensor, Tensor)", _forward_stats_impl)


@torch.library.register_fake("tileattn::attention_forward_stats")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *options, **kwargs):
    out, lse = torch.ops.tileattn.attention_forward.default(q, k, v, cu_seqlens_q, cu_seqlens_k, *options, **kwargs)
    return out, lse, _new_stats(lse, q)


def _backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
                   max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int,
                   window_right: int, softcap: float, deterministic: bool,
                   alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                   dropout_rng: Optional[Tensor] = None, softmax_stats: Optional[Tensor] = None,
                   dlse: Optional[Tensor] = None, partial_keys: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: returns (dq, dk, dv) from the forward's inputs, its out and lse, and dout. Dropout
    needs the forward's own dropout_p and dropout_rng: the mask is regenerated, never stored.
    ``softmax_stats``: attention_forward_stats' row statistics, which spare recomputing them.
    ``dlse``: the loss's gradient with respect to lse (problem.hpp), or None where lse has none.
    ``partial_keys`` (not in the operator's schema; tileattn.distributed passes it): out and lse cover
    more keys than k and v (problem.hpp)."""
    cuda = q.is_cuda
    try:
        dout = _rows_contiguous(dout)  # as the checked path: the gradient of a sum is an expanded tensor
        dlse = None if dlse is None else dlse.contiguous()
        dtype, device = q.dtype, q.device
        dq, dk, dv = (_empty_like(t, t.shape[-1], dtype) for t in (q, k, v))
        options = _call_options(q, cuda, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                                window_right, softcap, deterministic, dropout_p, partial_keys)
        call = _ext.Attention(_to_dlpack(q), _to_dlpack(k), _to_dlpack(v), _to_dlpack(out), _to_dlpack(lse),
                              _optional_capsule(cu_seqlens_q), _optional_capsule(cu_seqlens_k), options,
                              _to_dlpack(dout), _to_dlpack(dq), _to_dlpack(dk), _to_dlpack(dv),
                              alibi_slopes=_optional_capsule(alibi_slopes),
                              dropout_rng=_optional_capsule(dropout_rng),
                              softmax_stats=_stats_capsule(softmax_stats, _to_dlpack),
                              dlse=_optional_capsule(dlse))
    except Exception:
        pass
    else:
        if _plan_and_run(call, call.plan_backward, cuda, device):
            return dq, dk, dv
    return _checked_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, window_left, window_right, softcap, deterministic, alibi_slopes,
                             dropout_p, dropout_rng, partial_keys, softmax_stats, dlse)


def _checked_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal, window_left, window_right, softcap, deterministic, alibi_slopes, dropout_p,
                      dropout_rng, partial_keys=False, softmax_stats=None, dlse=None):
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    _check_device(q, "q")
    _check_device(dout, "dout")
    _check_attention_ranks(q, k, v, cu_seqlens_q is not None)
    dout = _rows_contiguous(dout)  # it comes from whatever follows attention
    dlse = None if dlse is None else dlse.contiguous()
    dq, dk, dv = (_empty_like(t, t.shape[-1]) for t in (q, k, v))
    call = _attention(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      causal, window_left, window_right, softcap, deterministic, grads=(dout, dq, dk, dv),
                      alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_rng=dropout_rng,
                      partial_keys=partial_keys, softmax_stats=softmax_stats, dlse=dlse)
    with _device_context(q.device):
        call.run(_workspace(call.plan_backward(_stream(q.device)), q.device))
    return dq, dk, dv


_define("attention_backward",
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
        "SymInt window_left, SymInt window_right, float softcap, bool deterministic, Tensor? alibi_slopes=None, "
        "float dropout_p=0.0, Tensor? dropout_rng=None, Tensor? softmax_stats=None, Tensor? dlse=None) "
        "-> (Tensor, Tensor, Tensor)", _backward_impl)
attention_backward = torch.ops.tileattn.attention_backward


@torch.library.register_fake("tileattn::attention_backward")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, deterministic, alibi_slopes=None, dropout_p=0.0, dropout_rng=None,
      softmax_stats=None, dlse=None):
    _check_same_device(dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes,
                            dropout_rng=dropout_rng, dlse=dlse))
    # The operator's rows_contiguous copy of an operand whose last dimension is strided is contiguous.
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    return _empty_like(q, q.shape[-1]), _empty_like(k, k.shape[-1]), _empty_like(v, v.shape[-1])


_define("cache_forward",
        "(Tensor q, Tensor(a!) k, Tensor(b!) v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, float? softmax_scale, bool causal, SymInt window_left, SymInt window_right, "
        "float softcap, Tensor? alibi_slopes, Tensor? seqused_k, Tensor? leftpad_k, Tensor? kv_batch_idx, "
        "Tensor? block_table, int num_splits, Tensor? k_new=None, Tensor? v_new=None, Tensor? rotary_cos=None, "
        "Tensor? rotary_sin=None, bool rotary_interleaved=True) -> (Tensor, Tensor)", _cache_forward_impl)


@torch.library.register_fake("tileattn::cache_forward")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *options, **kwargs):
    varlen = cu_seqlens_q is not None
    _check_same_device(dict(q=q, k=k, v=v))
    q = _rows_contiguous(q)
    return _empty_like(q, v.shape[-1]), q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)


# attention_backward has no derivative of its own. Where a graph could differentiate its gradients
# (create_graph=True), they carry a node that raises this (the operator library's message, word for
# word): the dispatcher's fallback for an operator without an Autograd kernel lets such a graph run
# on with a zero second derivative and only a warning.
NO_SECOND_DERIVATIVE = ("tileattn: attention's backward has no derivative of its own; a second derivative through "
                        "attention (gradients taken with create_graph=True, then differentiated) is not supported")


def _no_second_derivative(ctx, *grads):
    raise NotImplementedError(NO_SECOND_DERIVATIVE)


# Forward-mode AD has no formula here: refused rather than returning outputs without tangents (the
# operator library's message, word for word).
NO_FORWARD_AD = ("tileattn: forward-mode AD (dual tensors, torch.func.jvp) through attention is not supported; "
                 "its gradients are reverse-mode only")


def _refuse_forward_ad(*tensors) -> None:
    if _forward_ad._current_level >= 0 and any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(NO_FORWARD_AD)


if _torch_ops is None:  # torch_ops.cpp registers the same kernel
    torch.library.register_autograd("tileattn::attention_backward", _no_second_derivative,
                                    setup_context=lambda ctx, inputs, output: None)


_FORWARD_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                    "window_left", "window_right", "softcap", "deterministic", "alibi_slopes", "dropout_p",
                    "dropout_rng")


def _forward_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    out, lse = output
    # Only Q, K, V, O and L are kept: nothing of size seqlen_q x seqlen_k. The options carry
    # dropout's seed and offset (dropout_rng), from which the backward regenerates the mask.
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options


def _forward_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.tileattn.attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                       *ctx.options, dlse=grad_lse)
    return (dq, dk, dv) + (None,) * len(_FORWARD_OPTIONS)


class _EagerAttention(torch.autograd.Function):
    """The operator's autograd for plain tensors, without torch.library's generated Function (which
    dispatches the operator again below autograd, tens of microseconds a call -- as much as a short
    sequence's kernel). The scalar options travel as one tuple: apply() looks at every argument."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, options):
        out, lse, stats = _forward_stats_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
        # As _forward_setup_context: Q, K, V, O and L (and the row statistics: two floats a row of L);
        # the options hold dropout_rng.
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, stats if stats.numel() else None)
        ctx.options = options
        # lse's gradient is None where the loss does not read it: not a tensor of zeros to read.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, stats = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if torch.is_grad_enabled():  # create_graph=True: the operator marks its gradients as final
            dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options,
                                            softmax_stats=stats, dlse=grad_lse)
        else:
            dq, dk, dv = _backward_impl(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options,
                                        softmax_stats=stats, dlse=grad_lse)
        return dq, dk, dv, None, None, None


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BACKEND_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def _forward_autograd_kernel(traced):
    """The operator's Autograd kernel. A compiled graph calls the operator at every run with plain
    tensors and nothing between autograd and the backend: that call goes straight to the
    implementation (through _EagerAttention where a gradient is wanted). Anything else -- fake or
    functional tensors, dispatch modes, tracing -- takes torch.library's kernel, ``traced``."""

    def kernel(keyset, *args):
        if (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() not in _BACKEND_KEYS:
            return traced(keyset, *args)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return _EagerAttention.apply(*args[:5], args[5:])
        return _forward_impl(*args)

    return kernel


try:
    from torch._library.autograd import Info as _AutogradInfo, make_autograd_impl as _make_autograd_impl
except ImportError:  # a torch without these internals keeps the public registration alone
    _make_autograd_impl = None
if _torch_ops is not None:
    pass  # torch_ops.cpp registers the Autograd kernel
elif _make_autograd_impl is not None:
    _lib.impl("attention_forward",
              _forward_autograd_kernel(_make_autograd_impl(torch.ops.tileattn.attention_forward.default,
                                                           _AutogradInfo(_forward_backward, _forward_setup_context))),
              "Autograd", with_keyset=True)
else:
    torch.library.register_autograd("tileattn::attention_forward", _forward_backward,
                                    setup_context=_forward_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool, window_left: int,
              window_right: int, softcap: float, deterministic: bool,
              alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
              dropout_rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, lse), differentiable in q, k, v: what the public functions call. Under torch.compile
    it is the ``tileattn::attention_forward`` operator (traced, no graph break), in eager mode the
    same computation without the operator dispatch."""
    if _torch_ops is not None:
        # One dispatcher call: the operator library's Autograd and backend kernels do the rest. The
        # library's own entry skips the boxing of torch.ops; tracing, __torch_function__ overrides
        # (tensor subclasses, modes) and symbolic sizes take the operator as torch.ops gives it.
        if (_is_compiling() or type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN
                or type(max_seqlen_q) is not int or type(max_seqlen_k) is not int or _torch_function_mode_enabled()):
            return torch.ops.tileattn.attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                        max_seqlen_k, softmax_scale, causal, window_left,
                                                        window_right, softcap, deterministic, alibi_slopes,
                                                        dropout_p, dropout_rng)
        return _torch_ops.attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window_left, window_right, softcap,
                                            deterministic, alibi_slopes, dropout_p, dropout_rng)
    options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, deterministic,
               alibi_slopes, dropout_p, dropout_rng)
    _refuse_forward_ad(q, k, v)
    if _is_compiling() or not _plain_on_one_device(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        # Meta and fake tensors, tensor subclasses and mixed devices keep the operator's handling
        # (shape inference, its error messages).
        return torch.ops.tileattn.attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # Nothing to differentiate (inference): the autograd Function's bookkeeping is skipped.
        return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
    return _EagerAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options)


_torch_function_mode_enabled = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)
_is_compiling = torch.compiler.is_compiling  # bound once: dynamo still sees the function itself
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_on_one_device(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes) -> bool:
    # Unrolled and without device.type (which builds a string): this runs on every eager call.
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN or not (q.is_cpu or q.is_cuda):
        return False
    device = q.device
    if k.device != device or v.device != device:
        return False
    for t in (cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        if t is not None and (type(t) not in _PLAIN or t.device != device):
            return False
    return True


def _check_softmax_matmul_inputs(x: Tensor, v: Tensor) -> None:
    _check_device(x, "x")
    _check_device(v, "v")
    _check_rank(x, "x", 3, "(batch, d1, d2)")
    _check_rank(v, "v", 3, "(batch, d2, d3)")


@torch.library.custom_op("tileattn::softmax_matmul", mutates_args=())
def softmax_matmul(x: Tensor, v: Tensor) -> Tensor:
    """softmax(x, dim=-1) @ v for x (batch, d1, d2) and v (batch, d2, d3), without materialising softmax(x)."""
    _check_softmax_matmul_inputs(x, v)
    out = torch.empty((x.shape[0], x.shape[1], v.shape[-1]), dtype=x.dtype, device=x.device)
    call = _ext.SoftmaxMatmul(_capsule(x), _capsule(v), _capsule(out), fp32_fast=_fp32_fast(x),
                              num_threads=_num_threads(x.device))
    with _device_context(x.device):
        call.run(_workspace(call.plan(_stream(x.device)), x.device))
    return out


@softmax_matmul.register_fake
def _(x, v):
    _check_same_device(dict(x=x, v=v))
    _check_rank(x, "x", 3, "(batch, d1, d2)")
    _check_rank(v, "v", 3, "(batch, d2, d3)")
    return x.new_empty((x.shape[0], x.shape[1], v.shape[-1]))


def _softmax_matmul_setup_context(ctx, inputs, output):
    x, v = inputs
    ctx.save_for_backward(x, v, output)


def _softmax_matmul_backward(ctx, grad_out):
    # With P = softmax(x): dV = P^T dO and dx = P * (dO V^T - rowsum(dO * out)). P is rebuilt here
    # (it is the size of x, which the caller already holds) instead of being saved.
    x, v, out = ctx.saved_tensors
    dtype, x = x.dtype, x.float()
    # A row of -inf throughout is a zero row of out (the forward's rule), so of P too: torch.softmax
    # would give NaN there, and 0 * NaN would spread it into dV. NaN inputs stay NaN, as in torch.
    p = torch.softmax(x, dim=-1).masked_fill(x.amax(dim=-1, keepdim=True) == -math.inf, 0.0)
    g = grad_out.float()
    dv = (p.transpose(-1, -2) @ g).to(v.dtype)
    dp = g @ v.float().transpose(-1, -2)
    dx = p * (dp - (g * out.float()).sum(dim=-1, keepdim=True))
    return dx.to(dtype), dv


softmax_matmul.register_autograd(_softmax_matmul_backward, setup_context=_softmax_matmul_setup_context)
