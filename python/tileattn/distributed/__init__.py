"""Context parallelism: attention of one sequence split over the ranks of a torch.distributed group
(NCCL between GPUs, gloo on CPUs), built on tileattn's log-sum-exp and ``merge_attention``.

- ``shard(x, group=None, dim=1, causal=False)`` / ``unshard(x_local, ...)``: this rank's part of a
  full (batch, seqlen, heads, headdim) tensor and back (zig-zag chunk pairs when causal);
- ``context_parallel_attn(q, k, v, group=None, causal=False, mode="ring", ...)``: this rank's output
  shard, forward and backward, with K/V passed round a ring (``mode="ring"``) or gathered first
  (``mode="allgather"``);
- ``merge_attention(out, lse, out_b, lse_b)``: the in-place merge of two partial results.

See docs/context_parallel.md for the split, the algorithms and the scaling model.
"""

from .context_parallel import context_parallel_attn, shard, unshard
from .merge import merge_attention

__all__ = ["context_parallel_attn", "merge_attention", "shard", "unshard"]
