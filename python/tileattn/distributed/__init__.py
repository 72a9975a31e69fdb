"""Context parallelism: attention of one sequence split over the ranks of a torch.distributed group
(NCCL between GPUs, gloo on CPUs), built on tileattn's log-sum-exp and ``merge_attention``.

- ``shard(x, group=None, dim=1, causal=False)`` / ``unshard(x_local, ...)``: this rank's part of a
  full (batch, seqlen, heads, headdim) tensor and back (zig-zag chunk pairs when causal);
- ``context_parallel_attn(q, k, v, group=None, causal=False, mode="ring", ...)``: this rank's output
  shard, forward and backward, with K/V passed round a ring (``mode="ring"``) or gathered first
  (``mode="allgather"``);
- ``shard_varlen(x, cu_seqlens, ...)`` / ``unshard_varlen`` / ``shard_cu_seqlens`` and
  ``context_parallel_attn_varlen(q, k, v, cu_seqlens, max_seqlen, ...)``: the same for a packed batch of
  variable-length sequences, each split over the ranks;
- ``merge_attention(out, lse, out_b, lse_b)``: the in-place merge of two partial results.

See docs/context_parallel.md for the split, the algorithms and the scaling model.
"""

from .context_parallel import context_parallel_attn, shard, unshard
from .merge import merge_attention
from .varlen import context_parallel_attn_varlen, shard_cu_seqlens, shard_varlen, unshard_varlen

__all__ = ["context_parallel_attn", "context_parallel_attn_varlen", "merge_attention", "shard", "shard_cu_seqlens",
           "shard_varlen", "unshard", "unshard_varlen"]
