"""The register rows as a stream of their own beside the text (``hf_rbf.modeling_decoder.register_path``): the "stream"
path (``register_layer_step`` per layer, eager) and the "compiled" path (the same step as one ``torch.compile`` graph;
here with the ``aot_eager`` backend, which runs the same captured forward and backward graphs as inductor without
generating code) give the flat-rows path's logits and gradients, in training, with padding, under gradient
checkpointing, with LoRA adapters and the scalar-sort regularizers, and in cached generation; the compiled step is one
graph for every layer of a kind; "auto" picks the graphed or compiled stream on CUDA only."""

from __future__ import annotations

import collections
import logging
import os

import pytest
import torch

from conftest import build_model, enable_activation_checkpointing
from hf_rbf import modeling_decoder

# (id, family, overrides): every attention kind with registers, one and several, with and without a sink / softmax
CASES = [
    ("rbf-susie-r1", "rbf", dict(num_register_tokens=1)),
    ("rbf-none-nonorm-r2", "rbf", dict(position_embedding_type="none", rbf_normalize=False, num_register_tokens=2)),
    (
        "rbf-mixed-window-r2",
        "rbf",
        dict(num_hidden_layers=3, attention_layers=["rbf", "dot"], window_pattern="SL", sliding_window=3,
             num_register_tokens=2),
    ),
    ("gka-vlt-dot-r2", "gka", dict(num_hidden_layers=3, attention_layers=["gka", "vlt", "dot"], num_register_tokens=2)),
    ("scalar-r1", "scalar_sort", dict(num_register_tokens=1)),
    ("scalar-per-token-r3", "scalar_sort", dict(num_register_tokens=3, tau_mode="per_token")),
    ("hybrid-r1", "hybrid_sort", dict(num_register_tokens=1)),
    ("hybrid-dot-r2", "hybrid_sort", dict(num_register_tokens=2, attention_layers=["hybrid", "dot"])),
]


@pytest.fixture
def paths(monkeypatch):
    """Sets ``register_path`` (restored after the test); the compiled path on the ``aot_eager`` backend."""
    monkeypatch.setattr(modeling_decoder, "register_compile_backend", "aot_eager")

    def use(path: str) -> None:
        monkeypatch.setattr(modeling_decoder, "register_path", path)

    return use


def _step(model, ids, mask=None, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same(ref, got, rtol=1e-9):
    logits, loss, grads = got
    torch.testing.assert_close(logits, ref[0], rtol=rtol, atol=rtol * ref[0].abs().max().item())
    torch.testing.assert_close(loss, ref[1], rtol=rtol, atol=0)
    assert grads.keys() == ref[2].keys()
    for name, g in ref[2].items():
        err = (grads[name] - g).norm() / g.norm().clamp(min=1e-30)
        assert err < rtol, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_and_compiled_paths_equal_the_rows_path(case, paths):
    _, family, overrides = case
    model = build_model(family, overrides).double().train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the prefix keys are prepended to the key mask in the stream path too
    results = {}
    for path in ("rows", "stream", "compiled"):
        paths(path)
        results[path] = _step(model, ids, mask)
        # the path taken is visible on the backbone (the compiled one with its torch.compile mode)
        assert model.model.last_register_path == (path if path != "compiled" else "compiled (default)")
    for path in ("stream", "compiled"):
        _assert_same(results["rows"], results[path])
    # the registers' own parameters get their gradient through the stream (the prefix keys and the next layers)
    assert any("register" in n for n in results["compiled"][2])


def test_compiled_step_is_one_graph_per_layer_kind(paths):
    """Every layer of a kind shares the compiled step (dynamo treats the layer's parameters as inputs): a 4-layer model
    of one kind compiles one graph; a second model of the same settings with "dot" layers among its "hybrid" ones
    reuses that graph and adds one for its dot layers; a second step compiles nothing."""
    import torch._dynamo as dynamo

    paths("compiled")
    dynamo.reset()
    stats = dynamo.utils.counters["stats"]
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    two_kinds = dict(num_hidden_layers=4, attention_layers=["hybrid", "dot"])
    for overrides, new_graphs in ((dict(num_hidden_layers=4), 1), (two_kinds, 1)):
        model = build_model("hybrid_sort", dict(num_register_tokens=1, **overrides)).train()
        before = stats["unique_graphs"]
        _step(model, ids)
        assert stats["unique_graphs"] - before == new_graphs
        before = stats["unique_graphs"]
        _step(model, ids)
        assert stats["unique_graphs"] == before


@pytest.mark.parametrize("reentrant", [False, True])
def test_stream_under_gradient_checkpointing(reentrant, paths):
    model = build_model("scalar_sort", dict(num_register_tokens=2, num_hidden_layers=3)).double().train()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    paths("rows")
    ref = _step(model, ids)
    paths("compiled")
    enable_activation_checkpointing(model, use_reentrant=reentrant)
    _assert_same(ref, _step(model, ids))


@pytest.mark.parametrize("family", ["rbf", "hybrid_sort"])
def test_stream_with_lora_adapters(family, paths):
    """A LoRA adapter on the input projections (wrapped linears, called one by one) is traced into the compiled step;
    its gradients equal the rows path's."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj"] if family == "rbf" else ["qs_proj", "v_proj"]
    model = build_model(family, dict(num_register_tokens=1)).double()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(model, lora).train()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    paths("rows")
    ref = _step(model, ids)
    assert any("lora_" in n for n in ref[2])
    paths("compiled")
    _assert_same(ref, _step(model, ids))


def test_stream_keeps_the_scalar_regularizers(paths):
    """The regularizers read the layers' register inputs from a forward pre-hook: the same terms on both paths."""
    overrides = dict(num_register_tokens=1, align_loss_weight=0.5, spread_loss_weight=0.1, tau_loss_weight=0.2)
    model = build_model("scalar_sort", overrides).double().train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    paths("rows")
    ref = _step(model, ids)
    paths("compiled")
    _assert_same(ref, _step(model, ids))


@pytest.mark.contract
@pytest.mark.parametrize("family", ["rbf", "scalar_sort", "hybrid_sort"])
def test_cached_generate_on_the_stream_equals_the_rows_path(family, paths):
    model = build_model(family, dict(num_register_tokens=2)).double()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = {}
    for path in ("rows", "compiled"):
        paths(path)
        with torch.no_grad():
            out[path] = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                return_dict_in_generate=True, output_logits=True,
            )
    assert torch.equal(out["rows"].sequences, out["compiled"].sequences)
    for a, b in zip(out["rows"].logits, out["compiled"].logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_register_path_choice_is_visible_and_checked(monkeypatch, caplog):
    monkeypatch.setattr(modeling_decoder, "_REGISTER_PATH_LOGGED", set())
    monkeypatch.setattr(modeling_decoder, "register_path", "auto")
    with caplog.at_level(logging.INFO, logger="hf_rbf"):
        assert modeling_decoder.register_path_for(torch.device("cpu")) == "rows"
        assert modeling_decoder.register_path_for(torch.device("cpu"), memoised=True) == "rows"
        assert modeling_decoder.register_path_for(torch.device("cuda")) == "compiled"
        # a cached forward without gradients computes the steps once: eagerly
        assert modeling_decoder.register_path_for(torch.device("cuda"), memoised=True) == "stream"
        modeling_decoder.register_path_for(torch.device("cpu"))
        # with the model's layer: CUDA graphs of the step where a capture stays valid, the compiled step where not
        layer = build_model("rbf", dict(num_register_tokens=1)).model.layers[0]
        assert modeling_decoder.register_path_for(torch.device("cuda"), layer=layer) == "graphed"
        assert modeling_decoder.register_path_for(torch.device("cuda"), memoised=True, layer=layer) == "stream"
        assert modeling_decoder.register_path_for(torch.device("cpu"), layer=layer) == "rows"
        layer.gradient_checkpointing = True
        assert modeling_decoder.register_path_for(torch.device("cuda"), layer=layer) == "compiled"
    logged = [r.getMessage() for r in caplog.records if "register rows" in r.getMessage()]
    assert len(logged) == 4 and "'rows' path" in logged[0] and "'compiled' path" in logged[1]
    assert "'stream' path" in logged[2] and "'graphed' path" in logged[3]
    monkeypatch.setattr(modeling_decoder, "register_path", "fast")
    with pytest.raises(ValueError, match=r"register_path must be one of .*'auto'.*'compiled'.*got 'fast'"):
        modeling_decoder.register_path_for(torch.device("cpu"))


def test_inside_an_outer_compile_the_step_is_inlined(paths):
    """Under ``torch.compile`` of the whole model the step is not compiled again: "auto" takes the rows path and
    "compiled" the eager stream, both traced into the outer graph."""
    paths("compiled")
    seen = []

    def probe(x):
        seen.append((modeling_decoder.register_path_for(x.device), modeling_decoder.register_step_function(x.device)))
        return x + 1

    torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(2))
    assert seen == [("stream", modeling_decoder.register_layer_step)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["rbf", "scalar_sort", "hybrid_sort"])
def test_inductor_compiled_stream_on_cuda_equals_the_rows_path(family, monkeypatch):
    """The compiled stream on CUDA (what "auto" takes where the graphed step does not fit: FSDP, checkpointing,
    several processes) against the rows path, float32 with the fused kernels, forward and backward (bounds norm-wise:
    inductor fuses and reorders the float32 arithmetic)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    overrides = dict(num_register_tokens=1, attention_backend="auto", hidden_size=64, num_attention_heads=2)
    model = build_model(family, overrides).cuda().train()
    ids = torch.randint(0, 128, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for path in ("rows", "compiled"):
        monkeypatch.setattr(modeling_decoder, "register_path", path)
        results[path] = _step(model, ids)
    assert model.model.last_register_path == "compiled (default)"
    _assert_same(results["rows"], results["compiled"], rtol=1e-4)
    # inductor's kernels one by one, then the step as CUDA graphs: warm-up, recording and replays, each the same step,
    # with evaluation forwards (no gradients, no cache: a graph of their own) between training steps
    for mode in ("default", "reduce-overhead"):
        monkeypatch.setattr(modeling_decoder, "register_compile_mode", mode)
        for _ in range(4):
            _assert_same(results["rows"], _step(model, ids), rtol=1e-4)
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(logits, results["rows"][0], rtol=1e-4, atol=1e-4 * logits.abs().max().item())
    # gradient accumulation: a second backward adds to the gradients the first left (a graph's output buffers are
    # reused by its next replay: a gradient that kept one would be overwritten)
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            ref = 2 * results["rows"][2][name]
            assert (p.grad - ref).norm() <= 1e-4 * ref.norm() + 1e-12, name


@pytest.mark.contract
def test_generate_computes_the_register_steps_once(monkeypatch):
    """A cached forward without gradients on the stream (what "auto" takes on CUDA) keeps each layer's register step
    on the cache: one generation computes it once per layer, not once per token; a change of the register tokens
    (their version) computes it again; the tokens equal the rows path's."""
    calls = []
    step = modeling_decoder.register_layer_step

    def counted(layer, states):
        calls.append(layer.self_attn.layer_idx)
        return step(layer, states)

    monkeypatch.setattr(modeling_decoder, "register_layer_step", counted)
    monkeypatch.setattr(modeling_decoder, "register_path", "stream")
    model = build_model("scalar_sort", dict(num_register_tokens=1, num_hidden_layers=3))
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, **kwargs)
    assert calls == [0, 1, 2]
    monkeypatch.setattr(modeling_decoder, "register_path", "rows")
    with torch.no_grad():
        assert torch.equal(model.generate(input_ids=ids, **kwargs), out)
    assert calls == [0, 1, 2]
    # a cache reused after the register tokens changed recomputes the steps
    monkeypatch.setattr(modeling_decoder, "register_path", "stream")
    cache = model.make_cache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids[:, :1], cache=cache)
        assert calls == [0, 1, 2] * 2
        model.model.register_tokens.add_(0.5)
        model(input_ids=ids[:, :1], cache=cache)
    assert calls == [0, 1, 2] * 3


def test_the_compiled_path_pins_the_triton_cache_dir(paths, monkeypatch):
    """Before its first compilation the compiled path fixes ``TRITON_CACHE_DIR`` at Triton's own directory, so that
    inductor does not move it mid-process (it sets it on a first compilation, not on a cache load), which sent our
    kernels to a directory the next process did not read; a directory the user set stays."""
    triton = pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    default = triton.knobs.cache.dir
    monkeypatch.setattr(modeling_decoder, "_COMPILED_REGISTER_STEPS", {})
    paths("compiled")
    fn = modeling_decoder.register_step_function(torch.device("cpu"))
    assert fn is not modeling_decoder.register_layer_step
    assert os.environ["TRITON_CACHE_DIR"] == default
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.setattr(modeling_decoder, "_COMPILED_REGISTER_STEPS", {})
    modeling_decoder.register_step_function(torch.device("cpu"))
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"


def test_compile_mode_uses_cuda_graphs_only_where_parameters_keep_their_addresses(monkeypatch):
    """The default is inductor's default mode; "auto": CUDA graphs ("reduce-overhead") for a plain layer on CUDA,
    inductor's default mode on a CPU, under activation checkpointing, FSDP2 and accelerate's hooks (parameters that
    move between steps); a bad value named."""
    model = build_model("rbf", dict(num_register_tokens=1))
    assert modeling_decoder.register_compile_mode_for(model.model.layers[0], torch.device("cuda")) == "default"
    monkeypatch.setattr(modeling_decoder, "register_compile_mode", "auto")
    model = build_model("rbf", dict(num_register_tokens=1))
    layer = model.model.layers[0]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert modeling_decoder.register_compile_mode_for(layer, cuda) == "reduce-overhead"
    assert modeling_decoder.register_compile_mode_for(layer, cpu) == "default"
    enable_activation_checkpointing(model)
    assert modeling_decoder.register_compile_mode_for(layer, cuda) == "default"
    plain = build_model("rbf", dict(num_register_tokens=1)).model.layers[0]

    class FSDPModule:  # the name torch.distributed.fsdp's fully_shard mixes into a sharded module's class
        pass

    plain.__class__ = type("FSDPDecoderLayer", (FSDPModule, type(plain)), {})
    assert modeling_decoder.register_compile_mode_for(plain, cuda) == "default"
    hooked = build_model("rbf", dict(num_register_tokens=1)).model.layers[0]
    hooked._hf_hook = object()
    assert modeling_decoder.register_compile_mode_for(hooked, cuda) == "default"
    monkeypatch.setattr(modeling_decoder, "register_compile_mode", "max")
    with pytest.raises(ValueError, match=r"register_compile_mode must be one of .*'reduce-overhead'.*got 'max'"):
        modeling_decoder.register_compile_mode_for(layer, cuda)


def test_generate_on_cuda_runs_the_memoised_steps_eagerly(monkeypatch):
    """With "auto" on CUDA (simulated here: the device the path is chosen for), a generation's cached forwards take
    the eager stream and never ask for the compiled step (its steps run once per generation: a compilation would not
    pay, and the CUDA-graph mode's outputs would be overwritten by the next generation's replays, which is how rbf's
    dynamic generate failed on an H100 while the layers still chose the compiled step themselves)."""
    choose = modeling_decoder.register_path_for
    monkeypatch.setattr(
        modeling_decoder,
        "register_path_for",
        lambda device, memoised=False, layer=None: choose(torch.device("cuda"), memoised, layer),
    )
    monkeypatch.setattr(modeling_decoder, "register_path", "auto")
    compiled_asked = []
    get_function = modeling_decoder.register_step_function

    def recording(device, layer=None, path=None):
        fn = get_function(device, layer, path)
        if fn is not modeling_decoder.register_layer_step:
            compiled_asked.append(layer.self_attn.layer_idx)
        return fn

    monkeypatch.setattr(modeling_decoder, "register_step_function", recording)
    monkeypatch.setattr(modeling_decoder, "register_compile_backend", "aot_eager")
    model = build_model("rbf", dict(num_register_tokens=1))
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert compiled_asked == []
    assert model.model.last_register_path == "stream"
    model.train()
    # training on "CUDA": the compiled step (where CUDA graphs of it do not fit; those need a real GPU)
    monkeypatch.setattr(modeling_decoder, "_graphs_fit", lambda layer: False)
    model(input_ids=ids, labels=ids).loss.backward()
    assert compiled_asked == [0, 1]
    assert model.model.last_register_path == "compiled (default)"


def test_a_bad_register_path_from_the_environment_is_named(tmp_path):
    """``HF_RBF_REGISTER_PATH`` sets the path for a launched process; a bad value fails the first forward with
    registers, naming the setting, the variable and the allowed values."""
    import subprocess
    import sys

    code = (
        "import torch, hf_rbf; from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = AutoConfig.for_model('rbf', vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_register_tokens=1)\n"
        "AutoModelForCausalLM.from_config(cfg)(input_ids=torch.zeros(1, 3, dtype=torch.long))\n"
    )
    env = dict(os.environ, HF_RBF_REGISTER_PATH="fastest")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "register_path must be one of ('auto', 'rows', 'stream', 'compiled', 'graphed'); got 'fastest'" in proc.stderr
    assert "HF_RBF_REGISTER_PATH" in proc.stderr


def test_auto_takes_the_graphed_step_under_ddp_and_fsdp2_not_under_checkpointing(monkeypatch):
    """"auto" replays the register step as CUDA graphs in a process of its own and under DDP (several processes, the
    weights in place) and under FSDP2 (``fully_shard`` makes the layer an ``FSDPModule``; the graphs copy the
    gathered weights in), and keeps the compiled step under activation checkpointing or accelerate's hooks."""
    import torch.distributed as dist

    layer = build_model("rbf", dict(num_register_tokens=1)).model.layers[0]
    assert modeling_decoder._graphs_fit(layer)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert modeling_decoder._graphs_fit(layer)
    assert modeling_decoder.register_path_for(torch.device("cuda"), layer=layer) == "graphed"

    class FSDPModule:  # the name torch.distributed.fsdp's fully_shard mixes into a sharded module's class
        pass

    layer.__class__ = type("FSDPDecoderLayer", (FSDPModule, type(layer)), {})
    assert modeling_decoder._graphs_fit(layer)
    assert modeling_decoder.register_path_for(torch.device("cuda"), layer=layer) == "graphed"
    layer.gradient_checkpointing = True
    assert not modeling_decoder._graphs_fit(layer)
    assert modeling_decoder.register_path_for(torch.device("cuda"), layer=layer) == "compiled"
    layer.gradient_checkpointing = False
    layer._hf_hook = object()
    assert not modeling_decoder._graphs_fit(layer)


# The decode-step cost of the registers on the path "auto" takes on CUDA in a cached forward without gradients (the
# stream, steps memoised per cache): their prefix comes from the memo, so a register model's decode step should run
# about the ops of the same model without registers.  Measured per layer (2 layers, batch 1; after the change that
# sends the stream's text rows through the sorted families' text path): rbf +0.5, gka +2.5 (the prefix ``cat`` in front
# of the cached features), scalar_sort -4.5 (-4.5 per token tau), hybrid_sort -5.5 (the memoised prefix also carries
# the sink).  Before it the sorted families' flat-rows projections cost +6.5 / +9.5 / +11.5 (views), and on the CPU's
# "rows" path (the register rows recomputed beside the text every step) +68 / +103.
MAX_EXTRA_DECODE_OPS_PER_LAYER = 4
_FUSED_SORTED = dict(attention_backend="triton", decode_window=4, decode_backend="triton")
DECODE_OP_CASES = [
    ("rbf", "rbf", dict(attention_backend="triton")),
    ("gka", "gka", dict(attention_backend="triton")),
    ("scalar_sort", "scalar_sort", _FUSED_SORTED),
    ("scalar_sort-per-token", "scalar_sort", dict(_FUSED_SORTED, tau_mode="per_token")),
    ("hybrid_sort", "hybrid_sort", _FUSED_SORTED),
]


def _decode_step_ops(family: str, overrides: dict, layers: int = 2):
    """Aten ops (outside triton's launches, whose interpreter work is not host work on a GPU) of one decode step at
    batch 1, after a prefill and a warm-up step, and the model's register path."""
    import count_host_ops  # benchmarks/ (see kernel_env): the counter of benchmarks/count_model_host_ops.py

    count_host_ops._patch_triton_run()
    model = build_model(family, dict(overrides, num_hidden_layers=layers))
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :10], cache=cache, use_cache=True)
        model(input_ids=ids[:, 10:11], cache=cache, use_cache=True)
        with count_host_ops.counting() as counter:
            model(input_ids=ids[:, 11:12], cache=cache, use_cache=True)
    return collections.Counter(counter.ops), model.model.last_register_path


@pytest.mark.parametrize("case", DECODE_OP_CASES, ids=[c[0] for c in DECODE_OP_CASES])
def test_register_decode_step_costs_a_handful_of_ops(case, paths):
    """A decode step on the stream (the register steps memoised on the cache) costs at most a handful of aten ops per
    layer more than the same model without registers (the fused kernels, here in triton's interpreter, as on CUDA):
    nothing that depends on the weights alone (the registers' projections, norms, attention, the prefix keys, the sink)
    is rebuilt per token.  ``benchmarks/count_model_host_ops.py --decode`` counts the same per family."""
    import kernel_env  # puts benchmarks/ on the path

    if not kernel_env.kernels_common.DEFINED_INTERPRETED:
        pytest.skip("the fused kernels of a CPU model run in triton's interpreter (TRITON_INTERPRET=1, no CUDA)")
    _, family, overrides = case
    paths("stream")
    layers = 2
    plain, path = _decode_step_ops(family, dict(overrides, num_register_tokens=0), layers)
    assert path is None
    with_registers, path = _decode_step_ops(family, dict(overrides, num_register_tokens=1), layers)
    assert path == "stream"
    extra = (sum(with_registers.values()) - sum(plain.values())) / layers
    assert extra <= MAX_EXTRA_DECODE_OPS_PER_LAYER, (
        f"{family}: {extra:+.1f} aten ops per layer and decode step for one register (more: "
        f"{dict(with_registers - plain)}; fewer: {dict(plain - with_registers)})"
    )
