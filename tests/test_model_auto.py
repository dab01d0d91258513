"""Auto classes, save_pretrained / from_pretrained, and remote code in a fresh process where hf_rbf cannot be
imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import FAMILY_CASES, HIDE_HF_RBF, build_model, make_config

import hf_rbf  # noqa: F401

# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract


def _inputs(vocab: int):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def test_from_config_and_save_load_give_identical_logits(family_case, tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM

    _, family, overrides = family_case
    model = build_model(family, overrides)
    ids, mask = _inputs(model.config.vocab_size)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, ref)
        # the base model loads from the same checkpoint and gives the same final hidden states
        base = AutoModel.from_pretrained(tmp_path).eval()
        assert torch.equal(
            base(ids, attention_mask=mask).last_hidden_state, model.model(ids, attention_mask=mask).last_hidden_state
        )
    # tying survives the round trip
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == model.config.tie_word_embeddings


def test_non_persistent_buffers_are_recomputed_after_load(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model("gka", dict(rope_theta=500.0))
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert "inv_freq" not in f.read()
    from safetensors.torch import load_file

    assert not any("inv_freq" in k for k in load_file(tmp_path / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    freqs = loaded.model.position_frequencies
    expected = 1.0 / (500.0 ** (torch.arange(0, freqs.head_dim, 2, dtype=torch.float32) / freqs.head_dim))
    assert torch.equal(freqs.inv_freq, expected)


def test_registered_for_auto_classes_and_auto_map(tmp_path):
    model = build_model("rbf", {})
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_rbf.RbfConfig",
        "AutoModel": "modeling_rbf.RbfModel",
        "AutoModelForCausalLM": "modeling_rbf.RbfForCausalLM",
    }
    files = set(os.listdir(tmp_path))
    # the modeling file and the flat chain of its relative imports, nothing from other families
    assert {"modeling_rbf.py", "configuration_rbf.py", "modeling_decoder.py", "configuration_decoder.py"} <= files
    assert {"attention_rbf.py", "attention_dot.py", "attention_utils.py"} <= files
    assert "modeling_gka.py" not in files
    assert "attn_implementation" not in cfg


_REMOTE_SCRIPT = HIDE_HF_RBF + textwrap.dedent(
    """
    try:
        import hf_rbf  # noqa: F401
        raise SystemExit("hf_rbf was importable")
    except ImportError:
        pass

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    ckpt, data = sys.argv[1], sys.argv[2]
    ref = torch.load(data)
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(ckpt, trust_remote_code=True).eval()
    config = AutoConfig.from_pretrained(ckpt, trust_remote_code=True)
    with torch.no_grad():
        logits = model(ref["ids"], attention_mask=ref["mask"]).logits
        hidden = base(ref["ids"], attention_mask=ref["mask"]).last_hidden_state
        tokens = model.generate(
            ref["ids"], attention_mask=ref["mask"], max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    print(json.dumps({
        "logits_equal": bool(torch.equal(logits, ref["logits"])),
        "hidden_equal": bool(torch.equal(hidden, ref["hidden"])),
        "tokens_equal": bool(torch.equal(tokens, ref["tokens"])),
        "model_module": type(model).__module__,
        "config_class": type(config).__name__,
        "hf_rbf_loaded": any(m == "hf_rbf" or m.startswith("hf_rbf.") for m in sys.modules),
    }))
    """
)


@pytest.mark.parametrize(
    "case", [c for c in FAMILY_CASES if c[0] in ("rbf-mixed-window-r2", "gka-sssl-dot-r2")], ids=lambda c: c[0]
)
def test_remote_code_without_hf_rbf(case, tmp_path, hf_home):
    _, family, overrides = case
    model = build_model(family, overrides)
    ids, mask = _inputs(model.config.vocab_size)
    with torch.no_grad():
        ref = {
            "ids": ids,
            "mask": mask,
            "logits": model(ids, attention_mask=mask).logits,
            "hidden": model.model(ids, attention_mask=mask).last_hidden_state,
            "tokens": model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0),
        }
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    torch.save(ref, tmp_path / "ref.pt")
    script = tmp_path / "load_remote.py"
    script.write_text(_REMOTE_SCRIPT)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the worktree is not on the path, and the import hook hides hf_rbf anyway
    env["HF_HOME"] = hf_home
    env["HF_MODULES_CACHE"] = os.path.join(str(tmp_path), "modules")
    proc = subprocess.run(
        [sys.executable, str(script), str(ckpt), str(tmp_path / "ref.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["logits_equal"] and result["hidden_equal"] and result["tokens_equal"], result
    assert result["model_module"].startswith("transformers_modules."), result
    assert result["config_class"] == type(model.config).__name__
    assert not result["hf_rbf_loaded"]


def test_config_only_remote_code(tmp_path):
    cfg = make_config("gka", num_register_tokens=1)
    from hf_rbf import GkaForCausalLM

    GkaForCausalLM(cfg).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert set(json.load(f)["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
