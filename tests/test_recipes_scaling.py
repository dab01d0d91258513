"""Scale-out on the CPU (gloo): a checkpoint saved by 2 processes resumes on 1 and the reverse, with the losses of an
uninterrupted run; the scaling benchmark's dry run with 1 and 2 processes; the FSDP2 accelerate configs.

Why resuming across process counts is exact here: the recipe fixes the *global* batch (``global_batch_size``), so 2
processes get 4 blocks each where 1 process gets 8; accelerate cuts the one seeded sampler's order into per-device
batches and gives process i the i-th of every N (``BatchSamplerShard``), so every optimizer step sees the same 8
blocks whatever the process count, and the resumed run skips ``step x global_batch`` blocks either way.  The checkpoint
holds the full model, optimizer and scheduler state (DDP replicates them; rank 0 writes them).  What differs is only
the order of float additions: the mean loss and the gradient are averaged over 2 halves (DDP's all-reduce) instead of
over 8 blocks at once, about 1e-7 relative per step; after 8 AdamW steps the logged losses agree to 1e-4 (measured:
at most 9.5e-7, 2 float32 ulps of a loss near 5.5).  Per-process RNG states (``rng_state_<rank>.pth``) cannot carry
over to another process count; the models here have no dropout, so nothing draws from them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

# transformers contract: Trainer checkpoints and resume (CI also runs this module against the oldest versions)
pytestmark = pytest.mark.contract

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_TEST = os.path.join(REPO, "recipes", "configs", "cpu_test.yaml")
NO_EXTRAS = [
    "evaluation.remote_code_check=false",
    "evaluation.generation.enabled=false",
    "evaluation.bpb.enabled=false",
    "training.eval_strategy='no'",  # quoted: YAML reads a bare no as false
    "cpu_threads=1",
]
LOSS_TOLERANCE = 1e-4  # 1 vs 2 processes: float summation order only (see the module docstring)
GPU_LOSS_TOLERANCE = 1e-3  # the same on GPUs in float32 (cuBLAS / NCCL reduction orders), still far below a restart


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pretrain(output_dir, processes: int, *extra: str) -> None:
    """``recipes/pretrain.py`` on cpu_test.yaml, through ``accelerate launch --multi_gpu`` (gloo on the CPU) for 2
    processes, as a plain script for 1."""
    script = [os.path.join(REPO, "recipes", "pretrain.py"), "--config", CPU_TEST, "--output-dir", str(output_dir)]
    script += [*extra, "--set", *NO_EXTRAS]
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
        cmd += ["--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision", "no"]
        cmd += ["--dynamo_backend", "no", *script]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.json")) as f:
        rows = json.load(f)["log_history"]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """8 uninterrupted steps on 1 process (the reference curve)."""
    out = tmp_path_factory.mktemp("scaling") / "straight"
    _pretrain(out, 1)
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_process_count(straight_run, tmp_path, saved_on, resumed_on):
    import transformers
    from packaging.version import Version

    if resumed_on > 1 and Version(transformers.__version__) < Version("5.18"):
        # transformers 5.17's Trainer loads optimizer.pt with map_location=args.device, which is "cpu:0" in CPU
        # processes, and torch.load rejects an indexed CPU device (5.18 maps it to "cpu"); GPUs (cuda:<rank>) are not
        # affected, and the same failure hits a resume on 2 CPU processes from a 2-process checkpoint
        pytest.skip("transformers < 5.18 cannot resume on several CPU processes (optimizer map_location 'cpu:0')")
    out = tmp_path / f"saved{saved_on}_resumed{resumed_on}"
    _pretrain(out, saved_on, "--stop-at-step", "4")
    assert os.path.isdir(out / "checkpoint-4") and not os.path.isdir(out / "final")
    first = _losses(out)
    _pretrain(out, resumed_on, "--resume")
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["world_size"] == resumed_on and summary["global_batch_size"] == 8 and summary["steps"] == 8
    assert summary["resumed_from"].endswith("checkpoint-4")
    resumed = _losses(out)
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(straight_run[step], abs=LOSS_TOLERANCE), (step, resumed, straight_run)
    # the losses after the resume are not the ones before it: the test would see a restart from scratch
    assert abs(resumed[5] - straight_run[1]) > 10 * LOSS_TOLERANCE


def _pretrain_fsdp2(output_dir, processes: int, *extra: str, config: str = "fsdp2.yaml", env_extra=None) -> None:
    """``recipes/pretrain.py`` on cpu_test.yaml under ``accelerate launch --config_file <config>`` (FSDP2 by default)
    with ``processes`` GPUs, in float32 (``--mixed_precision no``: bf16 sharding would differ between process counts
    by more than the float summation order); ``env_extra``: more environment for every process."""
    script = [os.path.join(REPO, "recipes", "pretrain.py"), "--config", CPU_TEST, "--output-dir", str(output_dir)]
    script += [*extra, "--set", *NO_EXTRAS, "training.bf16=false"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [os.path.join(REPO, "recipes", "accelerate", config), "--num_processes", str(processes)]
    cmd += ["--main_process_port", str(_free_port()), "--mixed_precision", "no", *script]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count())))
    pythonpath = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)  # keep the machine's own
    env = dict(os.environ, PYTHONPATH=pythonpath, CUDA_VISIBLE_DEVICES=",".join(visible.split(",")[:processes]))
    env.update(env_extra or {})
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP on GPUs needs 2 GPUs")
def test_ddp_with_graphed_register_steps_matches_the_rows_path(tmp_path):
    """DDP on 2 GPUs (NCCL) with each layer's register step replayed as CUDA graphs (``HF_RBF_REGISTER_PATH=graphed``:
    gradients leave the graphs through an autograd function, DDP's hooks all-reduce them) gives the losses of the
    same launch on the rows path, step by step (float32)."""
    losses = {}
    for path in ("rows", "graphed"):
        out = tmp_path / path
        _pretrain_fsdp2(out, 2, config="ddp.yaml", env_extra={"HF_RBF_REGISTER_PATH": path})
        with open(out / "summary.json") as f:
            summary = json.load(f)
        assert summary["world_size"] == 2 and summary["register_path"] == path
        losses[path] = _losses(out)
    assert sorted(losses["graphed"]) == list(range(1, 9))
    for step in range(1, 9):
        assert losses["graphed"][step] == pytest.approx(losses["rows"][step], abs=GPU_LOSS_TOLERANCE), step


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 across process counts needs 2 GPUs")
def test_fsdp2_checkpoint_resumes_on_another_gpu_count(tmp_path):
    """FSDP2 (full shard, FULL_STATE_DICT checkpoints): 4 of 8 steps on 2 GPUs resumed on 1, and 4 on 1 resumed on 2,
    each against an uninterrupted 8-step run on 1 GPU.  float32 on the GPU: the difference is float summation order
    (sharded reduce-scatter against one process), as in the gloo test, with a tolerance for the GPU's kernels."""
    straight = tmp_path / "straight"
    _pretrain_fsdp2(straight, 1)
    reference = _losses(straight)
    for saved_on, resumed_on in [(2, 1), (1, 2)]:
        out = tmp_path / f"fsdp2_saved{saved_on}_resumed{resumed_on}"
        _pretrain_fsdp2(out, saved_on, "--stop-at-step", "4")
        assert os.path.isdir(out / "checkpoint-4") and not os.path.isdir(out / "final")
        _pretrain_fsdp2(out, resumed_on, "--resume")
        with open(out / "summary.json") as f:
            summary = json.load(f)
        assert summary["world_size"] == resumed_on and summary["steps"] == 8
        assert summary["resumed_from"].endswith("checkpoint-4")
        resumed = _losses(out)
        assert sorted(resumed) == list(range(1, 9))
        for step in range(1, 9):
            assert resumed[step] == pytest.approx(reference[step], abs=GPU_LOSS_TOLERANCE), (step, resumed, reference)
        assert abs(resumed[5] - reference[1]) > 10 * GPU_LOSS_TOLERANCE


ACCELERATE_DIR = os.path.join(REPO, "recipes", "accelerate")
FAMILIES = ("rbf", "gka", "scalar_sort", "hybrid_sort", "llama")


def _fsdp_plugin(config_name: str, monkeypatch, *launch_args: str):
    """The FSDP plugin that ``accelerate launch --config_file recipes/accelerate/<config_name> ...`` gives the
    processes (built from the environment the launcher exports)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", os.path.join(ACCELERATE_DIR, config_name), *launch_args]
    args = launch_command_parser().parse_args([*argv, os.path.join(REPO, "recipes", "pretrain.py")])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    return args, env, FullyShardedDataParallelPlugin()


def _scale_model(size: str, family: str):
    """The model of recipes/configs/scale_<size>_<family>.yaml on the meta device (no memory)."""
    from recipes.pretrain_config import load_config
    from recipes.pretrain_models import build_config, build_model, resolve_model_config

    cfg = load_config(os.path.join(REPO, "recipes", "configs", f"scale_{size}_{family}.yaml"))
    kwargs, _ = resolve_model_config(cfg["model"], cfg["tokenizer"]["vocab_size"], cfg["data"]["block_size"], {})
    return build_model(build_config(family, kwargs), device="meta")


@pytest.mark.parametrize("config_name", ["fsdp2.yaml", "fsdp2_ac.yaml", "fsdp2_zero2.yaml"])
def test_fsdp2_configs(config_name, monkeypatch):
    from torch.distributed.fsdp import StateDictType

    args, env, plugin = _fsdp_plugin(config_name, monkeypatch)
    assert args.num_processes == 2 and args.num_machines == 1 and env["ACCELERATE_USE_FSDP"] == "true"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # full shard (ZeRO-3); fsdp2_zero2.yaml keeps each layer's gathered parameters from its forward to its backward
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is (config_name != "fsdp2_zero2.yaml")
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT  # checkpoints independent of the process count
    assert plugin.transformer_cls_names_to_wrap == ["DecoderLayer"]
    assert plugin.activation_checkpointing is (config_name == "fsdp2_ac.yaml")
    plugin.set_mixed_precision("bf16")
    policy = plugin.mixed_precision_policy
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.bfloat16
    # the documented command-line override gives fsdp2_ac.yaml's activation checkpointing
    _, _, overridden = _fsdp_plugin(config_name, monkeypatch, "--fsdp_activation_checkpointing", "true")
    assert overridden.activation_checkpointing is True


@pytest.mark.parametrize("size", ["d768", "1b"])
def test_scale_recipes_train_without_a_sync_per_step(size):
    """Trainer's NaN/Inf loss filter reads the loss back after every step (a host-device sync that drains the GPU's
    queue); the scale recipes turn it off, and prefetch one FSDP2 layer ahead."""
    from recipes.pretrain import make_training_args
    from recipes.pretrain_config import load_config

    for family in FAMILIES:
        cfg = load_config(os.path.join(REPO, "recipes", "configs", f"scale_{size}_{family}.yaml"), output_dir="/tmp/x")
        assert make_training_args(cfg).logging_nan_inf_filter is False, family
        assert cfg["fsdp_prefetch_layers"] == 1, family


@pytest.mark.parametrize("size", ["d768", "1b"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_wraps_every_decoder_layer_of_the_scale_recipes(family, size, monkeypatch):
    """One FSDP unit per decoder layer for every family; Llama needs the documented command-line override, and without
    it accelerate stops rather than wrapping nothing."""
    override = ["--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"] if family == "llama" else []
    _, _, plugin = _fsdp_plugin("fsdp2.yaml", monkeypatch, *override)
    model = _scale_model(size, family)
    plugin.set_auto_wrap_policy(model)
    (layer_class,) = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert layer_class.__name__ == ("LlamaDecoderLayer" if family == "llama" else "DecoderLayer")
    layers = [m for m in model.modules() if isinstance(m, layer_class)]
    assert len(layers) == model.config.num_hidden_layers == (12 if size == "d768" else 16)
    if family == "llama":
        _, _, plain = _fsdp_plugin("fsdp2.yaml", monkeypatch)
        with pytest.raises(ValueError, match="DecoderLayer"):
            plain.set_auto_wrap_policy(model)


def test_fsdp2_mixed_precision_keeps_the_norms_fused(tmp_path, monkeypatch):
    """Under accelerate's FSDP2 (fsdp2_zero2.yaml, bf16: ``MixedPrecisionPolicy`` casts each layer's weights and
    inputs to bf16, so the residual stream is bf16) every ``DecoderRMSNorm`` call still goes through one
    ``F.rms_norm``: one fused kernel on CUDA, not the ~8 + 10 elementwise kernels of the float32 chain that FSDP2 had
    added to each norm of each layer (issue 17; benchmarks/probe_fsdp2_ops.py).  One gloo process on the CPU."""
    import types

    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_rbf.modeling_decoder import DecoderRMSNorm

    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    _, _, plugin = _fsdp_plugin("fsdp2_zero2.yaml", monkeypatch)
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    plugin.set_mixed_precision("bf16")  # as AcceleratorState does for mixed_precision: bf16
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gka", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_register_tokens=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16", is_main_process=True,
            device=torch.device("cpu"), torch_device_mesh=None,
        )  # fmt: skip
        model = fsdp2_prepare_model(accelerator, model)
        assert all(isinstance(layer, FSDPModule) for layer in model.model.layers)
        norms, fused, inside = [], [], []  # the dtypes of the norms' inputs, of F.rms_norm's inputs inside a norm
        rms_norm = F.rms_norm

        def counted(x, *args, **kwargs):
            if inside:  # only inside a DecoderRMSNorm (GKA's attention has F.rms_norm calls of its own)
                fused.append(x.dtype)
            return rms_norm(x, *args, **kwargs)

        monkeypatch.setattr(F, "rms_norm", counted)

        def enter(module, args):
            norms.append(args[0].dtype)
            inside.append(module)

        def leave(module, args, out):
            inside.pop()

        for module in model.modules():
            if isinstance(module, DecoderRMSNorm):
                module.register_forward_pre_hook(enter)
                module.register_forward_hook(leave)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert norms == [torch.bfloat16] * (2 * 2 + 1)  # the residual stream is bf16 under FSDP2
        assert fused == norms
    finally:
        dist.destroy_process_group()


def _llama_test_config(tmp_path) -> str:
    """cpu_test.yaml as a Llama (SDPA) recipe: a second family for the benchmark's multi-recipe launches."""
    import yaml

    with open(CPU_TEST) as f:
        cfg = yaml.safe_load(f)
    cfg["run_name"] = "cpu_test_llama"
    cfg["model"]["family"] = "llama"
    cfg["model"]["expected_num_parameters"] = None
    for key in ("num_register_tokens", "attention_backend"):  # hf_rbf keys that LlamaConfig does not have
        del cfg["model"]["config"][key]
    for source in cfg["data"]["train"] + cfg["data"]["validation"]:  # the files are relative to the repository
        source["files"] = [os.path.join(REPO, f) for f in source["files"]]
    path = tmp_path / "cpu_test_llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_scaling_benchmark_wraps_each_recipe_by_its_own_layer_class(monkeypatch):
    """One FSDP2 launch trains Llama and the hf_rbf families in turn: the plugin (process-wide in accelerate) wraps each
    model by its own ``_no_split_modules`` once the benchmark resets what the previous model wrote into it."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    _fsdp_plugin("fsdp2.yaml", monkeypatch)  # the environment accelerate launch gives the processes
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP")  # what the worker does under FSDP

    plugin = FullyShardedDataParallelPlugin()
    reset = _bench_module().reset_fsdp_wrap_policy
    for family in ("llama", "rbf", "llama", "gka"):
        model = _scale_model("d768", family)
        plugin.set_auto_wrap_policy(model)
        (layer_class,) = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
        assert layer_class.__name__ == ("LlamaDecoderLayer" if family == "llama" else "DecoderLayer")
        reset(plugin)
    # without the reset the second model is refused (what accelerate's fsdp2_prepare_model does with it)
    plugin.set_auto_wrap_policy(_scale_model("d768", "llama"))
    rbf = _scale_model("d768", "rbf")
    plugin.set_auto_wrap_policy(rbf)
    with pytest.raises(ValueError, match="LlamaDecoderLayer"):
        fsdp2_prepare_auto_wrap_policy(plugin, rbf)
    reset(plugin)
    plugin.set_auto_wrap_policy(rbf)
    assert fsdp2_prepare_auto_wrap_policy(plugin, rbf)(rbf.model.layers[0])


@pytest.mark.slow
def test_scaling_benchmark_dry_run_on_the_cpu(tmp_path):
    """benchmarks/bench_scaling.py end to end with 1 and 2 gloo processes on two recipes (rbf and Llama): the single
    process is a plain one, the 2 processes go through ``accelerate launch``; each launch trains both recipes in turn
    with the asked blocks per process, and the table holds their measured speed, memory and efficiency."""
    out = tmp_path / "scaling"
    llama = _llama_test_config(tmp_path)
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_scaling.py"), "--cpu", "--strategies", "ddp"]
    cmd += ["--configs", "recipes/configs/cpu_test.yaml", llama, "--processes", "1", "2", "--steps", "8"]
    cmd += ["--blocks-per-gpu", "4", "--profile-steps", "2", "--output", str(out)]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "scaling.json") as f:
        rows = json.load(f)["rows"]
    got = [(r["family"], r["strategy"], r["processes"], r["world_size"], r["global_batch_size"]) for r in rows]
    assert sorted(got) == [
        ("llama", "ddp", 2, 2, 8),
        ("llama", "single", 1, 1, 4),
        ("rbf", "ddp", 2, 2, 8),
        ("rbf", "single", 1, 1, 4),
    ]
    for r in rows:
        assert r["steps"] == 8 and r["measured_steps"] == 3 and "error" not in r and r["launch_returncode"] == 0
        # each measured step's duration (tests/test_recipes_throughput.py checks the values)
        assert 0 < r["step_ms_median"] <= r["step_ms_max"]
        assert r["tokens_per_second_per_gpu"] == pytest.approx(r["tokens_per_second"] / r["processes"])
        assert (
            r["tokens_per_second_per_gpu"] > 0 and 0.05 < r["peak_memory_gib"] < 16 and r["peak_memory_kind"] == "rss"
        )
        run_dir = out / "runs" / os.path.basename(r["run_dir"])
        with open(run_dir / "summary.json") as f:
            summary = json.load(f)
        # train_only: no evaluation, no saved model
        assert summary["train_only"] is True and "eval_loss" not in summary and not (run_dir / "final").exists()
        assert (run_dir / f"peak_memory_rank{r['processes'] - 1}.json").exists()
        # --profile-steps 2: rank 0 profiled warm-up steps 3 and 4 (on the CPU: no kernels, only host ops)
        profile = r["profile"]
        assert profile["steps"] == 2 and profile["wall_ms_per_step"] > 0 and profile["cpu_top"]
        assert profile["compute_kernel_ms_per_step"] == 0 and not (run_dir / "profile_rank1.json").exists()
    launches = sorted(p.name for p in (out / "runs").glob("launch-*.log"))
    assert launches == ["launch-ddp-2-gpucpu.log", "launch-single-1-gpucpu.log"]
    for name in launches:  # one launch per process count serves both recipes, on the data prepared once
        text = (out / "runs" / name).read_text()
        assert text.count("--config ") == 2 and f"tokenizer.path={out / 'prepared'}" in text
        assert ("accelerate.commands.launch" in text) == name.startswith("launch-ddp")
    for family in ("rbf", "llama"):
        one, two = [r for r in rows if r["family"] == family]
        assert one["scaling_efficiency"] == 1.0
        assert two["scaling_efficiency"] == pytest.approx(
            two["tokens_per_second_per_gpu"] / one["tokens_per_second_per_gpu"]
        )
    table = (out / "scaling.md").read_text()
    two = next(r for r in rows if r["family"] == "rbf" and r["processes"] == 2)
    per_gpu = two["tokens_per_step"] // 2
    assert (
        f"| cpu_test | rbf | 30,336 | ddp | 2 | {per_gpu:,} | {two['tokens_per_second_per_gpu']:,.0f} | "
        f"{two['step_ms_median']:.1f} / {two['step_ms_max']:.1f} |" in table
    )
    assert (
        "## Per-step profile" in table and f"| cpu_test | ddp | 2 | {two['profile']['wall_ms_per_step']:.1f} |" in table
    )


def _bench_module():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import bench_scaling
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))
    return bench_scaling


def test_scaling_benchmark_arguments(tmp_path):
    bench_scaling = _bench_module()
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--output", str(tmp_path), "--cpu"])  # FSDP2 on the CPU: refused, not skipped
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--output", str(tmp_path), "--cpu", "--strategies", "ddp", "--steps", "5"])
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--output", str(tmp_path), "--cpu", "--strategies", "ddp", "--concurrent"])
    with pytest.raises(SystemExit):  # only the untimed warm-up steps are profiled
        bench_scaling.parse_args(["--output", str(tmp_path), "--cpu", "--strategies", "ddp", "--profile-steps", "5"])
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--output", str(tmp_path), "--cpu", "--strategies", "ddp", "fsdp2_zero2"])
    assert bench_scaling.DEFAULT_STRATEGIES == ["ddp", "fsdp2"]  # fsdp2_zero2: opt-in
    args = bench_scaling.parse_args(["--output", str(tmp_path), "--cpu", "--strategies", "ddp"])
    assert args.processes == [1, 2] and len(args.configs) == 10
    args.strategies = ["ddp", "fsdp2"]
    launch = {"strategy": "fsdp2", "processes": 4, "configs": ["recipes/configs/scale_d768_llama.yaml"]}
    joined = " ".join(bench_scaling.launch_command(launch, args, {}))
    # d768 recipes default to 64 blocks per GPU (GPT-2 small's micro-batch; shorter steps measure FSDP2's host work),
    # the 1B ones to 16, any other recipe to 8
    assert (
        "--config_file recipes/accelerate/fsdp2.yaml --num_processes 4" in joined and "global_batch_size=256" in joined
    )
    one_b = dict(launch, configs=["recipes/configs/scale_1b_rbf.yaml"])
    assert "global_batch_size=64" in " ".join(bench_scaling.launch_command(one_b, args, {}))
    args.blocks_per_gpu = 4
    assert "global_batch_size=16" in " ".join(bench_scaling.launch_command(launch, args, {}))
    args.blocks_per_gpu = None
    launch["strategy"] = "fsdp2_zero2"
    zero2 = " ".join(bench_scaling.launch_command(launch, args, {}))
    assert "--config_file recipes/accelerate/fsdp2_zero2.yaml" in zero2
    single = {"strategy": "single", "processes": 1, "configs": ["a.yaml", "b.yaml"]}
    cmd = bench_scaling.launch_command(single, args, {"a.yaml": ["data.cache_dir=X"]})
    assert "accelerate.commands.launch" not in cmd and cmd.count("--config") == 2
    assert cmd[cmd.index("a.yaml") + 1 :].index("data.cache_dir=X") < cmd[cmd.index("a.yaml") + 1 :].index("--config")
    # the worker reads back each recipe with its own overrides
    wargs, runs = bench_scaling.worker_runs(cmd[cmd.index("worker") + 1 :])
    assert wargs.strategy == "single" and wargs.processes == 1 and [c for c, _ in runs] == ["a.yaml", "b.yaml"]
    assert "data.cache_dir=X" in runs[0][1] and "data.cache_dir=X" not in runs[1][1]
    assert "global_batch_size=8" in runs[1][1] and "training.max_steps=40" in runs[1][1]
    rows = [
        {"config": "a", "strategy": "single", "processes": 1, "tokens_per_second_per_gpu": 100.0},
        {"config": "a", "strategy": "ddp", "processes": 2, "tokens_per_second_per_gpu": 90.0},
        {"config": "a", "strategy": "fsdp2", "processes": 2, "tokens_per_second_per_gpu": 80.0},
        {"config": "b", "strategy": "ddp", "processes": 2, "tokens_per_second_per_gpu": 80.0},  # no 1-GPU run
    ]
    bench_scaling.add_efficiency(rows)
    assert [r["scaling_efficiency"] for r in rows] == [1.0, 0.9, 0.8, None]
    assert [r["strategy_efficiency"] for r in rows] == [1.0, None, None, None]  # no strategy ran on 1 process
    # --strategy-baselines: FSDP2 on one process is faster than the plain run (bf16 parameters); the second
    # efficiency is over it, the first still over the plain run
    rows += [
        {"config": "a", "strategy": "fsdp2", "processes": 1, "tokens_per_second_per_gpu": 125.0},
        {"config": "a", "strategy": "fsdp2", "processes": 4, "tokens_per_second_per_gpu": 120.0},
    ]
    bench_scaling.add_efficiency(rows)
    assert [r["scaling_efficiency"] for r in rows] == [1.0, 0.9, 0.8, None, 1.25, 1.2]
    assert [r["strategy_efficiency"] for r in rows] == [1.0, None, 0.64, None, 1.0, 0.96]
    common = {"family": "x", "num_parameters": 10, "tokens_per_step": 8, "world_size": 1, "peak_memory_gib": 1.0,
              "fsdp_units": 3, "device": "cpu", "versions": {"torch": "t", "transformers": "x"},
              "peak_memory_kind": "rss", "step_ms_median": 50.0, "step_ms_max": 61.3}
    table = bench_scaling.markdown_table([dict(common, **r) for r in rows if r["config"] == "a"], "T")
    assert "| efficiency | vs the strategy on 1 process |" in table
    assert "| a | x | 10 | fsdp2 | 4 | 8 | 120 | 50.0 / 61.3 | 1.00 | 3 | 1.200 | 0.960 |" in table
    assert "| a | x | 10 | single | 1 | 8 | 100 | 50.0 / 61.3 | 1.00 |  | 1.000 |  |" in table
    # a row of a run without per-step times (results of earlier versions)
    old = {k: v for k, v in common.items() if not k.startswith("step_ms")}
    assert "| 100 | n/a / n/a | 1.00 |" in bench_scaling.markdown_table([dict(old, **rows[0])], "T")
    assert "vs the strategy" not in bench_scaling.markdown_table([dict(common, **rows[0])], "T")


def test_scaling_benchmark_waves():
    """Sequential: one launch per wave on the first GPUs.  Concurrent: the single-GPU runs dealt over every GPU, the
    2-process launches side by side on 4 GPUs (by strategy, else by recipe), never two launches on one GPU."""
    plan = _bench_module().plan_waves
    configs = [f"c{i}" for i in range(5)]
    waves = plan(configs, [1, 2, 4], ["ddp", "fsdp2"], 4, False)
    assert [[(x["strategy"], x["processes"], x["gpus"]) for x in w] for w in waves] == [
        [("single", 1, [0])],
        [("ddp", 2, [0, 1])],
        [("fsdp2", 2, [0, 1])],
        [("ddp", 4, [0, 1, 2, 3])],
        [("fsdp2", 4, [0, 1, 2, 3])],
    ]
    assert all(x["configs"] == configs for w in waves for x in w)
    # --strategy-baselines: every strategy on one process too, after the plain run
    waves = plan(configs, [1, 2], ["ddp", "fsdp2"], 4, False, True)
    assert [[(x["strategy"], x["processes"], x["gpus"]) for x in w] for w in waves] == [
        [("single", 1, [0])],
        [("ddp", 1, [0])],
        [("fsdp2", 1, [0])],
        [("ddp", 2, [0, 1])],
        [("fsdp2", 2, [0, 1])],
    ]
    waves = plan(configs, [1, 2, 4], ["ddp", "fsdp2"], 4, True)
    assert [[(x["strategy"], x["processes"], x["gpus"]) for x in w] for w in waves] == [
        [("single", 1, [0]), ("single", 1, [1]), ("single", 1, [2]), ("single", 1, [3])],
        [("ddp", 2, [0, 1]), ("fsdp2", 2, [2, 3])],
        [("ddp", 4, [0, 1, 2, 3])],
        [("fsdp2", 4, [0, 1, 2, 3])],
    ]
    assert [x["configs"] for x in waves[0]] == [["c0", "c4"], ["c1"], ["c2"], ["c3"]]
    for wave in waves:
        used = [g for x in wave for g in x["gpus"]]
        assert len(used) == len(set(used))
    # one strategy: its recipes dealt over the free blocks of N GPUs (each recipe once per strategy and N)
    waves = plan(configs, [1, 2, 4], ["fsdp2"], 4, True, True)
    assert [[(x["strategy"], x["processes"], x["gpus"], x["configs"]) for x in w] for w in waves[2:]] == [
        [("fsdp2", 2, [0, 1], ["c0", "c2", "c4"]), ("fsdp2", 2, [2, 3], ["c1", "c3"])],
        [("fsdp2", 4, [0, 1, 2, 3], configs)],
    ]
    # 8 GPUs, two strategies: two blocks of 2 GPUs each, side by side
    waves = plan(configs, [2], ["ddp", "fsdp2"], 8, True)
    assert [[(x["strategy"], x["gpus"], x["configs"]) for x in w] for w in waves] == [
        [
            ("ddp", [0, 1], ["c0", "c2", "c4"]),
            ("ddp", [2, 3], ["c1", "c3"]),
            ("fsdp2", [4, 5], ["c0", "c2", "c4"]),
            ("fsdp2", [6, 7], ["c1", "c3"]),
        ]
    ]
    # a single recipe is not split
    assert [[x["gpus"] for x in w] for w in plan(["c0"], [2], ["fsdp2"], 4, True)] == [[[0, 1]]]
    # 2 GPUs: the 2-process launches one after the other; more processes than GPUs is an error
    waves = plan(configs, [1, 2], ["ddp", "fsdp2"], 2, True)
    assert [[(x["strategy"], x["gpus"]) for x in w] for w in waves] == [
        [("single", [0]), ("single", [1])],
        [("ddp", [0, 1])],
        [("fsdp2", [0, 1])],
    ]
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        plan(configs, [4], ["ddp"], 2, True)


def test_step_profile_summary_splits_nccl_from_compute():
    """``--profile-steps``' summary on CUDA-like events: NCCL kernels counted apart from compute kernels, per step."""
    from types import SimpleNamespace

    bench_scaling = _bench_module()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key, device_type, device_us=0.0, cpu_us=0.0, count=1, cpu_total_us=None):
        return SimpleNamespace(
            key=key, device_type=device_type, self_device_time_total=device_us, self_cpu_time_total=cpu_us, count=count,
            cpu_time_total=cpu_us if cpu_total_us is None else cpu_total_us,
        )

    events = [
        event("nvjet_sm90_gemm", cuda, device_us=6000.0, count=10),
        event("ncclDevKernel_AllGather_RING_LL", cuda, device_us=2000.0, count=4),
        event("_distance_fwd_kernel", cuda, device_us=1000.0, count=2),
        event("cudaLaunchKernel", cpu, cpu_us=800.0, count=16),
        # a range whose time is its children's (FSDP2's per-layer hook): little self time, much inclusive time
        event("FSDP::pre_forward", cpu, cpu_us=100.0, count=24, cpu_total_us=3000.0),
        # a user annotation's range on the GPU timeline (it spans host gaps): not a kernel
        SimpleNamespace(
            key="DistributedDataParallel.forward", device_type=cuda, self_device_time_total=9000.0,
            self_cpu_time_total=0.0, count=1, is_user_annotation=True, cpu_time_total=0.0,
        ),
    ]
    prof = SimpleNamespace(key_averages=lambda: events)
    s = bench_scaling.summarise_step_profile(prof, steps=2, wall_ms=10.0)
    assert s["wall_ms_per_step"] == 5.0 and s["kernel_launches_per_step"] == 8.0
    assert s["compute_kernel_ms_per_step"] == pytest.approx(3.5) and s["nccl_kernel_ms_per_step"] == pytest.approx(1.0)
    assert [k["name"] for k in s["gpu_top"]] == [
        "nvjet_sm90_gemm",
        "ncclDevKernel_AllGather_RING_LL",
        "_distance_fwd_kernel",
    ]
    assert s["cpu_top"][0] == {"name": "cudaLaunchKernel", "calls_per_step": 8.0, "ms_per_step": 0.4}
    # inclusive ranking of the host's ranges: the hook first, no GPU-timeline event
    assert s["cpu_ranges"][0] == {"name": "FSDP::pre_forward", "calls_per_step": 12.0, "ms_per_step": 1.5}
    assert all(k["name"] != "DistributedDataParallel.forward" for k in s["cpu_ranges"])


def test_idle_gaps_name_the_op_that_ended_each_gap():
    """``--profile-steps``' idle-gap summary on CUDA-like events: NCCL kernels do not count as compute, overlapping
    kernels on two streams leave no gap, and each gap is host late or waiting by when its launching op began."""
    from types import SimpleNamespace

    bench_scaling = _bench_module()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def op(id_, name, start, end, parent=None):
        return SimpleNamespace(
            id=id_, name=name, device_type=cpu, is_async=False, time_range=SimpleNamespace(start=start, end=end),
            cpu_parent=parent,
        )

    launchers = {}

    def kernel(name, start, end, launcher):
        launchers[(start, end)] = launcher.id
        return SimpleNamespace(
            id=-1, name=name, device_type=cuda, is_async=False, time_range=SimpleNamespace(start=start, end=end),
            cpu_parent=None,
        )

    step = op(1, "ProfilerStep#5", 0, 2000)
    mm = op(2, "aten::mm", 10, 20, step)
    pre = op(3, "FSDP::pre_forward", 300, 900, step)  # the host is busy here: the GPU idles until 1000
    mm2 = op(4, "aten::mm", 950, 960, pre)
    wait = op(5, "aten::add", 1100, 1110, step)  # launched early; its kernel starts late (waits on the device)
    runtime = op(4, "cudaLaunchKernel", 951, 955, mm2)  # the runtime's own ids may equal an op's
    events = [step, mm, pre, mm2, runtime, wait,
              kernel("gemm", 100, 300, mm), kernel("other_stream", 250, 400, mm),
              kernel("ncclDevKernel_AllGather", 400, 1000, pre),
              kernel("gemm", 1000, 1100, mm2), kernel("add", 1500, 1510, wait)]
    annotation = kernel("DistributedDataParallel.forward", 100, 1510, step)  # spans every gap: must not hide them
    annotation.is_user_annotation = True
    events.append(annotation)
    g = bench_scaling.summarise_idle_gaps(events, steps=2, launchers=launchers, min_gap_us=50.0)
    assert g["gaps_per_step"] == 1.0  # 400-1000 (the NCCL kernel is not compute) and 1100-1500; 300-250 overlaps
    assert g["host_late_ms_per_step"] == pytest.approx(0.3) and g["waiting_ms_per_step"] == pytest.approx(0.2)
    assert g["groups"][0] == {
        "kind": "host late", "next_op": "ProfilerStep#5 > FSDP::pre_forward > aten::mm", "ms_per_step": 0.3,
        "gaps_per_step": 0.5,
    }
    assert g["largest"][0]["host_ops_during"][0] == "FSDP::pre_forward (0.50 ms)"
    assert g["largest"][1]["kind"] == "waiting" and g["largest"][1]["next_kernel"] == "add"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_failed_recipe_stops_a_multi_process_worker(world_size, tmp_path, monkeypatch):
    """A recipe that fails writes its failure file; alone, the worker goes on to the next recipe, in a launch of
    several processes it stops (the other ranks would otherwise wait in a collective of the recipe it left)."""
    import recipes.pretrain

    bench_scaling = _bench_module()
    ran = []

    def run(cfg, **kwargs):
        ran.append(cfg["model"]["family"])
        raise RuntimeError("profiler failed on this rank")

    monkeypatch.setattr(recipes.pretrain, "run", run)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    configs = ["recipes/configs/scale_d768_rbf.yaml", "recipes/configs/scale_d768_llama.yaml"]
    argv = ["--root", str(tmp_path), "--strategy", "ddp", "--processes", str(world_size)]
    for config in configs:
        argv += ["--config", config]
    assert bench_scaling.worker(argv) == 1
    assert ran == (["rbf", "llama"] if world_size == 1 else ["rbf"])
    failure = tmp_path / bench_scaling.run_name(configs[0], "ddp", world_size) / "failure_rank0.json"
    assert "profiler failed" in failure.read_text()


def test_a_failed_idle_gap_summary_is_reported_in_the_table():
    """The idle-gap summary never fails a run; when it fails, the table says so instead of leaving it out."""
    bench_scaling = _bench_module()
    profile = dict(
        wall_ms_per_step=1.0, compute_kernel_ms_per_step=0.5, nccl_kernel_ms_per_step=0.0, kernel_launches_per_step=3,
        gpu_top=[], cpu_top=[], idle_gaps_error="AttributeError('linked_correlation_id')",
    )  # fmt: skip
    row = {"config": "recipes/configs/a.yaml", "strategy": "single", "processes": 1, "profile": profile}
    text = "\n".join(bench_scaling.profile_section([row]))
    assert "idle-gap summary failed: AttributeError('linked_correlation_id')" in text


def test_an_interrupted_wave_keeps_the_recipes_that_finished(tmp_path, monkeypatch):
    """A device call cut by `timeout --signal=INT` in the middle of a launch: the recipes of that launch that wrote
    their summaries before the cut are still in the tables (a cut 2-GPU wave lost three finished 1B runs once)."""
    bench_scaling = _bench_module()
    configs = ["recipes/configs/a.yaml", "recipes/configs/b.yaml", "recipes/configs/c.yaml"]
    launch = {"strategy": "ddp", "processes": 2, "gpus": [0, 1], "configs": configs}
    root = tmp_path / "runs"

    class CutLaunch:  # the launch finished a.yaml and b.yaml, then the call was cut during c.yaml
        killed = False

        def __init__(self, *args, **kwargs):
            for config in configs[:2]:
                run = root / bench_scaling.run_name(config, "ddp", 2)
                run.mkdir(parents=True)
                (run / "summary.json").write_text("{}")

        def wait(self, timeout=None):
            if not self.killed:
                raise KeyboardInterrupt

        def kill(self):
            self.killed = True

    monkeypatch.setattr(bench_scaling.subprocess, "Popen", CutLaunch)
    monkeypatch.setattr(bench_scaling, "launch_command", lambda launch, args, prepared: ["true"])
    monkeypatch.setattr(bench_scaling, "_env", lambda args, gpus: {})
    monkeypatch.setattr(bench_scaling, "read_row", lambda config, launch, root, rc, wall: {"config": config, "rc": rc})
    args = bench_scaling.parse_args(["--output", str(tmp_path), "--cpu", "--strategies", "ddp", "--configs", *configs])
    with pytest.raises(bench_scaling.WaveInterrupted) as cut:
        bench_scaling.run_wave([launch], args, {})
    assert cut.value.rows == [{"config": configs[0], "rc": None}, {"config": configs[1], "rc": None}]
