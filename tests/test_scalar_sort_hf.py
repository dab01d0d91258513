"""HF contract of both sort families: Auto classes, save_pretrained / from_pretrained, remote code where hf_rbf cannot
be imported (generate through the sorted cache there too), PEFT LoRA on the documented targets, every parameter in
the graph, half precision, the configured backend against "naive"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HIDE_HF_RBF, build_model
from sorted_cache_helpers import PAD, SORT_CASES, left_padded

import hf_rbf

# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


@pytest.fixture(params=SORT_CASES, ids=[c[0] for c in SORT_CASES])
def sort_case(request):
    return request.param


def test_save_load_identical_logits_and_auto_map(sort_case, tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM

    _, family, overrides = sort_case
    model = build_model(family, dict(overrides, decode_window=4, align_loss_weight=0.1))
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and loaded.config.decode_window == 4
    # Loaded weights can sit at unaligned offsets of the memory-mapped file, which changes the float32 rounding of
    # the CPU matmuls (cloning them gives bitwise-equal logits): compare to float32 rounding, not bitwise.
    with torch.no_grad():
        assert (loaded(ids, attention_mask=mask).logits - ref).abs().max().item() < 1e-5
        base = AutoModel.from_pretrained(tmp_path).eval()
        diff = (
            base(ids, attention_mask=mask).last_hidden_state - model.model(ids, attention_mask=mask).last_hidden_state
        )
        assert diff.abs().max().item() < 1e-5
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    stem = "scalar_sort" if family == "scalar_sort" else "hybrid_sort"
    name = "ScalarSort" if family == "scalar_sort" else "HybridSort"
    assert cfg["auto_map"] == {
        "AutoConfig": f"configuration_{stem}.{name}Config",
        "AutoModel": f"modeling_{stem}.{name}Model",
        "AutoModelForCausalLM": f"modeling_{stem}.{name}ForCausalLM",
    }
    files = set(os.listdir(tmp_path))
    assert {f"modeling_{stem}.py", "cache_sorted_scalar.py", "sorted_decode.py", "scalar_regularizers.py"} <= files
    assert "trainer.py" not in files


_REMOTE_SCRIPT = (
    HIDE_HF_RBF
    + """
import torch
from transformers import AutoModelForCausalLM


ckpt, data = sys.argv[1], sys.argv[2]
ref = torch.load(data)
model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(ref["ids"], attention_mask=ref["mask"]).logits
    out = model.generate(ref["ids"], attention_mask=ref["mask"], max_new_tokens=5, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
print(json.dumps({
    "logits_equal": bool((logits - ref["logits"]).abs().max() < 1e-5),
    "tokens_equal": bool(torch.equal(out.sequences, ref["tokens"])),
    "cache": type(out.get("cache") or out.get("past_key_values")).__name__,  # the name differs across 5.24
    "model_module": type(model).__module__,
    "hf_rbf_loaded": any(m == "hf_rbf" or m.startswith("hf_rbf.") for m in sys.modules),
}))
"""
)


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_remote_code_without_hf_rbf(family, tmp_path, hf_home):
    case = next(c for c in SORT_CASES if c[1] == family and "window" in c[0])
    model = build_model(family, dict(case[2], decode_window=3, max_cache_tokens=8, cache_eviction="density"))
    ids, mask = left_padded(model.config.vocab_size, [7, 5])
    with torch.no_grad():
        ref = {
            "ids": ids,
            "mask": mask,
            "logits": model(ids, attention_mask=mask).logits,
            "tokens": model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0),
        }
    model.save_pretrained(tmp_path / "ckpt")
    torch.save(ref, tmp_path / "ref.pt")
    (tmp_path / "load.py").write_text(_REMOTE_SCRIPT)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["HF_HOME"] = hf_home
    env["HF_MODULES_CACHE"] = os.path.join(str(tmp_path), "modules")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["logits_equal"] and result["tokens_equal"], result
    assert result["cache"] == "SortedScalarCache" and result["model_module"].startswith("transformers_modules.")
    assert not result["hf_rbf_loaded"]


@pytest.mark.parametrize("family", ["scalar_sort", "hybrid_sort"])
def test_lora_on_the_documented_targets(family):
    peft = pytest.importorskip("peft")
    overrides = dict(tau_mode="per_token", num_register_tokens=1, num_hidden_layers=2)
    if family == "scalar_sort":
        overrides["attention_layers"] = ["scalar", "dot"]
    model = build_model(family, overrides)
    targets = list(type(model).lora_target_modules)
    peft_model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    )
    wrapped = {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    expected = {"qs_proj", "ks_proj", "v_proj", "o_proj", "tau_proj", "q_proj", "k_proj", "gate_proj", "up_proj",
                "down_proj"}  # fmt: skip
    assert wrapped == expected
    ids, mask = left_padded(model.config.vocab_size, [10, 7])
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(5):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3, losses
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids, attention_mask=mask).logits
        merged = peft_model.merge_and_unload()
        # merging changes the float32 rounding, which sharp scalar kernels (tau ~ 0.05) amplify a little
        assert (merged(input_ids=ids, attention_mask=mask).logits - adapted).abs().max().item() < 5e-5


def test_every_parameter_gets_a_gradient(sort_case):
    _, family, overrides = sort_case
    for randomize in (False, True):
        model = build_model(family, dict(overrides, align_loss_weight=0.1, spread_loss_weight=0.1,
                                         tau_loss_weight=0.1), randomize=randomize)  # fmt: skip
        model.train()
        ids, mask = left_padded(model.config.vocab_size, [9, 6])
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, missing
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        if randomize:
            zero = [n for n, p in model.named_parameters() if p.grad.abs().max() == 0]
            assert not zero, zero


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_forward_backward_and_windowed_generate(dtype):
    for _, family, overrides in SORT_CASES[1::2]:
        model = build_model(family, dict(overrides, decode_window=3))
        ids, mask = left_padded(model.config.vocab_size, [9, 6])
        with torch.no_grad():
            ref = model(ids, attention_mask=mask).logits
        model.to(dtype)
        with torch.no_grad():
            half = model(ids, attention_mask=mask).logits
        assert half.dtype == dtype and torch.isfinite(half).all()
        rel = ((half.float() - ref)[mask.bool()].norm() / ref[mask.bool()].norm()).item()
        assert rel < (5e-2 if dtype == torch.bfloat16 else 1e-2), (family, rel)
        model.train()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss) and all(
            torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
        )
        model.eval()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        assert out.shape == (2, 13)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "triton"])
def test_configured_backend_matches_naive(sort_case, backend):
    """Whatever backend the config names either serves every call (training forward, prefill, exact decode) and
    matches "naive", or fails with the function's ValueError naming the backend."""
    _, family, overrides = sort_case
    naive = build_model(family, overrides)
    other = build_model(family, dict(overrides, attention_backend=backend))
    ids, mask = left_padded(naive.config.vocab_size, [7, 5])
    with torch.no_grad():
        ref = naive(ids, attention_mask=mask).logits
        try:
            got = other(ids, attention_mask=mask).logits
        except ValueError as err:
            assert backend != "auto", err
            assert f"backend={backend!r}" in str(err)
            return
    assert (got - ref)[mask.bool()].abs().max().item() < 1e-4
    for layer in other.model.layers:
        assert layer.self_attn.last_backend in hf_rbf.BACKENDS
