"""Loading a causal LM and its tokenizer for evaluation (a local folder or a hub name, with or without remote code)."""

from __future__ import annotations

import logging

import torch


logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None = None) -> torch.device:
    """``None`` or "auto": CUDA when available, else CPU; otherwise the device named."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on a GPU that supports it, float32 elsewhere; or one of :data:`DTYPES`."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed values are 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def load_model_and_tokenizer(
    name_or_path: str, device: str | None = None, dtype: str = "auto", trust_remote_code: bool = False
):
    """``AutoModelForCausalLM`` + ``AutoTokenizer`` from a folder or hub name, in eval mode on ``device``.

    ``trust_remote_code=True`` is what a checkpoint of our models needs when hf_rbf is not imported; with hf_rbf
    imported its classes are registered with the Auto classes and plain loading works too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    model.to(dev).eval()
    logger.info("loaded %s (%s) on %s in %s", name_or_path, type(model).__name__, dev, torch_dtype)
    return model, tokenizer
