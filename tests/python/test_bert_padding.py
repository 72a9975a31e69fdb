"""tileattn.bert_padding against flash-attn's semantics, each result checked against a hand
computation (explicit loops over the mask); gradients by gradcheck in float64; the argument
errors."""

import pytest
import torch

import naive
import tileattn
from tileattn.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                   unpad_input_for_concatenated_sequences)


def random_mask(batch, seqlen, dtype=torch.bool):
    """Random padding, with an empty row and a full row whenever the batch has room for them."""
    mask = torch.rand(batch, seqlen) < 0.6
    if batch >= 3:
        mask[0] = False
        mask[1] = True
    return mask.to(dtype)


def by_hand(mask):
    """indices, cu_seqlens, lengths of a (batch, seqlen) mask, from Python loops."""
    indices, cu, lengths = [], [0], []
    for b in range(mask.shape[0]):
        n = 0
        for s in range(mask.shape[1]):
            if mask[b, s]:
                indices.append(b * mask.shape[1] + s)
                n += 1
        lengths.append(n)
        cu.append(cu[-1] + n)
    return indices, cu, lengths


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64])
def test_unpad_input_returns_the_masked_rows_indices_offsets_and_lengths(mask_dtype):
    batch, seqlen = 5, 7
    hidden = torch.randn(batch, seqlen, 3, 4)
    mask = random_mask(batch, seqlen, mask_dtype)
    rows, indices, cu, longest, used = unpad_input(hidden, mask)
    want_indices, want_cu, want_lengths = by_hand(mask)
    assert indices.dtype == torch.int64 and indices.tolist() == want_indices
    assert cu.dtype == torch.int32 and cu.tolist() == want_cu
    assert type(longest) is int and longest == max(want_lengths)
    assert used.dtype == torch.int32 and used.tolist() == want_lengths
    assert torch.equal(rows, torch.stack([hidden[i // seqlen, i % seqlen] for i in want_indices]))


def test_unpad_input_gathers_unused_slots_but_counts_only_used_tokens():
    batch, seqlen = 4, 9
    hidden = torch.randn(batch, seqlen, 6)
    used_len = torch.randint(0, seqlen + 1, (batch,))
    slots = torch.randint(0, seqlen + 1, (batch,))
    used_len[0], slots[0] = 2, 6  # one row with unused slots for sure
    positions = torch.arange(seqlen)
    attention = positions < used_len[:, None]
    # Allocated but unused: the slots after each row's tokens, up to its allocation.
    unused = (positions >= used_len[:, None]) & (positions < torch.maximum(slots, used_len)[:, None])
    rows, indices, cu, longest, seqused = unpad_input(hidden, attention.int(), unused.int())
    want_indices, want_cu, want_lengths = by_hand(attention | unused)
    assert indices.tolist() == want_indices and cu.tolist() == want_cu and longest == max(want_lengths)
    assert seqused.tolist() == used_len.tolist()
    assert torch.equal(rows, hidden.reshape(-1, 6)[want_indices])


def test_unpad_input_of_an_empty_batch_has_no_tokens_and_max_seqlen_0():
    rows, indices, cu, longest, used = unpad_input(torch.randn(0, 5, 2), torch.zeros(0, 5, dtype=torch.bool))
    assert rows.shape == (0, 2) and indices.numel() == 0 and cu.tolist() == [0] and longest == 0
    assert used.numel() == 0


def test_unpad_input_reads_a_non_contiguous_batch():
    hidden = torch.randn(6, 3, 4).transpose(0, 1)  # (batch 3, seqlen 6, 4), strided
    mask = random_mask(3, 6)
    rows, indices, *_ = unpad_input(hidden, mask)
    assert torch.equal(rows, hidden.contiguous().reshape(-1, 4)[indices])


def test_pad_input_puts_rows_back_and_zeros_the_padding():
    batch, seqlen = 4, 6
    hidden = torch.randn(batch, seqlen, 2, 3)
    mask = random_mask(batch, seqlen)
    rows, indices, *_ = unpad_input(hidden, mask)
    padded = pad_input(rows, indices, batch, seqlen)
    assert padded.shape == hidden.shape
    assert torch.equal(padded, torch.where(mask[:, :, None, None], hidden, torch.zeros(())))


def test_unpad_input_of_pad_input_gives_the_rows_back():
    batch, seqlen = 3, 8
    mask = random_mask(batch, seqlen)
    _, indices, *_ = unpad_input(torch.zeros(batch, seqlen, 1), mask)
    rows = torch.randn(indices.shape[0], 5)
    again, indices_again, *_ = unpad_input(pad_input(rows, indices, batch, seqlen), mask)
    assert torch.equal(again, rows) and torch.equal(indices_again, indices)


def test_unpad_for_concatenated_sequences_follows_flash_attns_example():
    # The example of flash-attn's docstring: each row lists the lengths of the sequences packed into it.
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    hidden = torch.randn(3, 6, 4)
    rows, indices, cu, longest = unpad_input_for_concatenated_sequences(hidden, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16]
    assert type(longest) is int and longest == 6
    assert torch.equal(rows, hidden.reshape(-1, 4)[indices])


def test_unpad_for_concatenated_sequences_gives_one_offset_per_sequence():
    batch, seqlen = 4, 10
    table = torch.zeros(batch, seqlen, dtype=torch.int64)
    want_indices, want_cu = [], [0]
    for b in range(batch):
        room, k = seqlen, 0
        while room and torch.rand(()) < 0.8:
            n = int(torch.randint(1, room + 1, ()))
            table[b, k], room, k = n, room - n, k + 1
            want_cu.append(want_cu[-1] + n)
        want_indices += [b * seqlen + s for s in range(seqlen - room)]
    hidden = torch.randn(batch, seqlen, 3)
    rows, indices, cu, longest = unpad_input_for_concatenated_sequences(hidden, table)
    assert indices.tolist() == want_indices and cu.tolist() == want_cu
    assert longest == (max(table.flatten().tolist()) if len(want_cu) > 1 else 0)
    assert torch.equal(rows, hidden.reshape(-1, 3)[want_indices])


def test_index_first_axis_is_indexing_and_index_put_first_axis_its_scatter():
    x = torch.randn(9, 2, 3)
    indices = torch.randperm(9)[:5]
    assert torch.equal(index_first_axis(x, indices), x[indices])
    assert torch.equal(index_first_axis(x, indices.int()), x[indices])
    out = index_put_first_axis(x[:5], indices, 9)
    want = torch.zeros(9, 2, 3)
    for row, i in enumerate(indices.tolist()):
        want[i] = x[row]
    assert torch.equal(out, want)


def test_gradients_of_the_gather_and_scatter():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    repeated = torch.tensor([4, 0, 4, 6, 2])  # a repeated row's gradient is the sum of its uses
    torch.autograd.gradcheck(lambda t: index_first_axis(t, repeated), (x,))
    values = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    distinct = torch.randperm(9)[:4]
    torch.autograd.gradcheck(lambda t: index_put_first_axis(t, distinct, 9), (values,))


def test_gradients_of_unpad_and_pad_input():
    batch, seqlen = 3, 5
    mask = random_mask(batch, seqlen)
    hidden = torch.randn(batch, seqlen, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (hidden,))
    _, indices, *_ = unpad_input(hidden.detach(), mask)
    rows = torch.randn(indices.shape[0], 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: pad_input(t, indices, batch, seqlen), (rows,))


def test_varlen_attention_over_unpadded_rows_equals_attention_over_each_rows_tokens():
    batch, seqlen, heads, d = 3, 9, 2, 16
    q, k, v = (torch.randn(batch, seqlen, heads, d) for _ in range(3))
    mask = torch.arange(seqlen) < torch.tensor([9, 4, 1])[:, None]
    (qu, indices, cu, longest, _), ku, vu = unpad_input(q, mask), unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(tileattn.flash_attn_varlen_func(qu, ku, vu, cu, cu, longest, longest, causal=True), indices,
                    batch, seqlen)
    for b in range(batch):
        n = int(mask[b].sum())
        want, _ = naive.attention(*(t[b:b + 1, :n].double() for t in (q, k, v)), causal=True)
        torch.testing.assert_close(out[b, :n], want[0].float(), rtol=1e-5, atol=1e-5)
        assert not out[b, n:].any()


def test_bad_masks_are_refused_by_name():
    hidden = torch.randn(2, 4, 3)
    with pytest.raises(tileattn.InvalidArgumentError, match=r"attention_mask.shape=\(2, 5\) must be \(batch, seqlen\)"):
        unpad_input(hidden, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(tileattn.InvalidTypeError, match=r"attention_mask.dtype=float32 must be bool or an integer"):
        unpad_input(hidden, torch.ones(2, 4))
    with pytest.raises(tileattn.InvalidArgumentError, match=r"unused_mask.shape=\(4, 2\)"):
        unpad_input(hidden, torch.ones(2, 4, dtype=torch.bool), torch.zeros(4, 2, dtype=torch.bool))
    with pytest.raises(tileattn.InvalidArgumentError, match=r"hidden_states must have at least 2 dimension"):
        unpad_input(torch.randn(4), torch.ones(4, dtype=torch.bool))
    with pytest.raises(tileattn.InvalidArgumentError, match=r"each row's must sum to at most seqlen=4"):
        unpad_input_for_concatenated_sequences(hidden, torch.tensor([[3, 2, 0, 0], [1, 0, 0, 0]]))
    with pytest.raises(tileattn.InvalidArgumentError, match=r"lengths must be >= 0"):
        unpad_input_for_concatenated_sequences(hidden, torch.tensor([[3, -1, 0, 0], [1, 0, 0, 0]]))
    with pytest.raises(tileattn.InvalidTypeError, match=r"attention_mask_in_length must be an integer tensor"):
        unpad_input_for_concatenated_sequences(hidden, torch.ones(2, 4, dtype=torch.bool))


def test_bad_indices_and_sizes_are_refused_by_name():
    rows = torch.randn(3, 2)
    with pytest.raises(tileattn.InvalidArgumentError, match=r"indices must be in \[0, 8\) \(batch \* seqlen\), "
                                                             r"got values in \[1, 8\]"):
        pad_input(rows, torch.tensor([1, 5, 8]), 2, 4)
    with pytest.raises(tileattn.InvalidArgumentError, match=r"indices must be in \[0, 3\) \(input.shape\[0\]\)"):
        index_first_axis(rows, torch.tensor([-1]))
    with pytest.raises(tileattn.InvalidArgumentError, match=r"indices.shape\[0\]=2 must equal values.shape\[0\]=3"):
        index_put_first_axis(rows, torch.tensor([0, 1]), 5)
    with pytest.raises(tileattn.InvalidArgumentError, match=r"indices must be 1-D"):
        index_first_axis(rows, torch.tensor([[0, 1]]))
    with pytest.raises(tileattn.InvalidTypeError, match=r"indices.dtype=float32 must be int64 or int32"):
        index_first_axis(rows, torch.tensor([0.0]))
    with pytest.raises(tileattn.InvalidArgumentError, match=r"batch=-1 must be >= 0"):
        pad_input(rows, torch.tensor([0, 1, 2]), -1, 4)
    with pytest.raises(tileattn.InvalidTypeError, match=r"seqlen=2.5 must be an integer"):
        pad_input(rows, torch.tensor([0, 1, 2]), 2, 2.5)


@pytest.mark.gpu
def test_unpad_and_pad_on_the_gpu_match_the_cpu(cuda):
    hidden = torch.randn(4, 6, 3)
    mask = random_mask(4, 6)
    want = unpad_input(hidden, mask)
    got = unpad_input(hidden.to(cuda), mask.to(cuda))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b) if isinstance(b, torch.Tensor) else a == b
    assert torch.equal(pad_input(got[0], got[1], 4, 6).cpu(), pad_input(want[0], want[1], 4, 6))
