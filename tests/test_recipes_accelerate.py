"""The accelerate config files: what `accelerate launch --config_file recipes/accelerate/<x>.yaml` turns them into.
(DDP itself runs on the CPU in test_recipes_pretrain.py; FSDP needs GPUs, so here its launch environment is built
and the FSDP plugin is resolved against our models.)"""

from __future__ import annotations

import os

import pytest
from conftest import build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE_DIR = os.path.join(REPO, "recipes", "accelerate")


def _launch_env(config_name: str) -> dict:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", os.path.join(ACCELERATE_DIR, config_name), os.path.join(REPO, "recipes", "pretrain.py")]
    )
    args, _, _ = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


def test_ddp_config():
    args, env = _launch_env("ddp.yaml")
    assert args.multi_gpu and args.num_processes == 2 and args.num_machines == 1
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env.get("ACCELERATE_USE_FSDP", "false") != "true"


@pytest.mark.parametrize(
    ("family", "layer_class"), [("rbf", "DecoderLayer"), ("gka", "DecoderLayer"), ("llama", "LlamaDecoderLayer")]
)
def test_fsdp_config_shards_decoder_layers(family, layer_class, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import StateDictType

    args, env = _launch_env("fsdp.yaml")
    assert args.num_processes == 2
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT  # final/ is a normal checkpoint
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(
            LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
        )
    else:
        model = build_model(family, {})
    plugin.set_auto_wrap_policy(model)
    classes = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert {c.__name__ for c in classes} == {layer_class}
