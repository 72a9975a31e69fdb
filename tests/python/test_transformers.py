"""Drop-in use in a Hugging Face causal LM (random weights from a tiny config, nothing downloaded):
same logits, loss and parameter gradients as the model's own SDPA attention; greedy generation
with a KV cache (bottom-right causal with fewer queries than keys; dynamic or static) gives the
same tokens; padded batches and packed sequences give the same loss and gradients, and so does
torch.compile(fullgraph=True). The attention function alone against float64: cross-attention masks,
encoder sliding windows, packing in every row, and the refusal of score modifiers the kernels lack."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tileattn.hf  # noqa: E402


def _tiny_llama(dtype, device):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _use(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _run(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float(), [p.grad.float() for p in model.parameters()]


DEVICES = [pytest.param("cpu", torch.float32, 1e-5, id="cpu-fp32"),
           pytest.param("cuda", torch.float32, 1e-4, id="cuda-fp32", marks=pytest.mark.gpu),
           pytest.param("cuda", torch.bfloat16, None, id="cuda-bf16", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,dtype,tolerance", DEVICES)
def test_llama_matches_its_sdpa_attention(device, dtype, tolerance):
    name = tileattn.hf.register()
    reference = _tiny_llama(torch.float32, device)
    ids = torch.randint(0, 256, (2, 96), device=device)
    ref_logits, ref_loss, ref_grads = _run(reference, ids)

    sdpa = copy.deepcopy(reference).to(dtype)
    ours = copy.deepcopy(reference).to(dtype)
    _use(ours, name)
    assert ours.config._attn_implementation == name
    sdpa_logits, sdpa_loss, sdpa_grads = _run(sdpa, ids)
    our_logits, our_loss, our_grads = _run(ours, ids)

    if tolerance is not None:
        torch.testing.assert_close(our_logits, sdpa_logits, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(our_loss, sdpa_loss, atol=tolerance, rtol=tolerance)
        for a, b in zip(our_grads, sdpa_grads):
            torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance * 10)
        return
    # Lower precision: the model-level 2x rule against the float32 run of the same weights.
    def err(a, b):
        return float((a - b).abs().max())

    assert err(our_logits, ref_logits) <= 2 * err(sdpa_logits, ref_logits) + 1e-3
    assert abs(float(our_loss - ref_loss)) <= 2 * abs(float(sdpa_loss - ref_loss)) + 1e-3
    worst = max(err(a, r) / (err(b, r) + 1e-6) for a, b, r in zip(our_grads, sdpa_grads, ref_grads))
    assert worst <= 2.0, worst


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_llama_greedy_generation_with_kv_cache(device):
    name = tileattn.hf.register()
    reference = _tiny_llama(torch.float32, device).eval()
    ours = copy.deepcopy(reference)
    _use(ours, name)
    # Token 0 is the pad id: a prompt holding it would make generate() infer a padding mask.
    prompt = torch.randint(1, 256, (1, 12), device=device)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def _run_masked(model, ids, labels, **inputs):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, **inputs)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same_training_step(ours, reference, valid, tolerance=1e-5):
    (our_logits, our_loss, our_grads), (ref_logits, ref_loss, ref_grads) = ours, reference
    # Padded positions carry no loss (label -100) and their outputs are unspecified in SDPA.
    torch.testing.assert_close(our_logits[valid], ref_logits[valid], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(our_loss, ref_loss, atol=tolerance, rtol=tolerance)
    for a, b in zip(our_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance * 10)


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_padded_batch_matches_sdpa(side):
    name = tileattn.hf.register()
    reference = _tiny_llama(torch.float32, "cpu")
    ours = copy.deepcopy(reference)
    _use(ours, name)
    lengths = [40, 23, 1, 33]
    seqlen = max(lengths)
    ids = torch.randint(1, 256, (len(lengths), seqlen))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, seqlen - n:] = 1
        else:
            mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    # Each row's positions count from its first real token, as the tokenizer's padding gives them.
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    inputs = dict(attention_mask=mask, position_ids=position_ids)
    _assert_same_training_step(_run_masked(ours, ids, labels, **inputs), _run_masked(reference, ids, labels, **inputs),
                               mask.bool())


def _flattened(lengths):
    """One row holding several sequences, as transformers' DataCollatorWithFlattening returns it."""
    ids = torch.randint(1, 256, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    labels[0, starts] = -100  # no token predicts the first one of the next sequence
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return ids, labels, position_ids, cu


@pytest.mark.parametrize("boundaries", ["flash_kwargs", "position_ids"])
def test_llama_packed_sequences_match_sdpa(boundaries):
    name = tileattn.hf.register()
    reference = _tiny_llama(torch.float32, "cpu")
    ours = copy.deepcopy(reference)
    _use(ours, name)
    lengths = [17, 40, 5, 30]
    ids, labels, position_ids, cu = _flattened(lengths)
    # SDPA sees the packing through position_ids: without a cache, transformers builds a
    # block-diagonal mask from them (a training step, as the flattening collator feeds it).
    expected = _run_masked(reference, ids, labels, position_ids=position_ids, use_cache=False)
    inputs = dict(position_ids=position_ids, use_cache=False)
    if boundaries == "flash_kwargs":
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    got = _run_masked(ours, ids, labels, **inputs)
    _assert_same_training_step(got, expected, torch.ones_like(ids, dtype=torch.bool))
    # And the packing matters: one causal sequence over the whole row gives other logits past the
    # first sequence, by far more than the tolerance above (the loss, a mean over every token, can
    # move by less than 1e-4 for some random models).
    unpacked = _run_masked(reference, ids, labels, position_ids=torch.arange(ids.shape[1])[None], use_cache=False)
    assert float((unpacked[0] - expected[0]).abs().max()) > 1e-3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True])
def test_generation_matches_sdpa(cache, padded):
    # Left-padded prompts, then decoding with a cache: queries are the last tokens of each row. A
    # static cache holds more key slots than tokens seen; generate() drops an all-ones mask, so the
    # mask function tells attention_forward how many slots are filled.
    name = tileattn.hf.register()
    reference = _tiny_llama(torch.float32, "cpu").eval()
    ours = copy.deepcopy(reference)
    _use(ours, name)
    prompt = torch.randint(1, 256, (2, 12))
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


@pytest.mark.parametrize("padding", [False, True])
def test_compiled_fullgraph_training_step_matches_sdpa(padding):
    # Traced, nothing may read a tensor on the host (the mask function's verdict, an all-ones check,
    # the unpadded lengths): a graph break is an error with fullgraph=True. Row 0 has no padding, so
    # the padded layout also holds a row whose padding sequence is empty; row 2 one real token.
    name = tileattn.hf.register()
    reference = _tiny_llama(torch.float32, "cpu")
    ours = copy.deepcopy(reference)
    _use(ours, name)
    ids = torch.randint(1, 256, (3, 24))
    mask = torch.ones_like(ids)
    inputs = dict(use_cache=False)
    if padding:
        mask[1, :9] = 0
        mask[2, :23] = 0
        inputs.update(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    labels = ids.masked_fill(mask == 0, -100)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    _assert_same_training_step(_run_masked(compiled, ids, labels, **inputs),
                               _run_masked(reference, ids, labels, **inputs), mask.bool())


def test_compiled_graph_refuses_packing_marked_by_position_ids_alone():
    # A graph cannot lay out a data-dependent number of sequences: it raises when it meets packed
    # position_ids rather than attend across their boundaries; ordinary positions pass.
    boundaries = torch.compile(lambda p: tileattn.hf._packed_boundaries(p, 2, 6), fullgraph=True, backend="aot_eager")
    assert boundaries(torch.arange(6)[None]) is None
    with pytest.raises(RuntimeError, match="position_ids restart inside a row"):
        boundaries(torch.tensor([[0, 1, 2, 0, 1, 2]]))


def _padding_cases():
    left = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8, [0] * 7 + [1], [0] * 8])
    right = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1] * 8, [1] + [0] * 7, [1, 0, 1, 1, 0, 1, 1, 1]])
    # (mask, seqlen_q, seqlen_k, masks_queries): self-attention, a cache step (fewer queries, and a
    # static cache's extra key slots), cross-attention.
    return [(left, 8, 8, True), (right, 8, 8, True), (torch.ones(2, 8), 8, 8, True), (left, 3, 8, True),
            (left, 1, 12, True), (right, 3, 8, False)]


@pytest.mark.parametrize("mask,seqlen_q,seqlen_k,masks_queries", _padding_cases())
def test_traceable_padding_matches_the_eager_unpadding(mask, seqlen_q, seqlen_k, masks_queries):
    # What torch.compile runs for a padded batch (static shapes: the padding as sequences of its
    # own) gives the eager path's outputs and gradients, dropout included, for any padding pattern.
    batch = mask.shape[0]
    q = torch.randn(batch, seqlen_q, 4, 16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, 2, 16, requires_grad=True) for _ in range(2))
    options = dict(dropout_p=0.25, softmax_scale=None, causal=masks_queries, window_size=(-1, -1), softcap=0.0)
    results = []
    for padded in (tileattn.hf._padded, tileattn.hf._padded_traceable):
        torch.manual_seed(3)
        out = padded(q, k, v, mask, masks_queries, **options)
        results.append((out, *torch.autograd.grad((out ** 2).sum(), (q, k, v))))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_traced_static_cache_mask_covers_the_filled_slots(causal):
    # Traced, a static cache's filled length is a tensor: the mask covers every slot, and the
    # queries are those ending at the last filled one -- as the eager mask of the filled length.
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    mask_function = causal_mask_function if causal else bidirectional_mask_function
    mask = tileattn.hf._unfilled_traceable(2, 2, 8, torch.tensor(3), 0, mask_function, "cpu")
    filled = 5 if causal else 8
    assert torch.equal(mask, (torch.arange(8) < filled).expand(2, 8))
    q, k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    options = dict(dropout_p=0.0, softmax_scale=None, causal=causal, window_size=(-1, -1), softcap=0.0)
    eager = tileattn.hf._padded(q, k, v, torch.ones(2, filled, dtype=torch.bool), True, **options)
    torch.testing.assert_close(tileattn.hf._padded_traceable(q, k, v, mask, True, **options), eager, atol=1e-6,
                               rtol=1e-6)


def test_llama_training_dropout_reaches_the_kernel():
    # attention_dropout in training mode is the library's dropout: the step is reproducible from
    # torch.manual_seed, changes with the seed, and differs from the same step without dropout.
    name = tileattn.hf.register()
    model = _tiny_llama(torch.float32, "cpu")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    _use(model, name)
    model.train()
    ids = torch.randint(1, 256, (2, 24))

    def step(seed):
        torch.manual_seed(seed)
        return _run(model, ids)

    _, loss_a, grads_a = step(7)
    _, loss_b, grads_b = step(7)
    _, loss_c, _ = step(8)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert not torch.equal(loss_a, loss_c)
    model.eval()
    _, loss_eval, _ = _run(model, ids)
    assert not torch.equal(loss_a, loss_eval)
    assert all(torch.isfinite(g).all() for g in grads_a)


class _Module(torch.nn.Module):
    def __init__(self, **flags):
        super().__init__()
        for key, value in flags.items():
            setattr(self, key, value)


def _attention64(q, k, v, visible):
    """float64 softmax(q k^T / sqrt(d)) v over (batch, heads, seqlen, d), visible (batch, sq, sk)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bqhd", s.softmax(-1), v.double())


def test_cross_attention_mask_is_the_keys_alone():
    # A decoder (3 queries) attending to a right-padded encoder (6 keys): every query row attends
    # to its row's real keys; the mask says nothing of the queries.
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    for flags in (dict(is_decoder=True, is_causal=False), dict(is_cross_attention=True, is_causal=False)):
        out, _ = tileattn.hf.attention_forward(_Module(**flags), q, k, v, mask)
        expected = _attention64(q, k, v, mask.bool()[:, None, :].expand(2, 3, 6))
        assert (out.double() - expected).abs().max() < 1e-5, flags


def test_bidirectional_sliding_window_is_symmetric():
    # transformers' flash window for an encoder: sliding_window - 1 keys on each side.
    q, k, v = (torch.randn(1, 2, 10, 16) for _ in range(3))
    out, _ = tileattn.hf.attention_forward(_Module(is_causal=False), q, k, v, None, sliding_window=3)
    i = torch.arange(10)
    expected = _attention64(q, k, v, ((i[:, None] - i[None, :]).abs() <= 2)[None])
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["s_aux", "position_bias"])
def test_score_modifiers_the_kernels_lack_are_refused(name):
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(NotImplementedError, match=rf"^{name}: .* is not supported by tileattn's kernels"):
        tileattn.hf.attention_forward(_Module(is_causal=True), q, q, q, None, **{name: torch.zeros(2)})


def test_packed_position_ids_in_every_row():
    # Two rows, each holding two sequences (position_ids restart): no token attends across one.
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    out, _ = tileattn.hf.attention_forward(_Module(is_causal=True), q, k, v, None, position_ids=position_ids)
    sequence = (position_ids == 0).cumsum(-1)
    i = torch.arange(8)
    visible = (sequence[:, :, None] == sequence[:, None, :]) & (i[None, :, None] >= i[None, None, :])
    assert (out.double() - _attention64(q, k, v, visible)).abs().max() < 1e-5


def test_output_attentions_warns_once():
    import tileattn.hf as hf
    hf._warned["output_attentions"] = False
    q = torch.randn(1, 2, 4, 16)
    with pytest.warns(UserWarning, match="tileattn does not return attention weights"):
        out, weights = hf.attention_forward(_Module(is_causal=True), q, q, q, None, output_attentions=True)
    assert weights is None
