"""Decode benchmark: one (or a few) query positions per sequence against a long key/value cache,
the call an inference engine makes once per generated token. Decoding reads the cache and little
else, so the figure is bandwidth: GB/s of K and V read once (batch x seqlen_k x heads_kv x
headdim x 2 tensors x 2 bytes) per call, beside PyTorch SDPA's flash and cuDNN backends on the
same tensors (SDPA with enable_gqa), and tileattn's paged cache at several page sizes.

    python -m tileattn.bench.decode [--csv decode.csv] [--passes 30]
"""

from __future__ import annotations

import argparse
import math

import torch

from ._common import mean_std, output_path, progress, require_cuda, time_each

# (batch, seqlen_k, heads_q, heads_kv, seqlen_q): the grid of the inference issue, plus
# speculative decoding (several query positions, causal).
SHAPES = [
    (8, 32768, 32, 32, 1),
    (8, 32768, 32, 8, 1),
    (8, 32768, 32, 4, 1),
    (1, 131072, 32, 8, 1),
    (128, 2048, 32, 8, 1),
    (8, 32768, 32, 8, 4),
]
PAGE_SIZES = (16, 64, 256)


def _impls(q, k, v, page_sizes):
    import tileattn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, seqlen_k = k.shape[0], k.shape[1]
    causal = q.shape[1] > 1
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=q.device)
    impls = {"tileattn": lambda: tileattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal)}
    for ps in page_sizes:
        pages = batch * seqlen_k // ps
        perm = torch.randperm(pages, device=q.device)
        table = perm.view(batch, seqlen_k // ps).int()
        kp = torch.empty((pages, ps, *k.shape[2:]), dtype=k.dtype, device=k.device)
        vp = torch.empty_like(kp)
        kp[perm.view(batch, -1)] = k.view(batch, seqlen_k // ps, ps, *k.shape[2:])
        vp[perm.view(batch, -1)] = v.view(batch, seqlen_k // ps, ps, *v.shape[2:])
        impls[f"tileattn_paged{ps}"] = (lambda kp=kp, vp=vp, table=table: tileattn.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=causal))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def sdpa_with(backend):
        def fn():
            with sdpa_kernel(backend):
                # Bottom-right causal for several query positions: SDPA's is_causal is top-left.
                if causal:
                    from torch.nn.attention.bias import causal_lower_right
                    mask = causal_lower_right(q.shape[1], seqlen_k)
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                                            enable_gqa=gqa)
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
        return fn

    impls["sdpa_flash"] = sdpa_with(SDPBackend.FLASH_ATTENTION)
    impls["sdpa_cudnn"] = sdpa_with(SDPBackend.CUDNN_ATTENTION)
    return impls


def run(warmup: int, passes: int, shapes=SHAPES, page_sizes=PAGE_SIZES, headdim: int = 128):
    device = require_cuda("tileattn.bench.decode")
    rows = []
    for i, (batch, seqlen_k, hq, hkv, sq) in enumerate(shapes):
        label = f"B={batch} Nk={seqlen_k} {hq}/{hkv} Sq={sq}"
        progress(i + 1, len(shapes), label)
        q = torch.randn(batch, sq, hq, headdim, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_k, hkv, headdim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        gbytes = 2 * k.numel() * k.element_size() / 1e9
        impls = _impls(q, k, v, page_sizes)
        shape_rows = {name: dict(batch=batch, seqlen_k=seqlen_k, heads_q=hq, heads_kv=hkv, seqlen_q=sq, impl=name,
                                 ms=math.inf) for name in impls}
        # Two rounds in opposite orders, the better kept: no implementation always runs first (on
        # a card still clocking up) or right after the page copies.
        for order in (list(impls), list(reversed(impls))):
            for name in order:
                row = shape_rows[name]
                if "error" in row:
                    continue
                try:
                    times = time_each(impls[name], warmup, passes)
                except RuntimeError as e:  # a backend that refuses the shape
                    row.update(ms=math.nan, ms_std=math.nan, gbps=math.nan, error=str(e).splitlines()[0][:80])
                    continue
                ms, std = mean_std(sorted(times)[: max(1, len(times) * 4 // 5)])
                if ms < row["ms"]:
                    row.update(ms=ms, ms_std=std, gbps=gbytes / (ms * 1e-3))
        rows.extend(shape_rows.values())
        del q, k, v, impls
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tileattn.bench.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.passes < 1:
        parser.error("--warmup must be >= 0 and --passes >= 1")
    rows = run(args.warmup, args.passes)
    print(f"# {torch.cuda.get_device_name()}  bf16, headdim 128, GB/s of K+V read once (ms)")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print("| shape | " + " | ".join(impls) + " |")
    print("|---" * (len(impls) + 1) + "|")
    for key in dict.fromkeys((r["batch"], r["seqlen_k"], r["heads_q"], r["heads_kv"], r["seqlen_q"]) for r in rows):
        cells = []
        for impl in impls:
            r = next(r for r in rows if (r["batch"], r["seqlen_k"], r["heads_q"], r["heads_kv"], r["seqlen_q"]) == key
                     and r["impl"] == impl)
            cells.append("n/a" if math.isnan(r["gbps"]) else f"{r['gbps']:.0f} ({r['ms']:.3f})")
        b, nk, hq, hkv, sq = key
        print(f"| B={b} Nk={nk} {hq}/{hkv} Sq={sq} | " + " | ".join(cells) + " |")
    if args.csv:
        import csv

        with open(output_path(args.csv), "w", newline="") as f:
            fields = sorted({k for r in rows for k in r})
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
