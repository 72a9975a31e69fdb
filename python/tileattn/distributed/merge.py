"""``merge_attention``: the merge of two partial attention results, in place."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InvalidTypeError
from .. import _ext
from .._ops import _capsule, _check_device, _device_context, _num_threads, _stream

__all__ = ["merge_attention"]


def merge_attention(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge the attention result ``(out_b, lse_b)`` into ``(out, lse)`` in place and return them.

    Both are results of attention of the same queries over two disjoint sets of keys, as
    ``flash_attn_func(..., return_attn_probs=True)`` gives them: ``out`` (batch, seqlen, heads,
    headdim) with ``lse`` float32 (batch, heads, seqlen), or the varlen forms (total, heads, headdim)
    with (heads, total). Afterwards they hold the result over the union of the key sets:
    ``lse = logaddexp(lse, lse_b)``, ``out = exp(lse_old - lse) out + exp(lse_b - lse) out_b``.

    ``out`` may be float32 over a float16/bfloat16 ``out_b`` (accumulate in fp32 without rounding
    between merges); otherwise the dtypes must match. A row whose lse is -inf on one side takes the
    other side as it is, whatever the -inf side's ``out`` holds (so an accumulator may start as
    ``torch.empty`` with lse = -inf); so does +inf, the mark of a row without keys in what the
    ``flash_attn_*`` functions return; empty on both sides gives out = 0 and lse = -inf, never NaN. Any strides
    with a contiguous last dimension; ``out_b`` and ``lse_b`` may be expanded (zero strides), ``out`` and
    ``lse``, written, may not. Not differentiable (it writes its inputs): a tensor that
    requires grad is refused while grad mode is on (use detached tensors, as the context-parallel
    layer does), and autograd sees ``out`` and ``lse`` as modified in place.
    """
    for t, name in ((out, "out"), (lse, "lse"), (out_b, "out_b"), (lse_b, "lse_b")):
        if not isinstance(t, Tensor):
            raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check_device(t, name)
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{name} requires grad: merge_attention writes in place and has no gradient; pass "
                               "detached tensors (or call it under torch.no_grad())")
    # Checked here as well as in the library, which skips every rule for an empty problem.
    if out.dtype != torch.float32 and out_b.dtype != out.dtype:
        raise InvalidTypeError(
            f"out_b.dtype={str(out_b.dtype)[6:]} must equal out.dtype={str(out.dtype)[6:]} (a 16-bit "
            "accumulator merges its own dtype; use a float32 out to mix)")
    with _device_context(out.device):
        _ext.merge_attention(_capsule(out), _capsule(lse), _capsule(out_b), _capsule(lse_b),
                             stream=_stream(out.device), num_threads=_num_threads(out.device))
    # Written in place: autograd's saved copies of them (taken before) are now stale. Inference
    # tensors keep no version.
    for t in (out, lse):
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)
    return out, lse
