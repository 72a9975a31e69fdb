"""flash_attn_with_kvcache, and flash_attn_varlen_func over a paged cache (``block_table``) or with
``seqused_k``, forward only, against a float64 reference written from flash-attn 2's definitions
with the 2x rule; the in-place cache append checked element by element; a CUDA variant of each
case (marked gpu); the argument errors.

The semantics the reference encodes (flash-attn 2):
- Sequence b's cache is row ``cache_batch_idx[b]`` (or b) of k_cache/v_cache, or, with
  ``block_table``, the pages ``block_table[b]``: logical row r lies at row r % page_size of page
  ``block_table[b, r // page_size]``.
- New keys/values k, v (seqlen_new rows) are written in place at rows
  [cache_seqlens[b], cache_seqlens[b] + seqlen_new), then sequence b attends to rows
  [cache_leftpad[b], cache_seqlens[b] + seqlen_new); cache_seqlens itself is left alone.
- Rotary (only with new keys) rotates q and the new keys, never cached keys or values, at absolute
  cache positions: new key i at cache_seqlens[b] + i; query i at cache_seqlens[b] + i when the
  mask is causal or local (a window side shorter than the cache row), else every query at
  cache_seqlens[b].
- Masks and ALiBi (``-slope * |i + sk - sq - j|``) are aligned to the bottom-right corner of each
  sequence's own keys (sk counts from the left pad). As in flash_attn_func (test_alibi.py), the
  causal form of ALiBi gives a softmax_lse larger by ``slope * (i + sk - sq)``.
- Rows that see no key give out = 0 and lse = +inf (flash-attn's mark).
"""

import math

import pytest
import torch

import naive
import tileattn

FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


# ---- the float64 reference (plain torch; also run in the input dtype for the 2x rule) ----------

def rotate(x, cos, sin, positions, interleaved):
    """x (n, heads, d) rotated at positions (n,) over its first 2 * cos.shape[-1] dims."""
    half = cos.shape[-1]
    c = cos[positions].to(x.dtype)[:, None, :]
    s = sin[positions].to(x.dtype)[:, None, :]
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def cache_slots(b, rows, cache_batch_idx, block_table):
    """Index pair into k_cache for logical rows `rows` (a range) of sequence b."""
    rows = torch.tensor(list(rows), dtype=torch.long)
    if block_table is not None:
        page_size = block_table.page_size
        return block_table.table[b].long()[rows // page_size], rows % page_size
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return torch.full_like(rows, row), rows


class Pages:
    """A block table with its page size (the reference needs both)."""

    def __init__(self, table, page_size):
        self.table, self.page_size = table, page_size


def attend(q, k, v, scale, causal, window, softcap, slopes):
    """One sequence: q (sq, hq, d), k and v (sk, hkv, d), slopes (hq,) or None. out, lse (hq, sq)."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if slopes is not None:
        s = s - slopes.to(s.dtype)[:, None, None] * (i + sk - sq - j).abs().to(s.dtype)
    mask = naive.visible_mask(sq, sk, causal, window, "cpu")
    s = s.masked_fill(~mask, -math.inf)
    seen = mask.any(dim=-1).expand(hq, sq)
    lse = torch.logsumexp(s.masked_fill(~seen[..., None], 0.0), dim=-1)
    p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
    out = torch.einsum("hqk,khd->qhd", p.to(v.dtype), v)
    if slopes is not None and causal and window[0] < 0:
        lse = lse + slopes.to(lse.dtype)[:, None] * (torch.arange(sq) + sk - sq).to(lse.dtype)
    return out, torch.where(seen, lse, -math.inf)


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, pages=None, softmax_scale=None, causal=False,
                      window=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None):
    """CPU tensors in one float dtype; cache_seqlens (batch,) int. Returns out, lse and the caches
    as they must be after the call (copies; the inputs are not touched)."""
    batch, sq, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    seqlen_new = 0 if k is None else k.shape[1]
    left, right = window
    # flash-attn's rule: a window side as long as the cache row or longer masks nothing and does
    # not make the mask local.
    capacity = k_cache.shape[1] * (pages.table.shape[1] if pages is not None else 1)
    local = causal or 0 <= left < capacity or 0 <= right < capacity
    if alibi_slopes is not None and alibi_slopes.dim() == 1:
        alibi_slopes = alibi_slopes.expand(batch, -1)
    outs, lses = [], []
    for b in range(batch):
        start = int(cache_seqlens[b])
        pad = 0 if cache_leftpad is None else int(cache_leftpad[b])
        qb = q[b]
        if k is not None:
            kb, vb = k[b], v[b]
            if rotary_cos is not None:
                kb = rotate(kb, rotary_cos, rotary_sin, start + torch.arange(seqlen_new), rotary_interleaved)
                qpos = start + torch.arange(sq) if local else torch.full((sq,), start)
                qb = rotate(qb, rotary_cos, rotary_sin, qpos, rotary_interleaved)
            slots = cache_slots(b, range(start, start + seqlen_new), cache_batch_idx, pages)
            k_cache[slots] = kb
            v_cache[slots] = vb
        slots = cache_slots(b, range(pad, start + seqlen_new), cache_batch_idx, pages)
        slopes = None if alibi_slopes is None else alibi_slopes[b]
        out, lse = attend(qb, k_cache[slots], v_cache[slots], scale, causal, window, softcap, slopes)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


def written_rows(cache_shape, cache_seqlens, seqlen_new, cache_batch_idx, pages):
    """(cache rows, rows per cache entry) bool: where the append writes."""
    written = torch.zeros(cache_shape[:2], dtype=torch.bool)
    for b in range(len(cache_seqlens)):
        start = int(cache_seqlens[b])
        written[cache_slots(b, range(start, start + seqlen_new), cache_batch_idx, pages)] = True
    return written


def check(actual, same_precision, oracle, floor, what):
    naive.assert_2x_rule(actual.cpu(), same_precision, oracle, floor, what)


def assert_same(actual, expected, what):
    """Bitwise equality, reported as how many elements differ and where the first one is."""
    actual = actual.cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    differ = (actual != expected).nonzero()
    assert len(differ) == 0, f"{what}: {len(differ)} elements differ, the first at {tuple(differ[0].tolist())}"


# ---- flash_attn_with_kvcache against the reference -----------------------------------------------

DEFAULTS = dict(batch=3, seqlen_q=1, heads=4, heads_kv=2, d=64, capacity=37, seqlen_new=0, lens=None,
                seqlens_int=False, rotary=None, rotary_dim=None, batch_idx=None, leftpad=False, page_size=None,
                causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None)

CASES = {
    # no new keys
    "decode": {},
    "decode_sq4": dict(seqlen_q=4),
    # in-place append
    "append_1": dict(seqlen_new=1, causal=True),
    "append_5_causal": dict(seqlen_q=5, seqlen_new=5, causal=True),
    "append_3_for_1_query": dict(seqlen_new=3),
    "cache_seqlens_int": dict(seqlens_int=True, seqlen_q=2, seqlen_new=2, causal=True),
    # rotary: interleaved / half-split, full and partial rotary_dim, causal / local / neither
    "rotary_interleaved": dict(seqlen_new=1, rotary="interleaved"),
    "rotary_half_partial_causal": dict(seqlen_q=4, seqlen_new=4, causal=True, rotary="half", rotary_dim=32),
    "rotary_interleaved_partial_noncausal_sq4": dict(seqlen_q=4, seqlen_new=3, rotary="interleaved",
                                                     rotary_dim=16),
    "rotary_half_window": dict(seqlen_q=4, seqlen_new=4, rotary="half", window=(6, 1)),
    # cache_batch_idx, cache_leftpad
    "batch_idx_permutation": dict(batch_idx="perm", seqlen_q=2, seqlen_new=2, causal=True),
    "batch_idx_subset_rotary": dict(batch_idx="subset", seqlen_new=1, rotary="interleaved"),
    "batch_idx_subset_no_new": dict(batch_idx="subset", seqlen_q=3, causal=True),
    "leftpad_causal": dict(leftpad=True, seqlen_q=3, seqlen_new=3, causal=True),
    "leftpad_rotary_alibi": dict(leftpad=True, seqlen_new=1, rotary="half", alibi="heads"),
    "leftpad_alibi_causal_no_new": dict(leftpad=True, seqlen_q=4, causal=True, alibi="batch"),
    # paged caches, shuffled block tables
    "paged_1": dict(page_size=1, seqlen_new=1),
    "paged_3_append_5": dict(page_size=3, seqlen_q=5, seqlen_new=5, causal=True),
    "paged_16_rotary": dict(page_size=16, seqlen_q=2, seqlen_new=2, causal=True, rotary="interleaved",
                            rotary_dim=32),
    "paged_16_no_new_mqa": dict(page_size=16, seqlen_q=4, heads_kv=1),
    "paged_256": dict(page_size=256, batch=2, capacity=300, seqlen_new=1, causal=True),
    # heads, masks, score modifiers
    "gqa_8_2": dict(heads=8, heads_kv=2, seqlen_new=1),
    "mqa_causal": dict(heads=6, heads_kv=1, seqlen_q=4, seqlen_new=4, causal=True),
    "window": dict(seqlen_q=4, seqlen_new=4, window=(8, 2)),
    "causal_window": dict(seqlen_q=4, seqlen_new=2, causal=True, window=(5, 3)),
    "softcap": dict(seqlen_new=1, softcap=5.0),
    "softmax_scale": dict(seqlen_q=2, seqlen_new=2, causal=True, scale=0.3),
    "alibi_causal": dict(seqlen_q=4, seqlen_new=4, causal=True, alibi="heads"),
    "alibi_per_batch": dict(seqlen_q=3, alibi="batch"),
    # speculative decoding, rows that see nothing, empty sequences
    "speculative_16": dict(seqlen_q=16, seqlen_new=16, causal=True, capacity=64),
    "sq_gt_keys_causal_empty_seq": dict(seqlen_q=16, causal=True, lens=[3, 0, 10], capacity=20),
    "empty_sequence": dict(seqlen_q=2, lens=[0, 5, 9]),
    "empty_sequence_append": dict(seqlen_q=2, seqlen_new=2, causal=True, lens=[0, 4, 0]),
    # head dims
    "d128": dict(d=128, heads=2, heads_kv=2, seqlen_new=1),
    "d40_rotary": dict(d=40, seqlen_q=2, seqlen_new=2, causal=True, rotary="interleaved"),
    "d40_half_partial_paged": dict(d=40, seqlen_new=1, rotary="half", rotary_dim=24, page_size=3),
    # rotary positions of the queries: local windows rotate each query at its own position, a
    # window side past the cache (37 rows) leaves every query at the first new row
    "rotary_window": dict(seqlen_q=3, seqlen_new=3, rotary="interleaved", window=(6, -1)),
    "rotary_window_past_the_cache": dict(seqlen_q=3, seqlen_new=3, rotary="half", window=(40, 50)),
}


class Case:
    """Fresh random inputs for one configuration: `call` holds flash_attn_with_kvcache's arguments
    (CPU tensors), `ref` the reference's (clones, so the in-place append cannot reach them)."""

    def __init__(self, cfg, dtype):
        c = {**DEFAULTS, **cfg}
        batch, sq, hq, hkv, d = c["batch"], c["seqlen_q"], c["heads"], c["heads_kv"], c["d"]
        capacity, seqlen_new = c["capacity"], c["seqlen_new"]
        if c["lens"] is not None:
            lens = torch.tensor(c["lens"], dtype=torch.int32)
        elif c["seqlens_int"]:
            lens = torch.full((batch,), int(torch.randint(0, capacity - seqlen_new + 1, ())), dtype=torch.int32)
        else:
            lens = torch.randint(0, capacity - seqlen_new + 1, (batch,), dtype=torch.int32)
        self.lens, self.seqlen_new = lens, seqlen_new

        self.pages = self.batch_idx = leftpad = None
        if c["page_size"] is not None:
            page_size = c["page_size"]
            per_seq = -(-capacity // page_size)
            num_pages = batch * per_seq + 3  # spare pages no sequence owns: they must stay untouched
            table = torch.randperm(num_pages)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
            self.pages = Pages(table, page_size)
            cache_shape, seqlen_ro = (num_pages, page_size, hkv, d), per_seq * page_size
        else:
            batch_cache = batch
            if c["batch_idx"] == "perm":
                self.batch_idx = torch.randperm(batch).to(torch.int32)
            elif c["batch_idx"] == "subset":
                batch_cache = batch + 2
                self.batch_idx = torch.randperm(batch_cache)[:batch].to(torch.int32)
            cache_shape, seqlen_ro = (batch_cache, capacity, hkv, d), capacity
        if c["leftpad"]:
            # At least 1 where the sequence has a key, so a pad that is ignored shows.
            leftpad = torch.stack([torch.randint(min(1, int(n)), int(n) + 1, ()) for n in lens]).to(torch.int32)

        q = torch.randn(batch, sq, hq, d, dtype=dtype)
        k_cache = torch.randn(cache_shape, dtype=dtype)
        v_cache = torch.randn(cache_shape, dtype=dtype)
        call = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                    cache_seqlens=int(lens[0]) if c["seqlens_int"] else lens)
        ref = dict(cache_seqlens=lens, causal=c["causal"], window=c["window"], softcap=c["softcap"],
                   softmax_scale=c["scale"], pages=self.pages, cache_batch_idx=self.batch_idx,
                   cache_leftpad=leftpad)
        if seqlen_new:
            call["k"] = torch.randn(batch, seqlen_new, hkv, d, dtype=dtype)
            call["v"] = torch.randn(batch, seqlen_new, hkv, d, dtype=dtype)
        self.rotary_dim = 0
        if c["rotary"]:
            self.rotary_dim = c["rotary_dim"] or d
            angle = torch.rand(seqlen_ro, self.rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
            call["rotary_cos"], call["rotary_sin"] = angle.cos().to(dtype), angle.sin().to(dtype)
            call["rotary_interleaved"] = ref["rotary_interleaved"] = c["rotary"] == "interleaved"
        if c["alibi"]:
            call["alibi_slopes"] = torch.rand((hq,) if c["alibi"] == "heads" else (batch, hq)) * 0.5
        for name, value in (("cache_batch_idx", self.batch_idx), ("cache_leftpad", leftpad)):
            if value is not None:
                call[name] = value
        if self.pages is not None:
            call["block_table"] = self.pages.table
        if c["causal"]:
            call["causal"] = True
        if c["window"] != (-1, -1):
            call["window_size"] = c["window"]
        if c["softcap"]:
            call["softcap"] = c["softcap"]
        if c["scale"] is not None:
            call["softmax_scale"] = c["scale"]
        self.call = call
        for name in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "alibi_slopes"):
            if name in call:
                ref[name] = call[name].clone()
        self.ref = ref

    def reference(self, dtype):
        args = {name: (value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
                       and name != "alibi_slopes" else value) for name, value in self.ref.items()}
        if dtype == torch.float64 and "alibi_slopes" in args:
            args["alibi_slopes"] = args["alibi_slopes"].double()
        return kvcache_reference(**args)


def on(device, call):
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in call.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_flash_attn_with_kvcache(case, dtype, device):
    c = Case(CASES[case], dtype)
    call = on(device, c.call)
    seqlens_before = call["cache_seqlens"].clone() if isinstance(call["cache_seqlens"], torch.Tensor) else None
    out, lse = tileattn.flash_attn_with_kvcache(**call, return_softmax_lse=True)

    batch, sq, hq, d = c.call["q"].shape
    assert out.shape == (batch, sq, hq, d) and out.dtype == dtype and out.device == call["q"].device
    assert lse.shape == (batch, hq, sq) and lse.dtype == torch.float32
    ref_out, ref_lse, ref_k_cache, _ = c.reference(torch.float64)
    same_out, same_lse, same_k_cache, same_v_cache = c.reference(dtype)
    floor = FLOOR[dtype]
    check(out, same_out, ref_out, floor, "out")
    check(lse, naive.flash_lse(same_lse.float()), naive.flash_lse(ref_lse), floor, "lse")

    # Rows that see no key: exactly zero and -inf, wherever they come from (empty sequence, causal
    # rows above the first key).
    empty = torch.isneginf(ref_lse)  # (batch, heads, seqlen_q)
    assert torch.isposinf(lse.cpu()[empty]).all(), "lse of rows that see no key must be +inf"
    assert (out.cpu().permute(0, 2, 1, 3)[empty] == 0).all(), "out of rows that see no key must be 0"
    assert torch.isfinite(lse.cpu()[~empty]).all()

    if seqlens_before is not None:
        assert torch.equal(call["cache_seqlens"], seqlens_before), "cache_seqlens must not be modified"

    # The append: new rows where they belong, nothing else in either cache changed.
    k_cache, v_cache = call["k_cache"].cpu(), call["v_cache"].cpu()
    written = written_rows(k_cache.shape, c.lens, c.seqlen_new, c.batch_idx, c.pages)
    assert_same(v_cache, same_v_cache, "v_cache after the append")
    assert_same(k_cache[~written], c.ref["k_cache"][~written], "k_cache outside the new rows")
    if c.rotary_dim:
        check(k_cache[written], same_k_cache[written], ref_k_cache[written], floor, "rotated new keys in k_cache")
        assert_same(k_cache[written][..., c.rotary_dim:], same_k_cache[written][..., c.rotary_dim:],
                    "dims past rotary_dim of the new keys (stored unchanged)")
    else:
        assert_same(k_cache, same_k_cache, "k_cache after the append")


def _decode_inputs(dtype, batch=2, capacity=300, heads=4, heads_kv=2, d=64, seqlen_q=1):
    lens = torch.randint(1, capacity + 1, (batch,), dtype=torch.int32)
    q = torch.randn(batch, seqlen_q, heads, d, dtype=dtype)
    k_cache = torch.randn(batch, capacity, heads_kv, d, dtype=dtype)
    v_cache = torch.randn(batch, capacity, heads_kv, d, dtype=dtype)
    return q, k_cache, v_cache, lens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_num_splits_changes_only_rounding(dtype, device):
    # Long keys, one query: the shape where splitting the keys pays. Each split count is held to
    # the same rule against the oracle, up to more splits than key tiles (empty splits) and past
    # the library's cap of 256.
    q, k_cache, v_cache, lens = _decode_inputs(dtype)
    ref_out, ref_lse, _, _ = kvcache_reference(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=lens)
    same_out, same_lse, _, _ = kvcache_reference(q, k_cache, v_cache, cache_seqlens=lens)
    args = on(device, dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lens))
    for num_splits in (0, 1, 3, 40, 300):
        out, lse = tileattn.flash_attn_with_kvcache(**args, num_splits=num_splits, return_softmax_lse=True)
        check(out, same_out, ref_out, FLOOR[dtype], f"out, num_splits={num_splits}")
        check(lse, same_lse.float(), ref_lse, FLOOR[dtype], f"lse, num_splits={num_splits}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [3, 16, 48, 64, 512])
def test_paged_decode_equals_contiguous_over_long_caches(page_size, device):
    # A long cache walked by few blocks (one split, then three): the page ids of every key tile of a
    # block, far past the first ones, address the same rows as the contiguous cache, so the two
    # calls read the same keys in the same order and agree bit for bit. Pages in shuffled order.
    batch, heads, heads_kv, d, capacity = 2, 8, 2, 64, 9216
    lens = torch.tensor([capacity, capacity - 1000 - page_size], dtype=torch.int32)
    q = torch.randn(batch, 1, heads, d, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, capacity, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
    per_seq = -(-capacity // page_size)
    num_pages = batch * per_seq + 5
    table = torch.randperm(num_pages)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    k_pages, v_pages = (torch.zeros(num_pages, page_size, heads_kv, d, dtype=torch.bfloat16) for _ in range(2))
    for b in range(batch):
        for cache, pages in ((k, k_pages), (v, v_pages)):
            padded = torch.zeros(per_seq * page_size, heads_kv, d, dtype=torch.bfloat16)
            padded[:capacity] = cache[b]
            pages[table[b].long()] = padded.view(per_seq, page_size, heads_kv, d)
    for num_splits in (1, 3):
        contiguous = tileattn.flash_attn_with_kvcache(**on(device, dict(q=q, k_cache=k, v_cache=v,
                                                                        cache_seqlens=lens)),
                                                     num_splits=num_splits)
        paged = tileattn.flash_attn_with_kvcache(**on(device, dict(q=q, k_cache=k_pages, v_cache=v_pages,
                                                                   cache_seqlens=lens, block_table=table)),
                                                 num_splits=num_splits)
        assert torch.equal(paged, contiguous), f"num_splits={num_splits}"


def test_strided_q_and_new_keys_are_the_contiguous_call():
    """As flash-attn's maybe_contiguous: q and the new k and v may have a last dimension that is not
    contiguous (they are copied, being only read); output and caches are those of the same call on
    contiguous tensors, bit for bit."""
    def strided(t):
        return torch.stack((t, torch.zeros_like(t)), dim=-1).flatten(-2)[..., ::2]

    call, rotary = _valid_call(), _rotary()
    results = []
    for view in (lambda t: t, strided):
        k_cache, v_cache = call["k_cache"].clone(), call["v_cache"].clone()
        q, k, v = (view(call[n]) for n in "qkv")
        assert view is not strided or q.stride(-1) == k.stride(-1) == v.stride(-1) == 2
        out = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=call["cache_seqlens"],
                                               causal=True, **rotary)
        results.append((out, k_cache, v_cache))
    for a, b, name in zip(*results, ("out", "k_cache", "v_cache")):
        assert torch.equal(a, b), name


def test_returns_out_alone_by_default():
    q, k_cache, v_cache, lens = _decode_inputs(torch.float32, capacity=20)
    out = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    ref_out, _, _, _ = kvcache_reference(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=lens)
    assert naive.max_error(out, ref_out) < 1e-5


def test_int_cache_seqlens_equals_the_same_tensor():
    q, k_cache, v_cache, _ = _decode_inputs(torch.float32, batch=3, capacity=40, seqlen_q=3)
    k, v = torch.randn(3, 3, 2, 64), torch.randn(3, 3, 2, 64)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    a = tileattn.flash_attn_with_kvcache(q, *caches[0], k, v, cache_seqlens=17, causal=True)
    b = tileattn.flash_attn_with_kvcache(q, *caches[1], k, v, cache_seqlens=torch.full((3,), 17, dtype=torch.int32),
                                         causal=True)
    assert torch.equal(a, b)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][0][:, 17:20], k)


@pytest.mark.parametrize("device", DEVICES)
def test_cache_with_more_rows_than_the_batch_uses_its_first_rows(device):
    # As flash-attn: without cache_batch_idx sequence b uses cache row b of a cache preallocated for
    # a larger batch; the rows past the batch are left as they were.
    q, k_cache, v_cache, _ = _decode_inputs(torch.float32, batch=5, capacity=30, seqlen_q=2)
    q, k_cache, v_cache = q[:3].to(device), k_cache.to(device), v_cache.to(device)
    k, v = torch.randn(3, 2, 2, 64, device=device), torch.randn(3, 2, 2, 64, device=device)
    lens = torch.tensor([4, 0, 17], dtype=torch.int32, device=device)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    out = tileattn.flash_attn_with_kvcache(q, *caches[0], k, v, cache_seqlens=lens, causal=True)
    rows = torch.arange(3, dtype=torch.int32, device=device)
    ref = tileattn.flash_attn_with_kvcache(q, *caches[1], k, v, cache_seqlens=lens, cache_batch_idx=rows, causal=True)
    assert torch.equal(out, ref)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a, b)
    assert torch.equal(caches[0][0][2, 17:19], k[2]) and torch.equal(caches[0][1][0, 4:6], v[0])
    assert torch.equal(caches[0][0][3:], k_cache[3:]) and torch.equal(caches[0][1][3:], v_cache[3:])
    ref_out, _ = naive.attention(q[1:2].double(), k[1:2].double(), v[1:2].double(), causal=True)
    assert naive.max_error(out[1:2], ref_out) < 1e-5


def test_no_cache_seqlens_means_the_whole_cache():
    # flash-attn's default: without cache_seqlens every sequence is its whole cache row.
    q, k_cache, v_cache, _ = _decode_inputs(torch.float32, batch=2, capacity=25, seqlen_q=4)
    out = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    ref_out, _ = naive.attention(q.double(), k_cache.double(), v_cache.double(), causal=True)
    assert naive.max_error(out, ref_out) < 1e-5


# ---- flash_attn_varlen_func over a paged cache, and with seqused_k --------------------------------

def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _paged(lens_k, page_size, heads_kv, d, dtype, spare_columns=1):
    """Paged K and V holding sequences of lens_k keys, a shuffled block table (with columns and
    pages no sequence uses), and each sequence's dense K and V."""
    per_seq = -(-max(lens_k) // page_size) + spare_columns
    num_pages = len(lens_k) * per_seq + 2
    table = torch.randperm(num_pages)[:len(lens_k) * per_seq].view(len(lens_k), per_seq).to(torch.int32)
    k_cache = torch.randn(num_pages, page_size, heads_kv, d, dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, heads_kv, d, dtype=dtype)
    pages = Pages(table, page_size)
    dense = [tuple(cache[cache_slots(b, range(n), None, pages)] for cache in (k_cache, v_cache))
             for b, n in enumerate(lens_k)]
    return k_cache, v_cache, table, dense


def _varlen_reference(q, dense, lens_q, used, dtype, **options):
    outs, lses = [], []
    cu_q = _cu(lens_q)
    for b, (k, v) in enumerate(dense):
        out, lse = naive.attention(q[None, cu_q[b]:cu_q[b + 1]].to(dtype), k[None, :used[b]].to(dtype),
                                   v[None, :used[b]].to(dtype), **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# Sequence 0 has more queries than keys (causal rows that see nothing); sequence 1 has no keys,
# sequence 2 no queries.
LENS_Q, LENS_K = [9, 2, 0, 6], [4, 0, 20, 33]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged(causal, page_size, dtype, device):
    heads, heads_kv, d = 4, 2, 32
    k_cache, v_cache, table, dense = _paged(LENS_K, page_size, heads_kv, d, dtype)
    q = torch.randn(sum(LENS_Q), heads, d, dtype=dtype)
    before = k_cache.clone(), v_cache.clone()
    args = on(device, dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=_cu(LENS_Q), cu_seqlens_k=_cu(LENS_K),
                           block_table=table))
    out, lse, probs = tileattn.flash_attn_varlen_func(**args, max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K),
                                                      causal=causal, return_attn_probs=True)
    assert probs.numel() == 0 and out.shape == q.shape and lse.shape == (heads, q.shape[0])
    ref_out, ref_lse = _varlen_reference(q, dense, LENS_Q, LENS_K, torch.float64, causal=causal)
    same_out, same_lse = _varlen_reference(q, dense, LENS_Q, LENS_K, dtype, causal=causal)
    check(out, same_out, ref_out, FLOOR[dtype], "out")
    check(lse, naive.flash_lse(same_lse.float()), naive.flash_lse(ref_lse), FLOOR[dtype], "lse")
    assert_same(args["k"], before[0], "paged k (read only)")
    assert_same(args["v"], before[1], "paged v (read only)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [None, 16], ids=["packed", "paged16"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k(causal, page_size, dtype, device):
    # Only the first seqused_k[b] keys count, and causal is aligned to that length.
    lens_q, lens_k, used = [3, 5, 2, 7], [9, 4, 31, 12], [5, 0, 31, 7]
    heads, heads_kv, d = 4, 2, 32
    q = torch.randn(sum(lens_q), heads, d, dtype=dtype)
    if page_size is None:
        k = torch.randn(sum(lens_k), heads_kv, d, dtype=dtype)
        v = torch.randn(sum(lens_k), heads_kv, d, dtype=dtype)
        cu_k = _cu(lens_k)
        dense = [(k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]) for b in range(len(lens_k))]
        extra = {}
    else:
        k, v, table, dense = _paged(lens_k, page_size, heads_kv, d, dtype)
        extra = dict(block_table=table)
    seqused = torch.tensor(used, dtype=torch.int32)
    args = on(device, dict(q=q, k=k, v=v, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k), seqused_k=seqused,
                           **extra))
    out, lse, _ = tileattn.flash_attn_varlen_func(**args, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                                  causal=causal, return_attn_probs=True)
    ref_out, ref_lse = _varlen_reference(q, dense, lens_q, used, torch.float64, causal=causal)
    same_out, same_lse = _varlen_reference(q, dense, lens_q, used, dtype, causal=causal)
    check(out, same_out, ref_out, FLOOR[dtype], "out")
    check(lse, naive.flash_lse(same_lse.float()), naive.flash_lse(ref_lse), FLOOR[dtype], "lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["paged3", "paged16", "seqused", "paged16_seqused"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_and_seqused_calls_have_gradients(causal, layout, device):
    # flash-attn's tests make these calls with inputs that require grad. The gradients of the caches
    # are those of the keys read: zero on pages and rows no sequence reads.
    lens_q, lens_k = [9, 2, 0, 6], [4, 0, 20, 33]
    used = [3, 0, 20, 17] if "seqused" in layout else lens_k
    heads, heads_kv, d = 4, 2, 32
    q = torch.randn(sum(lens_q), heads, d)
    if layout == "seqused":
        k, v = torch.randn(sum(lens_k), heads_kv, d), torch.randn(sum(lens_k), heads_kv, d)
        extra, cu_k = {}, _cu(lens_k)
        rows = [torch.arange(int(cu_k[b]), int(cu_k[b]) + n) for b, n in enumerate(used)]
    else:
        k, v, table, _ = _paged(lens_k, int(layout[5:].split("_")[0]), heads_kv, d, torch.float32)
        extra = dict(block_table=table)
        slots = [cache_slots(b, range(n), None, Pages(table, k.shape[1])) for b, n in enumerate(used)]
        rows = [page * k.shape[1] + row for page, row in slots]
    if "seqused" in layout:
        extra["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    dout = torch.randn(sum(lens_q), heads, d)
    args = on(device, dict(q=q, k=k, v=v, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k), **extra))
    for name in ("q", "k", "v"):
        args[name].requires_grad_(True)
    out = tileattn.flash_attn_varlen_func(**args, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal)
    grads = torch.autograd.grad(out, [args[n] for n in ("q", "k", "v")], dout.to(device))
    with torch.no_grad():
        inference = tileattn.flash_attn_varlen_func(**args, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                                    causal=causal)
    assert naive.max_error(out.detach(), inference) < 1e-5, "the gradient path's out against the cache path's"

    # float64 reference: each sequence's keys gathered from the caches, autograd through the gather.
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    flat_k, flat_v = ref[1].reshape(-1, heads_kv, d), ref[2].reshape(-1, heads_kv, d)
    cu_q, outs = _cu(lens_q), []
    for b, r in enumerate(rows):
        o, _ = naive.attention(ref[0][None, cu_q[b]:cu_q[b + 1]], flat_k[r][None], flat_v[r][None], causal=causal)
        outs.append(o[0])
    want = torch.autograd.grad(torch.cat(outs), ref, dout.double())
    for name, got, w in zip("qkv", grads, want):
        assert got.shape == w.shape, name
        assert naive.max_error(got.cpu(), w) < 2e-5, f"d{name}"
    read = torch.zeros(k.shape[:-2].numel(), dtype=torch.bool)
    read[torch.cat(rows)] = True
    unread = ~read.view(k.shape[:-2])
    assert (grads[1].cpu()[unread] == 0).all() and (grads[2].cpu()[unread] == 0).all(), "rows no sequence reads"


def test_varlen_paged_window_softcap_alibi():
    heads, heads_kv, d = 4, 1, 40
    lens_q, lens_k = [5, 8, 1], [17, 8, 26]
    k_cache, v_cache, table, dense = _paged(lens_k, 3, heads_kv, d, torch.float32)
    q = torch.randn(sum(lens_q), heads, d)
    slopes = torch.rand(len(lens_q), heads) * 0.5
    out = tileattn.flash_attn_varlen_func(q, k_cache, v_cache, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                          window_size=(6, 2), softcap=4.0, alibi_slopes=slopes, block_table=table)
    cu_q = _cu(lens_q)
    for b, (k, v) in enumerate(dense):
        ref_out, _, _, _ = kvcache_reference(q[None, cu_q[b]:cu_q[b + 1]].double(), k[None].double(),
                                             v[None].double(), cache_seqlens=[lens_k[b]], window=(6, 2), softcap=4.0,
                                             alibi_slopes=slopes[b:b + 1].double())
        assert naive.max_error(out[cu_q[b]:cu_q[b + 1]], ref_out[0]) < 1e-5, f"sequence {b}"


# ---- argument errors -------------------------------------------------------------------------
# VALIDATION TESTS (select with -k validation). Each expects the exception kind of the project's
# convention (TypeError for dtypes, ValueError for shapes and values) and matches only the name of
# the offending argument; the wording of the rule is the implementation's. Where two arguments
# conflict, either name will do (the GQA rule keeps the library's wording, "heads_kv=... must
# divide heads_q=..."). Every refused call must leave both caches as they were.

def _valid_call(paged=False):
    i32 = torch.int32
    call = dict(q=torch.randn(2, 1, 4, 16), k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16),
                cache_seqlens=torch.tensor([3, 5], dtype=i32))
    if paged:  # 2 sequences x 3 pages of 4 rows: 12 rows each
        call["k_cache"], call["v_cache"] = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
        call["block_table"] = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=i32)
    else:
        call["k_cache"], call["v_cache"] = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    return call


def _rotary(rows=12, half=8):
    angle = torch.rand(rows, half)
    return dict(rotary_cos=angle.cos(), rotary_sin=angle.sin())


@pytest.mark.parametrize("paged", [False, True])
def test_validation_baseline_calls_are_valid(paged):
    # The calls every error case below starts from; they must pass so that each error is the change's.
    tileattn.flash_attn_with_kvcache(**_valid_call(paged))
    tileattn.flash_attn_with_kvcache(**_valid_call(paged), **_rotary(), causal=True, return_softmax_lse=True)


I32, I64 = torch.int32, torch.int64
# id: (paged, changes to the valid call, exception, pattern)
BAD_KVCACHE = {
    "block_table_int64": (True, lambda c: dict(block_table=c["block_table"].long()), TypeError, r"block_table"),
    "block_table_rank_1": (True, lambda c: dict(block_table=c["block_table"].flatten()), ValueError, r"block_table"),
    "block_table_rows": (True, lambda c: dict(block_table=c["block_table"][:1]), ValueError, r"block_table"),
    "block_table_page_out_of_range": (True, lambda c: dict(block_table=torch.tensor([[6, 0, 2], [1, 5, 3]],
                                                                                     dtype=I32)),
                                      ValueError, r"block_table"),
    "block_table_with_cache_batch_idx": (True, lambda c: dict(cache_batch_idx=torch.tensor([1, 0], dtype=I32)),
                                         ValueError, r"block_table|cache_batch_idx"),
    "paged_append_past_the_pages": (True, lambda c: dict(cache_seqlens=torch.tensor([3, 12], dtype=I32)),
                                    ValueError, r"cache_seqlens"),
    "k_without_v": (False, lambda c: dict(v=None), ValueError, r"\bv\b"),
    "v_without_k": (False, lambda c: dict(k=None), ValueError, r"\bk\b"),
    "k_heads": (False, lambda c: dict(k=torch.randn(2, 1, 1, 16)), ValueError, r"^k\.shape=\(2, 1, 1, 16\) must be"),
    "k_batch": (False, lambda c: dict(k=torch.randn(3, 1, 2, 16), v=torch.randn(3, 1, 2, 16)), ValueError,
                r"\bk\b"),
    "v_seqlen_differs_from_k": (False, lambda c: dict(v=torch.randn(2, 2, 2, 16)), ValueError, r"\bv\b"),
    "k_dtype": (False, lambda c: dict(k=c["k"].double()), TypeError, r"\bk\b"),
    "k_cache_dtype": (False, lambda c: dict(k_cache=c["k_cache"].half()), TypeError, r"k_cache"),
    "k_cache_rank": (False, lambda c: dict(k_cache=c["k_cache"][0]), ValueError, r"k_cache"),
    "cache_smaller_than_the_batch": (False, lambda c: dict(k_cache=c["k_cache"][:1], v_cache=c["v_cache"][:1]),
                                     ValueError, r"^k_cache\.shape\[0\]=1 must be at least q\.shape\[0\]=2"),
    "v_cache_shape": (False, lambda c: dict(v_cache=torch.randn(2, 11, 2, 16)), ValueError, r"v_cache"),
    "q_headdim": (False, lambda c: dict(q=torch.randn(2, 1, 4, 8)), ValueError,
                  r"^k_cache\.shape=\(2, 12, 2, 16\) must be \(2, 12, 2, 8\)"),
    "k_longer_than_the_cache": (False, lambda c: dict(k=torch.randn(2, 13, 2, 16), v=torch.randn(2, 13, 2, 16)),
                                ValueError, r"^k\.shape\[1\]=13 new keys exceed the cache's capacity=12"),
    "heads_kv_not_dividing_heads": (False, lambda c: dict(k_cache=torch.randn(2, 12, 3, 16),
                                                          v_cache=torch.randn(2, 12, 3, 16),
                                                          k=torch.randn(2, 1, 3, 16), v=torch.randn(2, 1, 3, 16)),
                                    ValueError, r"k_cache|\bq\b|heads_kv"),
    "q_rank": (False, lambda c: dict(q=c["q"][0]), ValueError, r"\bq\b"),
    "cache_seqlens_length": (False, lambda c: dict(cache_seqlens=torch.tensor([3, 5, 1], dtype=I32)), ValueError,
                             r"cache_seqlens"),
    "cache_seqlens_int64": (False, lambda c: dict(cache_seqlens=c["cache_seqlens"].long()), TypeError,
                            r"cache_seqlens"),
    "cache_seqlens_negative": (False, lambda c: dict(cache_seqlens=torch.tensor([-1, 5], dtype=I32)), ValueError,
                               r"cache_seqlens"),
    "append_past_the_cache": (False, lambda c: dict(cache_seqlens=torch.tensor([3, 12], dtype=I32)), ValueError,
                              r"cache_seqlens"),
    "cache_batch_idx_int64": (False, lambda c: dict(cache_batch_idx=torch.tensor([1, 0], dtype=I64)), TypeError,
                              r"cache_batch_idx"),
    "cache_batch_idx_length": (False, lambda c: dict(cache_batch_idx=torch.tensor([1], dtype=I32)), ValueError,
                               r"cache_batch_idx"),
    "cache_batch_idx_out_of_range": (False, lambda c: dict(cache_batch_idx=torch.tensor([1, 2], dtype=I32)),
                                     ValueError, r"cache_batch_idx"),
    "cache_leftpad_int64": (False, lambda c: dict(cache_leftpad=torch.tensor([0, 1], dtype=I64)), TypeError,
                            r"cache_leftpad"),
    "cache_leftpad_past_cache_seqlens": (False, lambda c: dict(cache_leftpad=torch.tensor([0, 7], dtype=I32),
                                                               k=None, v=None),
                                         ValueError, r"cache_leftpad"),
    "rotary_cos_without_k": (False, lambda c: dict(k=None, v=None, **_rotary()), ValueError, r"rotary_cos"),
    "rotary_cos_without_rotary_sin": (False, lambda c: dict(rotary_cos=_rotary()["rotary_cos"]), ValueError,
                                      r"rotary_sin"),
    "rotary_sin_shape": (False, lambda c: dict(rotary_cos=_rotary()["rotary_cos"],
                                               rotary_sin=_rotary(half=4)["rotary_sin"]),
                         ValueError, r"rotary_sin|rotary_cos"),
    "rotary_dim_past_headdim": (False, lambda c: dict(**_rotary(half=9)), ValueError, r"rotary_cos"),
    "rotary_too_few_positions": (False, lambda c: dict(**_rotary(rows=2)), ValueError, r"rotary_cos"),
    # Causal queries sit at their own positions: 3 queries after 11 cached keys reach row 13 of a
    # 12-row table (flash-attn reads past it).
    "rotary_queries_past_the_table": (False, lambda c: dict(q=torch.randn(2, 3, 4, 16), causal=True,
                                                            cache_seqlens=torch.tensor([3, 11], dtype=I32),
                                                            **_rotary()),
                                      ValueError, r"rotary_cos.*position 13.*at least 14 rows"),
    "alibi_slopes_shape": (False, lambda c: dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes"),
    "num_splits_negative": (False, lambda c: dict(num_splits=-1), ValueError, r"num_splits"),
    "num_splits_fractional": (False, lambda c: dict(num_splits=1.5), TypeError, r"^num_splits=1\.5 must be an integer"),
    "cache_seqlens_list": (False, lambda c: dict(cache_seqlens=[3, 5]), TypeError,
                           r"^cache_seqlens must be an int or an int32 tensor"),
}


@pytest.mark.parametrize("case", list(BAD_KVCACHE), ids=list(BAD_KVCACHE))
def test_validation_flash_attn_with_kvcache(case):
    paged, changes, error, pattern = BAD_KVCACHE[case]
    call = _valid_call(paged)
    call.update(changes(call))
    before = call["k_cache"].clone(), call["v_cache"].clone()
    with pytest.raises(error, match=pattern):
        tileattn.flash_attn_with_kvcache(**call)
    # A refused call writes nothing (the append must not run before every rule has been checked).
    assert_same(call["k_cache"], before[0], "k_cache after a refused call")
    assert_same(call["v_cache"], before[1], "v_cache after a refused call")


def _valid_varlen(paged=True):
    lens_q, lens_k = [2, 3], [5, 9]
    call = dict(q=torch.randn(5, 4, 16), cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k), max_seqlen_q=3,
                max_seqlen_k=9)
    if paged:  # 2 sequences x 3 pages of 4 rows
        call["k"], call["v"] = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
        call["block_table"] = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=I32)
    else:
        call["k"], call["v"] = torch.randn(14, 2, 16), torch.randn(14, 2, 16)
    return call


@pytest.mark.parametrize("paged", [False, True])
def test_validation_varlen_baseline_calls_are_valid(paged):
    tileattn.flash_attn_varlen_func(**_valid_varlen(paged), seqused_k=torch.tensor([4, 9], dtype=I32))


BAD_VARLEN = {
    "block_table_int64": (True, lambda c: dict(block_table=c["block_table"].long()), TypeError, r"block_table"),
    "block_table_rank_1": (True, lambda c: dict(block_table=c["block_table"].flatten()), ValueError, r"block_table"),
    "block_table_rows": (True, lambda c: dict(block_table=c["block_table"][:1]), ValueError, r"block_table"),
    "block_table_page_out_of_range": (True, lambda c: dict(block_table=torch.tensor([[4, 0, 2], [1, 9, 3]],
                                                                                     dtype=I32)),
                                      ValueError, r"block_table"),
    "sequence_longer_than_its_pages": (True, lambda c: dict(cu_seqlens_k=_cu([5, 13]), max_seqlen_k=13), ValueError,
                                       r"block_table|cu_seqlens_k|max_seqlen_k"),
    "paged_k_rank": (True, lambda c: dict(k=c["k"].flatten(0, 1), v=c["v"].flatten(0, 1)), ValueError, r"\bk\b"),
    "seqused_k_int64": (False, lambda c: dict(seqused_k=torch.tensor([4, 9], dtype=I64)), TypeError, r"seqused_k"),
    "seqused_k_length": (False, lambda c: dict(seqused_k=torch.tensor([4, 9, 1], dtype=I32)), ValueError,
                         r"seqused_k"),
    "seqused_k_past_the_sequence": (False, lambda c: dict(seqused_k=torch.tensor([6, 9], dtype=I32)), ValueError,
                                    r"seqused_k"),
    "seqused_k_negative": (True, lambda c: dict(seqused_k=torch.tensor([-1, 9], dtype=I32)), ValueError,
                           r"seqused_k"),
}


@pytest.mark.parametrize("case", list(BAD_VARLEN), ids=list(BAD_VARLEN))
def test_validation_varlen(case):
    paged, changes, error, pattern = BAD_VARLEN[case]
    call = _valid_varlen(paged)
    call.update(changes(call))
    with pytest.raises(error, match=pattern):
        tileattn.flash_attn_varlen_func(**call)


def test_window_reads_against_the_cache_as_flash_attn():
    # flash-attn reads a window against the cache's keys per sequence (4 here): a left-only window
    # is bounded on the right there, and a side reaching every cache row is unbounded. With 10
    # queries over 2 cached keys, (1, -1) is (1, 4): queries 0-3 see no key.
    q = torch.randn(1, 10, 2, 16)
    k_cache = torch.randn(1, 4, 1, 16)
    v_cache = torch.randn(1, 4, 1, 16)
    scale = 16 ** -0.5
    for window, applied in (((1, -1), (1, 4)), ((-1, 4), (-1, -1)), ((2, 1), (2, 1))):
        out, lse = tileattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2, window_size=window,
                                                    return_softmax_lse=True)
        ref_out, ref_lse = attend(q[0].double(), k_cache[0, :2].double(), v_cache[0, :2].double(), scale, False,
                                  applied, 0.0, None)
        assert naive.max_error(out[0], ref_out) < 1e-5, window
        assert naive.max_error(lse[0], naive.flash_lse(ref_lse)) < 1e-5, window
