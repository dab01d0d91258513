"""What transformers' own model tests (tests/test_modeling_common.py, tests/generation/test_utils.py) expect of any
in-library causal LM, checked on every hf_rbf family: the cache under both of its names and returned under the
installed one, cached decoding equal to recomputation in every decoding mode (the guard against a silently dropped
cache), the Cache API of every family's cache layers, GenerationMixin among the direct bases, transformers'
``attn_implementation`` switch, truthful ``_supports_*`` flags and clear errors for malformed inputs.

Each test builds tiny models (conftest.py), so the module runs in well under a minute on 2 cores; CI runs it on both
ends of the supported transformers range (``contract``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import build_model, generate_with_logits, make_config
from hf_rbf.cache_names import CACHE_NAME, OTHER_CACHE_NAME, output_cache
from sorted_cache_helpers import PAD, left_padded
from transformers import AutoModelForCausalLM, GenerationMixin


pytestmark = pytest.mark.contract

# Every family with its default attention, one register token (the prefix path) and an "SSL" window pattern on three
# layers (sliding cache layers next to full ones).
FAMILIES = {
    "rbf": dict(num_register_tokens=1, num_hidden_layers=3, window_pattern="SSL", sliding_window=4),
    "gka": dict(num_register_tokens=1, num_hidden_layers=3, window_pattern="SSL", sliding_window=4),
    "scalar_sort": dict(num_register_tokens=1),
    "hybrid_sort": dict(num_register_tokens=1),
}
# float32 logits of the same model through two summation orders (cached vs recomputed): equal to ~1e-5 relative
TOL = 5e-5


def _model(family: str, seed: int = 0, **extra):
    return build_model(family, {**FAMILIES[family], **extra}, seed=seed)


def _generate(model, ids, mask, *, use_cache: bool, seed: int = 0, **kwargs):
    return generate_with_logits(model, ids, mask, use_cache=use_cache, seed=seed, pad=PAD, **kwargs)


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


# ----------------------------------------------------------------------------------------------------------------
# the cache's name (transformers 5.24 renamed past_key_values -> cache)
# ----------------------------------------------------------------------------------------------------------------


def test_forward_takes_the_cache_under_both_names_and_returns_it_under_the_installed_one(family):
    model = _model(family)
    ids = torch.randint(1, 128, (2, 6))
    with torch.no_grad():
        prefill = model(ids[:, :4], use_cache=True)
        cache = output_cache(prefill)
        assert cache is not None and cache.get_seq_length() == 4
        assert CACHE_NAME in prefill.keys()
        step_new = model(ids[:, 4:], cache=cache).logits  # the name from transformers 5.24 on
        reference = model(ids, use_cache=False).logits[:, 4:]
        fresh = output_cache(model(ids[:, :4], use_cache=True))
        step_old = model(ids[:, 4:], past_key_values=fresh).logits  # the name before
    assert (step_new - reference).abs().max().item() < TOL
    assert (step_old - reference).abs().max().item() < TOL


def test_the_cache_given_twice_is_an_error(family):
    model = _model(family)
    ids = torch.randint(1, 128, (1, 3))
    with torch.no_grad():
        a, b = model.make_cache(), model.make_cache()
        with pytest.raises(ValueError, match="`cache`.*`past_key_values`"):
            model(ids, cache=a, past_key_values=b)
        model(ids, cache=a, past_key_values=a)  # the same object under both names is unambiguous


def test_outputs_without_a_cache_and_as_tuples(family):
    model = _model(family)
    ids = torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        out = model(ids, use_cache=False)
        assert output_cache(out) is None and OTHER_CACHE_NAME not in type(out).__dataclass_fields__
        as_tuple = model(ids, use_cache=False, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.logits)


def test_no_deprecation_warning_in_normal_use(family):
    """Forward, cached generate and a user's cache through ``generate`` (under the installed name) trigger neither a
    Python deprecation warning nor transformers' logged one (the autouse fixture in conftest.py fails on those)."""
    model = _model(family)
    ids, mask = left_padded(128, [5, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=True)
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=3,
                do_sample=False,
                pad_token_id=PAD,
                **{CACHE_NAME: model.make_cache()},
            )


# ----------------------------------------------------------------------------------------------------------------
# cached decoding == recomputation, in every decoding mode (the guard that fails loudly instead of wrong text)
# ----------------------------------------------------------------------------------------------------------------

MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2, early_stopping=False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_cached_generate_equals_uncached_on_a_left_padded_batch(family, mode):
    model = _model(family)
    ids, mask = left_padded(model.config.vocab_size, [7, 3, 5])
    kwargs = dict(MODES[mode], max_new_tokens=8, min_new_tokens=8)
    cached = _generate(model, ids, mask, use_cache=True, **kwargs)
    uncached = _generate(model, ids, mask, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.logits, uncached.logits):
        assert (a - b).abs().max().item() < TOL


def test_cached_greedy_equals_uncached_on_one_unpadded_prompt(family):
    """The case transformers 5.24 broke silently: one prompt, no padding, no error, wrong tokens after a few steps."""
    model = _model(family, seed=3)
    ids = torch.randint(1, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=PAD)
        uncached = model.generate(
            ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=PAD, use_cache=False
        )
    assert torch.equal(cached, uncached)


def test_prompt_lookup_decoding_equals_greedy(family):
    model = _model(family)
    gen = torch.Generator().manual_seed(1)
    motif = torch.randint(1, model.config.vocab_size, (4,), generator=gen)
    ids = torch.cat([motif, motif, motif[:2]]).unsqueeze(0)
    mask = torch.ones_like(ids)
    lookup = _generate(model, ids, mask, use_cache=True, do_sample=False, max_new_tokens=8, prompt_lookup_num_tokens=3)
    greedy = _generate(model, ids, mask, use_cache=False, do_sample=False, max_new_tokens=8)
    assert torch.equal(lookup.sequences, greedy.sequences)


# transformers' own AssistedCandidateGenerator calls the draft's generate with a generation_config and generation
# arguments together, which transformers logs as deprecated: its call, not ours.
@pytest.mark.allows_deprecations
def test_assisted_decoding_with_a_draft_model_equals_greedy(family):
    """``assistant_model=`` (speculative decoding): the draft's proposals are verified in chunks over the cache and the
    cache is cropped back to the accepted tokens, so the result is the target's greedy continuation."""
    model = _model(family)
    draft = build_model(family, {**FAMILIES[family], "num_hidden_layers": 1, "window_pattern": "L"}, seed=7)
    ids = torch.randint(1, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    assisted = _generate(model, ids, mask, use_cache=True, do_sample=False, max_new_tokens=8, assistant_model=draft)
    greedy = _generate(model, ids, mask, use_cache=False, do_sample=False, max_new_tokens=8)
    assert torch.equal(assisted.sequences, greedy.sequences)


# ----------------------------------------------------------------------------------------------------------------
# the Cache API of every family's cache layers
# ----------------------------------------------------------------------------------------------------------------


def _prefill(model, ids, mask):
    with torch.no_grad():
        return output_cache(model(ids, attention_mask=mask, use_cache=True))


def _next_logits(model, cache, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, cache=cache).logits[:, -1]


def _recomputed(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits[:, -1]


def test_cache_lengths(family):
    model = _model(family)
    ids, mask = left_padded(128, [6, 4])
    cache = _prefill(model, ids, mask)
    assert cache.get_seq_length() == 6
    for idx in range(model.config.num_hidden_layers):
        assert cache.get_seq_length(idx) == 6
        kv_length, kv_offset = cache.get_mask_sizes(1, idx)  # the keys a 1-token step would see
        assert kv_length >= 2 and kv_offset >= 0


def test_reorder_cache_for_beam_search(family):
    model = _model(family)
    ids, mask = left_padded(128, [6, 4, 5], seed=4)
    nxt = torch.randint(1, 128, (3, 1), generator=torch.Generator().manual_seed(5))
    order = torch.tensor([2, 0, 0])
    cache = _prefill(model, ids, mask)
    cache.reorder_cache(order)
    full_ids, full_mask = (
        torch.cat([ids[order], nxt], 1),
        torch.cat([mask[order], torch.ones(3, 1, dtype=mask.dtype)], 1),
    )
    got = _next_logits(model, cache, nxt, full_mask)
    assert (got - _recomputed(model, full_ids, full_mask)).abs().max().item() < TOL


def test_batch_repeat_interleave_and_select_indices(family):
    model = _model(family)
    ids, mask = left_padded(128, [5, 3], seed=6)
    cache = _prefill(model, ids, mask)
    cache.batch_repeat_interleave(2)  # [a, a, b, b]
    cache.batch_select_indices(torch.tensor([1, 2]))  # [a, b]
    nxt = torch.randint(1, 128, (2, 1), generator=torch.Generator().manual_seed(7))
    full_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    got = _next_logits(model, cache, nxt, full_mask)
    assert (got - _recomputed(model, torch.cat([ids, nxt], 1), full_mask)).abs().max().item() < TOL


def test_crop_for_assisted_decoding(family):
    model = _model(family)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    cache = model.make_cache()
    cache.activate_past_recording()  # as generate does for assisted decoding: sliding layers keep what crop restores
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    cache.crop(-3)  # drop the last 3 tokens (sliding layers past their window only take a negative count)
    assert cache.get_seq_length() == 6
    with torch.no_grad():
        got = model(ids[:, 6:], attention_mask=mask, cache=cache).logits
        want = model(ids, attention_mask=mask, use_cache=False).logits[:, 6:]
    assert (got - want).abs().max().item() < TOL


# ----------------------------------------------------------------------------------------------------------------
# classes, flags and transformers' attention switch
# ----------------------------------------------------------------------------------------------------------------


def test_causal_lm_has_generation_mixin_among_its_direct_bases(family):
    cls = type(_model(family))
    assert GenerationMixin in cls.__bases__
    assert cls.can_generate()


@pytest.mark.parametrize(
    "implementation, backend", [("eager", "naive"), ("sdpa", "sdpa"), ("flex_attention", "flex"), (None, "auto")]
)
def test_attn_implementation_selects_our_backend(family, implementation, backend, tmp_path):
    config = make_config(family, **FAMILIES[family], attention_backend="auto")
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    assert model.config.attention_backend == backend
    assert all(layer.self_attn.backend == backend for layer in model.model.layers)
    assert config.attention_backend == "auto"  # the caller's config is left alone
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation)
    assert reloaded.config.attention_backend == backend


def test_attn_implementation_eager_and_sdpa_compute_the_same(family):
    torch.manual_seed(0)
    config = make_config(family, **FAMILIES[family], attention_backend="auto")
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    ids, mask = left_padded(128, [6, 4])
    with torch.no_grad():
        a = eager(ids, attention_mask=mask).logits
        b = sdpa(ids, attention_mask=mask).logits
    assert (a - b).abs().max().item() < 1e-4
    assert {layer.self_attn.last_backend for layer in eager.model.layers} == {"naive"}


def test_set_attn_implementation_switches_every_layer(family):
    model = _model(family, attention_backend="auto")
    model.set_attn_implementation("eager")
    assert model.config.attention_backend == "naive"
    assert {layer.self_attn.backend for layer in model.model.layers} == {"naive"}


def test_unsupported_attn_implementation_is_refused_by_name(family):
    config = make_config(family, **FAMILIES[family])
    with pytest.raises(ValueError, match="attn_implementation"):
        AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2")


def test_supports_flags_say_what_is_true(family):
    cls = type(_model(family))
    assert cls._supports_sdpa and cls._supports_flex_attn  # served by our sdpa / flex backends (tests above)
    assert not cls._supports_flash_attn  # flash-attn kernels cannot add a key-norm or a scalar distance term
    assert not cls._supports_attention_backend  # our layers do not dispatch through ALL_ATTENTION_FUNCTIONS
    assert cls._can_compile_fullgraph  # static cache: a decode step compiles fullgraph (test_model_static_cache.py)
    assert cls.supports_gradient_checkpointing


# ----------------------------------------------------------------------------------------------------------------
# malformed inputs
# ----------------------------------------------------------------------------------------------------------------


def test_malformed_inputs_are_named(family):
    model = _model(family)
    with pytest.raises(ValueError, match="`input_ids` must have shape \\[B, N\\]"):
        model(torch.randint(1, 128, (5,)))
    with pytest.raises(TypeError, match="`input_ids` must hold integer token ids"):
        model(torch.rand(2, 5))
    with pytest.raises(ValueError, match="`inputs_embeds` must have shape \\[B, N, D\\]"):
        model(inputs_embeds=torch.rand(2, 5))
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model()
    with pytest.raises(TypeError, match="`cache` \\(`past_key_values`\\) must be a transformers Cache"):
        model(torch.randint(1, 128, (1, 3)), cache=[(torch.zeros(1), torch.zeros(1))])


def test_import_prints_nothing_without_the_vision_extras():
    """``import hf_rbf`` on a base install (no PIL, no torchvision) writes nothing to stdout or stderr."""
    code = (
        "import sys\n"
        "for name in ('PIL', 'torchvision'):\n"
        "    sys.modules[name] = None  # makes `import PIL` raise ImportError, as on a base install\n"
        "import hf_rbf\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_gradient_checkpointing_training_with_a_cache_given(family):
    """A checkpointed layer replays its forward in the backward, so no cache may be written in training: the model
    drops a given cache itself (transformers' layer wrapper drops it only under the installed version's name)."""
    from conftest import enable_activation_checkpointing

    model = _model(family).train()
    enable_activation_checkpointing(model)
    ids = torch.randint(1, 128, (2, 6))
    out = model(ids, labels=ids, cache=model.make_cache(), use_cache=True)
    out.loss.backward()
    assert output_cache(out) is None
    assert all(p.grad is not None for p in model.model.layers[0].mlp.parameters())
