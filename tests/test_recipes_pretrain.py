"""recipes/pretrain.py end to end on recipes/configs/cpu_test.yaml: tokenizer, packed data, Trainer, metrics files,
validation loss, bits per byte, a story, the saved model (loaded with trust_remote_code in a process without hf_rbf),
exact resume after an interruption, and 2-process DDP (gloo) against 1 process at the same global batch."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch


# transformers contract: CI also runs this module against the oldest supported versions (.ci/run)
pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_TEST = os.path.join(REPO, "recipes", "configs", "cpu_test.yaml")
NO_EXTRAS = [
    "evaluation.remote_code_check=false",
    "evaluation.generation.enabled=false",
    "evaluation.bpb.enabled=false",
]


def _run(output_dir, overrides=(), **kwargs):
    from recipes.pretrain import run
    from recipes.pretrain_config import load_config

    cfg = load_config(CPU_TEST, list(overrides), output_dir=str(output_dir))
    return run(cfg, log=lambda *a, **k: None, **kwargs)


def _losses(run_dir) -> list[tuple]:
    with open(os.path.join(run_dir, "metrics.json")) as f:
        rows = json.load(f)["log_history"]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def _png_is_not_blank(path: str) -> bool:
    from PIL import Image

    img = Image.open(path).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    return img.size[0] > 100 and img.size[1] > 100 and (colors is None or len(colors) > 20)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One complete cpu_test run (8 steps) through the command line as the README runs it, from another directory
    (the recipe's relative data paths then resolve from the repository); shared by the tests below."""
    out = tmp_path_factory.mktemp("pretrain") / "full"
    # same thread count as this process, so the in-process resumed run below computes with the same reductions
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "recipes", "pretrain.py"),
            "--config",
            CPU_TEST,
            "--output-dir",
            str(out),
            "--set",
            "training.disable_tqdm=false",
        ],
        env=env,
        cwd=str(out.parent),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "summary.json") as f:
        summary = json.load(f)
    return out, summary, proc


def test_pretrain_end_to_end(full_run):
    out, s, proc = full_run
    # the console: Trainer's progress bar, the story, the summary
    assert "8/8" in proc.stderr
    assert "[generate] Once upon a time" in proc.stdout and "run            cpu_test" in proc.stdout
    assert "bits per byte  " in proc.stdout and "remote code    ok" in proc.stdout
    # training, evaluation, bits per byte, story
    assert s["steps"] == 8 and s["train_tokens"] == 8 * 8 * 32
    assert s["num_parameters"] == 30336
    assert math.isfinite(s["eval_loss"]) and s["eval_loss"] < math.log(300)
    bpb = s["bpb"]
    assert 0 < bpb["bits_per_byte"] < 8 and bpb["lossless_roundtrip"] and bpb["num_documents"] == 3
    assert isinstance(s["story"], str) and s["story"].startswith("Once upon a time") and len(s["story"]) > 20
    assert s["tokens_per_second"] and s["tokens_per_second"] > 0
    assert s["attention_backends"] == ["rbf:naive"]  # the recipe asks for the reference path: visible in the summary
    # the saved model is the trained one and loads with remote code where hf_rbf cannot be imported
    assert s["reload_max_abs_diff"] < 1e-5
    assert s["reload_max_param_diff"] == 0.0 and s["reload_autocast"] is None
    check = s["remote_code_check"]
    assert check["ok"], check
    assert not check["hf_rbf_loaded"] and check["model_module"].startswith("transformers_modules.")
    # files
    for name in ("metrics.json", "metrics.csv", "loss_curve.png", "summary.json", "recipe.yaml", "tokenizer"):
        assert os.path.exists(out / name), name
    assert _png_is_not_blank(str(out / "loss_curve.png"))
    with open(out / "metrics.csv") as f:
        header = f.readline().strip().split(",")
        rows = f.read().strip().splitlines()
    assert header[:4] == ["step", "epoch", "tokens_seen", "loss"] and len(rows) == 8 + 2  # 8 losses, 2 evaluations
    final = out / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_rbf.py"} <= set(os.listdir(final))
    with open(final / "config.json") as f:
        config = json.load(f)
    assert config["use_cache"] is True and config["auto_map"]["AutoModelForCausalLM"] == "modeling_rbf.RbfForCausalLM"
    assert config["eos_token_id"] == 0 and config["pad_token_id"] == 1 and config["max_position_embeddings"] == 32


def test_saved_tokenizer_is_a_byte_level_bpe(full_run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(full_run[0] / "final")
    assert len(tok) == 300 and tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    text = "Once upon a time, Lily saw a big dog. \u00e9\u00e8 \U0001f600"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte level: any text round-trips, no unknown token


def test_resume_after_interruption_gives_the_same_curve(full_run, tmp_path):
    out = full_run[0]
    resumed = tmp_path / "resumed"
    first = _run(resumed, NO_EXTRAS, stop_at_step=3)
    assert first["stopped_at_step"] == 3
    assert os.path.isdir(resumed / "checkpoint-3") and not os.path.isdir(resumed / "final")
    second = _run(resumed, NO_EXTRAS, resume="latest")
    assert second["resumed_from"].endswith("checkpoint-3") and second["steps"] == 8
    straight, interrupted = _losses(out), _losses(resumed)
    assert [r[0] for r in interrupted] == list(range(1, 9))
    # same data order, RNG, optimizer and scheduler state: identical losses and gradient norms on the CPU
    for a, b in zip(straight, interrupted):
        assert a[1] == pytest.approx(b[1], rel=1e-6, abs=1e-6), (a, b)
        assert a[2] == pytest.approx(b[2], rel=1e-5, abs=1e-6), (a, b)
    assert second["eval_loss"] == pytest.approx(full_run[1]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("register_path", ["auto", "compiled"])
def test_ddp_two_processes_match_one_process(full_run, tmp_path, register_path):
    """``accelerate launch --multi_gpu --num_processes 2`` on the CPU (gloo): each process gets 4 of the 8 blocks of
    every step; the logged losses equal the single-process run's (same global batch) up to reduction order.  Also
    with the register rows on the compiled register stream (``HF_RBF_REGISTER_PATH=compiled``, what a GPU takes;
    here with the ``aot_eager`` backend) under DDP."""
    out = tmp_path / "ddp"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", HF_RBF_REGISTER_PATH=register_path)
    env["HF_RBF_REGISTER_COMPILE_BACKEND"] = "aot_eager"
    with socket.socket() as sock:  # a free port, so parallel test runs on one machine do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        os.path.join(REPO, "recipes", "pretrain.py"),
        "--config",
        CPU_TEST,
        "--output-dir",
        str(out),
        "--set",
        *NO_EXTRAS,
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "summary.json") as f:
        s = json.load(f)
    assert s["world_size"] == 2 and s["global_batch_size"] == 8 and s["steps"] == 8
    assert s["register_path"] == ("rows" if register_path == "auto" else "compiled (default)")
    for a, b in zip(_losses(full_run[0]), _losses(out)):
        assert a[0] == b[0] and abs(a[1] - b[1]) < 1e-4, (a, b)
    assert s["eval_loss"] == pytest.approx(full_run[1]["eval_loss"], abs=1e-4)


def test_global_batch_size_sets_the_per_device_batch(tmp_path):
    from recipes.pretrain import make_training_args, per_device_batch_size
    from recipes.pretrain_config import load_config

    assert per_device_batch_size(64, 2, 1) == 32 and per_device_batch_size(64, 1, 4) == 16
    with pytest.raises(ValueError, match="global_batch_size=6"):
        per_device_batch_size(6, 2, 2)
    cfg = load_config(
        CPU_TEST, ["global_batch_size=16", "training.gradient_accumulation_steps=2"], output_dir=str(tmp_path)
    )
    args = make_training_args(cfg)
    assert args.per_device_train_batch_size == 8 and args.gradient_accumulation_steps == 2


def test_expected_parameter_count_is_enforced(tmp_path):
    with pytest.raises(ValueError, match="expected_num_parameters=123"):
        _run(tmp_path / "x", ["model.expected_num_parameters=123", *NO_EXTRAS])


def test_train_only_and_prepare_only_are_refused_together():
    from recipes.pretrain import parse_args

    assert parse_args(["--config", "c.yaml", "--train-only"]).train_only is True
    with pytest.raises(SystemExit):
        parse_args(["--config", "c.yaml", "--train-only", "--prepare-only"])


def test_a_recipe_sets_the_register_path_for_its_run_alone(tmp_path):
    """``model.register_path`` runs the recipe on that register path (the summary says which ran) and restores the
    library's setting afterwards; a wrong value is refused by name."""
    import hf_rbf.modeling_decoder as modeling_decoder

    before = modeling_decoder.register_path
    steps = ["training.max_steps=2", *NO_EXTRAS]
    # (the same run also asks for FSDP2 prefetching, which a run without FSDP2 reports as 0 layers set)
    s = _run(tmp_path / "stream", ["model.register_path=stream", "fsdp_prefetch_layers=1", *steps], train_only=True)
    assert s["register_path"] == "stream" and modeling_decoder.register_path == before
    assert s["fsdp_prefetch_units"] == 0
    with pytest.raises(ValueError, match="model.register_path must be null or one of"):
        _run(tmp_path / "bad", ["model.register_path=fast", *steps], train_only=True)
    assert modeling_decoder.register_path == before
