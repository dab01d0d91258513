"""Text, tokenizer and packed blocks for ``recipes/pretrain.py``.

* :func:`load_documents`: one ``datasets.Dataset`` with a ``text`` column, one row per document, from local files
  (``datasets.load_dataset("text" | "json", ...)``; ``.xz`` / ``.gz`` / ``.bz2`` are decompressed by ``datasets``) or a
  hub dataset name, split on a document separator such as TinyStories' ``<|endoftext|>``.
* :func:`train_tokenizer`: a ``tokenizers`` byte-level BPE trained on the training documents, returned as a
  ``PreTrainedTokenizerFast`` whose BOS and EOS are the document separator token and whose PAD is its own token.
* :func:`pack_blocks`: every document encoded without special tokens and followed by EOS, the whole stream cut into
  ``block_size`` blocks (the final partial block is dropped), as a ``datasets.Dataset`` with an ``input_ids`` column.
* :func:`prepare_data`: all of the above with a cache on disk keyed by the tokenizer, the sources and the block size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np

from .pretrain_config import resolve_path

logger = logging.getLogger(__name__)

_JSON_EXTENSIONS = (".json", ".jsonl")
_COMPRESSION_EXTENSIONS = (".xz", ".gz", ".bz2", ".zst")
# Bump when the packing layout changes, so old caches are not reused.
CACHE_VERSION = 1


def _strip_compression(path: str) -> str:
    for ext in _COMPRESSION_EXTENSIONS:
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def source_format(source: dict, files: list[str]) -> str:
    """``source["format"]``, else "json" for ``.json``/``.jsonl`` files (compressed or not), else "text"."""
    if source.get("format"):
        return source["format"]
    kinds = {"json" if _strip_compression(f).endswith(_JSON_EXTENSIONS) else "text" for f in files}
    if len(kinds) > 1:
        raise ValueError(f"data source mixes JSON and text files ({files}); split it into two sources")
    return kinds.pop()


def _source_files(source: dict, data_root: str | None) -> list[str]:
    files = source["files"]
    files = [files] if isinstance(files, str) else list(files)
    return [resolve_path(f, data_root) for f in files]


def _split_documents(dataset, separator: str | None, num_proc: int | None):
    """Rows split on ``separator`` (each piece stripped, empty pieces dropped); without one, rows are stripped."""

    def split(batch):
        out = []
        for text in batch["text"]:
            pieces = text.split(separator) if separator else [text]
            out.extend(p.strip() for p in pieces if p.strip())
        return {"text": out}

    return dataset.map(split, batched=True, remove_columns=dataset.column_names, num_proc=num_proc)


def load_source(source: dict, data_root: str | None = None, num_proc: int | None = None):
    """One data source as a ``datasets.Dataset`` with a single ``text`` column, one document per row."""
    import datasets

    text_column = source.get("text_column", "text")
    separator = source.get("separator")
    if "hub" in source:
        ds = datasets.load_dataset(source["hub"], source.get("hub_config"), split=source.get("split", "train"))
    else:
        files = _source_files(source, data_root)
        fmt = source_format(source, files)
        if fmt == "text":
            # one row per file: documents are cut by the separator, not by lines
            ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
        else:
            ds = datasets.load_dataset("json", data_files=files, split="train")
    if text_column not in ds.column_names:
        raise ValueError(f"data source {source}: no column {text_column!r}; columns: {ds.column_names}")
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    ds = _split_documents(ds, separator, num_proc)
    if source.get("max_documents") is not None:
        ds = ds.select(range(min(int(source["max_documents"]), len(ds))))
    return ds


def load_documents(sources: list[dict], data_root: str | None = None, num_proc: int | None = None):
    """All ``sources`` concatenated (in order) into one dataset of documents."""
    import datasets

    parts = [load_source(s, data_root, num_proc) for s in sources]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def split_documents(train_docs, validation_sources: list[dict], fraction: float, data_root, num_proc):
    """(train documents, validation documents): the validation sources, or the last ``fraction`` of the training
    documents held out (whole documents, so no text is in both)."""
    if validation_sources:
        return train_docs, load_documents(validation_sources, data_root, num_proc)
    n = len(train_docs)
    n_val = max(1, round(n * fraction))
    if n_val >= n:
        raise ValueError(f"validation_fraction={fraction} holds out all {n} training documents")
    return train_docs.select(range(n - n_val)), train_docs.select(range(n - n_val, n))


# ------------------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------------------


def train_tokenizer(
    texts,
    vocab_size: int,
    *,
    min_frequency: int = 2,
    eos_token: str = "<|endoftext|>",
    pad_token: str = "<|pad|>",
    model_max_length: int | None = None,
    max_train_chars: int | None = None,
):
    """A byte-level BPE (GPT-2 style: no unknown tokens, exact round trip) trained on ``texts`` (an iterable of
    documents), as a ``PreTrainedTokenizerFast`` with ``bos = eos = eos_token`` and ``pad = pad_token``.

    Ids 0 and 1 are ``eos_token`` and ``pad_token``; the 256 byte symbols follow, then the merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token, pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def iterate():
        used = 0
        for text in texts:
            if max_train_chars is not None and used >= max_train_chars:
                return
            yield text
            used += len(text)

    tok.train_from_iterator(iterate(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=eos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length or int(1e30),
    )
    return fast


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary, merges and special tokens (what decides the token ids)."""
    state = tokenizer.backend_tokenizer.to_str()
    specials = json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token])
    return hashlib.sha256((state + specials).encode("utf-8")).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------------
# packing
# ------------------------------------------------------------------------------------------------------------


def encode_stream(texts, tokenizer, batch_size: int = 1000) -> np.ndarray:
    """All documents encoded without special tokens, each followed by EOS, concatenated (int32)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer needs an EOS token to separate documents")
    pieces = []
    texts = list(texts)
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], add_special_tokens=False)["input_ids"]
        for ids in enc:
            pieces.append(np.asarray(ids + [eos], dtype=np.int32))
    if not pieces:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(pieces)


def pack_blocks(texts, tokenizer, block_size: int):
    """``datasets.Dataset`` of ``input_ids`` blocks of ``block_size`` tokens cut from the EOS-separated stream."""
    import datasets

    stream = encode_stream(texts, tokenizer)
    n_blocks = len(stream) // block_size
    if n_blocks == 0:
        raise ValueError(
            f"the text gives {len(stream)} tokens, fewer than one block of {block_size}: use more text or a smaller "
            "data.block_size"
        )
    blocks = stream[: n_blocks * block_size].reshape(n_blocks, block_size)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), length=block_size)})
    ds = datasets.Dataset.from_dict({"input_ids": blocks}, features=features)
    ds.info.description = json.dumps({"tokens": len(stream), "blocks": int(n_blocks)})
    return ds


def _sources_key(sources: list[dict], data_root) -> list:
    key = []
    for s in sources:
        entry = {k: v for k, v in s.items() if k != "files"}
        if "files" in s:
            entry["files"] = [(f, os.path.getsize(f), int(os.path.getmtime(f))) for f in _source_files(s, data_root)]
        key.append(entry)
    return key


def data_cache_key(cfg: dict, tokenizer) -> str:
    data = cfg["data"]
    payload = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "train": _sources_key(data["train"], data["root"]),
        "validation": _sources_key(data["validation"], data["root"]),
        "validation_fraction": None if data["validation"] else data["validation_fraction"],
        "block_size": data["block_size"],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def prepare_data(cfg: dict, tokenizer, documents=None, log=print) -> dict:
    """Packed train / validation blocks (cached in ``data.cache_dir``, default ``<output_dir>/data_cache``) and the
    validation documents (for bits per byte).

    Returns ``{"train": Dataset, "validation": Dataset, "validation_texts": [str], "train_tokens": int,
    "validation_tokens": int, "cache": path}``.  ``documents`` is ``(train_docs, validation_docs)`` when the caller
    already loaded them (e.g. to train the tokenizer).
    """
    import datasets

    data = cfg["data"]
    if documents is None:
        documents = load_split_documents(cfg)
    train_docs, val_docs = documents
    cache_root = data["cache_dir"] or os.path.join(cfg["output_dir"], "data_cache")
    cache = os.path.join(cache_root, data_cache_key(cfg, tokenizer))
    if os.path.isdir(os.path.join(cache, "train")) and os.path.isdir(os.path.join(cache, "validation")):
        train = datasets.load_from_disk(os.path.join(cache, "train"))
        validation = datasets.load_from_disk(os.path.join(cache, "validation"))
        log(f"[data] packed blocks from the cache {cache}")
    else:
        train = pack_blocks(train_docs["text"], tokenizer, data["block_size"])
        validation = pack_blocks(val_docs["text"], tokenizer, data["block_size"])
        tmp = cache + f".tmp{os.getpid()}"
        train.save_to_disk(os.path.join(tmp, "train"))
        validation.save_to_disk(os.path.join(tmp, "validation"))
        if not os.path.isdir(cache):
            os.replace(tmp, cache)
        train = datasets.load_from_disk(os.path.join(cache, "train"))
        validation = datasets.load_from_disk(os.path.join(cache, "validation"))
    train_tokens = json.loads(train.info.description)["tokens"]
    val_tokens = json.loads(validation.info.description)["tokens"]
    if data["max_validation_blocks"] is not None and len(validation) > data["max_validation_blocks"]:
        validation = validation.select(range(int(data["max_validation_blocks"])))
    train = train.with_format("torch")
    validation = validation.with_format("torch")
    return {
        "train": train,
        "validation": validation,
        "validation_texts": list(val_docs["text"]),
        "train_tokens": train_tokens,
        "validation_tokens": val_tokens,
        "train_documents": len(train_docs),
        "validation_documents": len(val_docs),
        "cache": cache,
    }


def load_split_documents(cfg: dict):
    """(train documents, validation documents) as described by ``cfg["data"]``."""
    data = cfg["data"]
    train_docs = load_documents(data["train"], data["root"], data["num_proc"])
    return split_documents(
        train_docs, data["validation"], float(data["validation_fraction"]), data["root"], data["num_proc"]
    )


def collate_blocks(examples: list[dict]) -> dict:
    """Stack packed blocks; labels are the inputs (the model shifts them): every token is a real token."""
    import torch

    ids = torch.stack([torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples])
    return {"input_ids": ids, "labels": ids.clone()}


__all__ = [
    "collate_blocks",
    "encode_stream",
    "load_documents",
    "load_source",
    "load_split_documents",
    "pack_blocks",
    "prepare_data",
    "split_documents",
    "tokenizer_fingerprint",
    "train_tokenizer",
]
