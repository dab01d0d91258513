"""``generate`` through the KV cache gives the tokens and logits of a no-cache run: greedy, sampling, beam search and
prompt-lookup decoding, batched with left padding (prompt lookup: transformers allows batch size 1 only)."""

from __future__ import annotations

import pytest
import torch
from hf_rbf.cache_names import CACHE_NAME
from conftest import build_model, generate_with_logits
from transformers import DynamicCache


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


TOL = 1e-5
PAD = 0


def _prompts(vocab: int, lengths, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.full((len(lengths), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length :] = torch.randint(1, vocab, (length,), generator=gen)
        mask[b, n - length :] = 1
    return ids, mask


def _generate(model, ids, mask, use_cache: bool, seed: int = 0, **kwargs):
    return generate_with_logits(model, ids, mask, use_cache=use_cache, seed=seed, pad=PAD, **kwargs)


def _full_recompute_logits(model, sequences, prompt_mask):
    """Step logits recomputed by one no-cache forward over the whole generated sequence."""
    gen_len = sequences.shape[1] - prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, torch.ones(prompt_mask.shape[0], gen_len, dtype=prompt_mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=mask, use_cache=False).logits
    return logits[:, prompt_mask.shape[1] - 1 : -1]


MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_with_cache_equals_without(core_case, mode):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    ids, mask = _prompts(model.config.vocab_size, [7, 4, 5])
    kwargs = dict(MODES[mode], max_new_tokens=6, min_new_tokens=6)
    cached = _generate(model, ids, mask, use_cache=True, **kwargs)
    uncached = _generate(model, ids, mask, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.logits, uncached.logits):
        assert (a - b).abs().max().item() < TOL
    if mode != "beam":
        # the step logits equal one forward over the finished sequences
        recomputed = _full_recompute_logits(model, cached.sequences, mask)
        steps = torch.stack(cached.logits, dim=1)
        assert (steps - recomputed).abs().max().item() < TOL


def test_prompt_lookup_decoding_equals_greedy(core_case):
    _, family, overrides = core_case
    model = build_model(family, overrides)
    gen = torch.Generator().manual_seed(1)
    motif = torch.randint(1, model.config.vocab_size, (4,), generator=gen)
    ids = torch.cat([motif, motif, motif[:2]]).unsqueeze(0)  # repeated n-grams give the lookup candidates
    mask = torch.ones_like(ids)
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        lookup = _generate(
            model, ids, mask, use_cache=True, do_sample=False, max_new_tokens=8, prompt_lookup_num_tokens=3
        )
    finally:
        hook.remove()
    greedy = _generate(model, ids, mask, use_cache=False, do_sample=False, max_new_tokens=8)
    assert torch.equal(lookup.sequences, greedy.sequences)
    # the lookup proposed candidates: the first forward verified them along with the prompt, and the cache was cropped
    # back to the accepted tokens (later several-token verification steps over a filled cache happen when the
    # continuation repeats itself; chunked steps over a filled cache are tested in test_model_cache.py)
    assert calls[0] > ids.shape[1]
    for a, b in zip(lookup.logits, greedy.logits):
        assert (a - b).abs().max().item() < TOL


def test_generate_with_user_cache_and_continuation():
    """A user's ``DynamicCache()`` through ``generate``, then a second ``generate`` continuing the same cache."""
    model = build_model("gka", dict(num_hidden_layers=4, attention_layers=["gka", "dot"], num_register_tokens=2))
    ids, mask = _prompts(model.config.vocab_size, [5, 3])
    cache = DynamicCache()
    with torch.no_grad():
        first = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **{CACHE_NAME: cache},
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=PAD,
        )
        mask2 = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
        second = model.generate(
            input_ids=first,
            attention_mask=mask2,
            **{CACHE_NAME: cache},
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=PAD,
        )
        reference = model.generate(
            input_ids=ids, attention_mask=mask, use_cache=False, max_new_tokens=6, do_sample=False, pad_token_id=PAD
        )
    assert torch.equal(second, reference)


def test_unsupported_cache_implementation_is_rejected_with_a_clear_error():
    # "static" is supported (tests/test_model_static_cache.py); quantized caches are not
    model = build_model("rbf", {})
    ids = torch.randint(1, 128, (1, 4))
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, max_new_tokens=2, cache_implementation="quantized", pad_token_id=PAD)
