"""tileattn: exact, memory-efficient attention (FlashAttention-style) for PyTorch.

- ``flash_attn_func`` / ``flash_attn_varlen_func``: flash-attn's signatures and layout
  (batch, seqlen, heads, headdim); their packed forms ``flash_attn_qkvpacked_func``,
  ``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func`` and
  ``flash_attn_varlen_kvpacked_func`` read the packed tensor in place.
- ``flash_attn_with_kvcache``: inference over a key/value cache (appending new keys, rotary
  embedding, paged caches with ``block_table``, GQA), as flash-attn's; forward only.
- ``scaled_dot_product_attention``: PyTorch SDPA's signature and layout (batch, heads, seqlen, headdim).
- ``softmax_matmul``: softmax(x, dim=-1) @ v without materialising softmax(x).
- ``merge_attention``: merges two partial results (out, lse) over disjoint keys, in place;
  ``tileattn.distributed`` builds context-parallel attention on it.
- ``InvalidArgumentError`` / ``InvalidTypeError``: what a refused call raises (ValueError /
  TypeError, and RuntimeError as flash-attn's and SDPA's checks).
- ``FlashAttentionFunction``: (batch, seqlen, headdim) autograd function on the kernels;
  ``tileattn.reference.FlashAttentionPytorch`` is its readable pure-PyTorch counterpart.

The others are differentiable; all are traceable by torch.compile(fullgraph=True) and run on the
current CUDA stream (CUDA graphs included) or on the CPU.
"""

from . import _ext
from .autograd import FlashAttentionFunction
from .functional import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                         flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                         scaled_dot_product_attention, softmax_matmul)
from .kvcache import flash_attn_with_kvcache
from . import reference
from ._ops import check_cu_seqlens
from .errors import InvalidArgumentError, InvalidTypeError
from .distributed.merge import merge_attention

__version__ = _ext.version()

# The one FLOP count the benchmarks report (include/tileattn/flops.hpp).
attention_forward_flops = _ext.attention_forward_flops
attention_backward_flops = _ext.attention_backward_flops
softmax_matmul_flops = _ext.softmax_matmul_flops


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a CUDA device is visible."""
    return _ext.cuda_available()


__all__ = [
    "FlashAttentionFunction",
    "InvalidArgumentError",
    "InvalidTypeError",
    "attention_backward_flops",
    "attention_forward_flops",
    "check_cu_seqlens",
    "cuda_available",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention",
    "reference",
    "scaled_dot_product_attention",
    "softmax_matmul",
    "softmax_matmul_flops",
]
