"""Small models and tokenizers for the evaluation tests (test_eval_core, test_bpb, test_lm_eval).

- :class:`TableLM`: a causal LM whose logits at a position depend only on the token there (a bigram table), so the
  expected losses and argmaxes of any sequence can be computed by hand; batching and padding cannot change them.
- :func:`word_tokenizer`: a word-level ``transformers`` tokenizer over a fixed vocabulary (one id per word).
- :func:`byte_bpe_tokenizer` and :func:`save_tiny_llama`: a real (random-weight) LlamaForCausalLM with a byte-level
  BPE tokenizer trained on the sample bundle, saved like any checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.modeling_outputs import CausalLMOutput


HERE = os.path.dirname(os.path.abspath(__file__))
CORE_SAMPLE = os.path.join(HERE, "data", "core_sample")


class TableLM(torch.nn.Module):
    """logits[b, t] = table[input_ids[b, t]]: a bigram model with a hand-set table ``[V, V]``.

    ``with_logits_to_keep`` exposes transformers' ``logits_to_keep`` argument (1-D positions or an int), so both
    scoring paths can be tested.  ``max_len``: inputs longer than this raise (to check left-cropping).
    """

    def __init__(self, table: torch.Tensor, max_len: int | None = None, with_logits_to_keep: bool = True):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone().float(), requires_grad=False)
        self.config = SimpleNamespace(max_position_embeddings=max_len)
        self.max_len = max_len
        self.calls = []  # input shapes seen
        if not with_logits_to_keep:
            self.forward = self._forward_plain

    def _logits(self, input_ids):
        if self.max_len is not None and input_ids.shape[1] > self.max_len:
            raise AssertionError(f"input of {input_ids.shape[1]} tokens > max_len {self.max_len}")
        self.calls.append(tuple(input_ids.shape))
        return self.table[input_ids]

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        logits = self._logits(input_ids)
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutput(logits=logits)

    def _forward_plain(self, input_ids, attention_mask=None):
        return CausalLMOutput(logits=self._logits(input_ids))


class UniformLM(torch.nn.Module):
    """All logits zero: every next token has probability 1 / vocab_size."""

    def __init__(self, vocab_size: int, max_len: int | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.dummy = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.config = SimpleNamespace(max_position_embeddings=max_len)
        self.max_len = max_len
        self.lengths = []

    def forward(self, input_ids, attention_mask=None):
        if self.max_len is not None:
            assert input_ids.shape[1] <= self.max_len
        self.lengths.append(input_ids.shape[1])
        return CausalLMOutput(logits=torch.zeros(*input_ids.shape, self.vocab_size))


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: "<bos>" is id 0, then ``words`` in order; text splits on whitespace and punctuation."""
    vocab = {"<bos>": 0, "<unk>": 1}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="<unk>")


def sample_texts() -> list[str]:
    """Every string in the sample bundle (to train a tokenizer on)."""
    texts = []
    for path in sorted(glob.glob(os.path.join(CORE_SAMPLE, "eval_data", "*", "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                for value in json.loads(line).values():
                    if isinstance(value, str):
                        texts.append(value)
                    elif isinstance(value, list):
                        texts.extend(v for v in value if isinstance(v, str))
    return texts


def byte_bpe_tokenizer(texts: list[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Byte-level BPE (lossless on any UTF-8 text) with "<|endoftext|>" as BOS/EOS, trained on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def tiny_llama(vocab_size: int, max_position_embeddings: int = 256, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    # Larger weights than the default init so that the random model has non-trivial, input-dependent logits.
    config.initializer_range = 0.5
    return LlamaForCausalLM(config).eval()


def save_tiny_llama(path: str, max_position_embeddings: int = 256, seed: int = 0) -> str:
    """Save a tiny random Llama and a byte-BPE tokenizer trained on the sample bundle into ``path``."""
    tokenizer = byte_bpe_tokenizer(sample_texts())
    model = tiny_llama(len(tokenizer), max_position_embeddings, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def isolate_hf_caches(monkeypatch, root) -> None:
    """Point the HF caches (and evaluate's copies of them, read at import) at ``root``; no hub access."""
    root = str(root)
    monkeypatch.setenv("HF_HOME", root)
    monkeypatch.setenv("HF_MODULES_CACHE", os.path.join(root, "modules"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    import evaluate.config
    from pathlib import Path

    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", Path(root) / "modules")
    monkeypatch.setattr(evaluate.config, "HF_METRICS_CACHE", Path(root) / "metrics")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
