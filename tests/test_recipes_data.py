"""Data side of the recipes: loading text with `datasets` (plain, .xz, JSON lines, separators), the byte-level BPE
tokenizer, packing with EOS between documents, held-out validation documents, the packed-data cache."""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

import numpy as np

from recipes.pretrain_config import load_config
from recipes.pretrain_data import (
    collate_blocks,
    encode_stream,
    load_documents,
    pack_blocks,
    prepare_data,
    split_documents,
    train_tokenizer,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "Once upon a time there was a cat.",
    "Tom had a red ball. He liked it.",
    "The sun was hot.\nLily went to the park.",
]


def _write_sources(tmp_path):
    (tmp_path / "stories.txt").write_text("\n<|endoftext|>\n".join(DOCS[:2]) + "\n<|endoftext|>\n")
    with lzma.open(tmp_path / "more.txt.xz", "wt", encoding="utf-8") as f:
        f.write(DOCS[2] + "\n<|endoftext|>\n")
    with lzma.open(tmp_path / "books.jsonl.xz", "wt", encoding="utf-8") as f:
        for i, text in enumerate(["A book about a fox.", "  ", "Another book."]):
            f.write(json.dumps({"id": i, "body": text}) + "\n")


def test_load_documents_from_text_xz_and_json(tmp_path):
    _write_sources(tmp_path)
    sources = [
        {"files": [str(tmp_path / "stories.txt")], "separator": "<|endoftext|>"},
        {"files": "{data_root}/more.txt.xz", "separator": "<|endoftext|>"},
        {"files": [str(tmp_path / "books.jsonl.xz")], "text_column": "body"},
    ]
    docs = load_documents(sources, data_root=str(tmp_path))
    assert docs.column_names == ["text"]
    assert list(docs["text"]) == DOCS + ["A book about a fox.", "Another book."]  # stripped, empty dropped
    one = load_documents([{"files": [str(tmp_path / "stories.txt")], "max_documents": 1, "separator": "<|endoftext|>"}])
    assert list(one["text"]) == DOCS[:1]
    whole = load_documents([{"files": [str(tmp_path / "stories.txt")]}])  # no separator: the file is one document
    assert len(whole) == 1 and "<|endoftext|>" in whole[0]["text"]


def test_validation_is_held_out_by_document(tmp_path):
    _write_sources(tmp_path)
    docs = load_documents(
        [{"files": [str(tmp_path / "stories.txt"), str(tmp_path / "more.txt.xz")], "separator": "<|endoftext|>"}]
    )
    train, val = split_documents(docs, [], 0.34, None, None)
    assert list(train["text"]) == DOCS[:2] and list(val["text"]) == DOCS[2:]


def test_tokenizer_and_packing():
    texts = [
        line
        for line in Path(os.path.join(REPO, "recipes/data/tinystories/train.txt"))
        .read_text()
        .split("<|endoftext|>")[:60]
        if line.strip()
    ]
    tok = train_tokenizer(texts, 400, min_frequency=2)
    assert len(tok) == 400 and tok.eos_token_id == 0 and tok.pad_token_id == 1 and tok.bos_token_id == 0
    for text in texts[:5]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    stream = encode_stream(DOCS, tok)
    eos_at = np.flatnonzero(stream == tok.eos_token_id)
    assert len(eos_at) == 3 and eos_at[-1] == len(stream) - 1  # one EOS after every document
    first = tok(DOCS[0], add_special_tokens=False)["input_ids"]
    assert stream[: len(first)].tolist() == first
    blocks = pack_blocks(DOCS * 4, tok, 8)
    assert len(blocks) == len(encode_stream(DOCS * 4, tok)) // 8
    assert (
        np.concatenate([b for b in blocks["input_ids"]]).tolist()
        == encode_stream(DOCS * 4, tok)[: len(blocks) * 8].tolist()
    )
    batch = collate_blocks([{"input_ids": blocks[0]["input_ids"]}, {"input_ids": blocks[1]["input_ids"]}])
    assert batch["input_ids"].shape == (2, 8) and (batch["labels"] == batch["input_ids"]).all()


def test_prepare_data_caches_by_tokenizer_and_sources(tmp_path):
    cfg = load_config(
        os.path.join(REPO, "recipes/configs/cpu_test.yaml"), ["data.max_validation_blocks=3"], output_dir=str(tmp_path)
    )
    from recipes.pretrain_data import load_split_documents

    docs = load_split_documents(cfg)
    tok = train_tokenizer(docs[0]["text"], 300)
    logs = []
    first = prepare_data(cfg, tok, docs, log=logs.append)
    second = prepare_data(cfg, tok, docs, log=logs.append)
    assert any("from the cache" in line for line in logs) and first["cache"] == second["cache"]
    assert len(first["validation"]) == 3 and first["train"][0]["input_ids"].shape == (32,)
    assert first["train_tokens"] == second["train_tokens"] > 32 * len(first["train"]) - 32
    other = train_tokenizer(docs[0]["text"], 320)
    assert prepare_data(cfg, other, docs, log=logs.append)["cache"] != first["cache"]


def test_hub_sources_go_through_load_dataset(tmp_path):
    """A `hub:` source is `datasets.load_dataset(name, config, split=...)`; a local dataset folder takes the same path
    (no network here), with its own text column and a separator."""
    folder = tmp_path / "my_stories"
    folder.mkdir()
    rows = [{"story": "One.<|endoftext|>Two."}, {"story": "Three."}]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / "validation.jsonl").write_text(json.dumps({"story": "Four."}) + "\n")
    source = {"hub": str(folder), "split": "train", "text_column": "story", "separator": "<|endoftext|>"}
    assert list(load_documents([source])["text"]) == ["One.", "Two.", "Three."]
    val = load_documents([dict(source, split="validation")])
    assert list(val["text"]) == ["Four."]
