"""Bits per byte of a causal LM on text: a tokenizer-independent measure of how well it predicts the text.

Definition::

    bpb = (sum of the next-token cross-entropies in nats over every token of the text) / (ln 2 * UTF-8 bytes of the text)

Each document is encoded without special tokens and a BOS id is prepended, so every token of the text, the first
included, is predicted (the BOS itself is not). A text longer than the model's context ``L`` is scored with a
strided sliding window: the first window takes tokens ``[0, L)`` and scores all of them; each next window moves its
end forward by ``stride`` tokens, takes the ``L`` tokens before that end and scores only the ``stride`` new ones,
which so see at least ``L - stride`` tokens of context.  Every token is scored exactly once.  ``stride`` ranges over
``1 .. L-1`` (a target needs the token before it inside its window); ``L - 1`` is the cheapest (windows barely
overlap), smaller strides cost more forwards and give each token more context.  The default is ``L // 2``.
"""

from __future__ import annotations

import gzip
import logging
import lzma
import math

from .core import model_context_length, resolve_bos_id, score_sequences
from .core_prompts import Encoder, ScoredSequence, hf_encoder


logger = logging.getLogger(__name__)


def read_documents(path: str, separator: str | None = None, max_chars: int | None = None) -> list[str]:
    """Read a UTF-8 text file (``.xz`` and ``.gz`` are decompressed) as a list of documents.

    Without ``separator`` the whole file is one document, unchanged.  With it, the text is split on it, each
    piece stripped of surrounding whitespace and empty pieces dropped (e.g. ``"<|endoftext|>"`` for TinyStories).
    ``max_chars`` keeps only the file's first characters (before splitting).
    """
    opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read() if max_chars is None else f.read(max_chars)
    if separator is None:
        return [text]
    return [doc.strip() for doc in text.split(separator) if doc.strip()]


def window_sequences(ids: list[int], max_len: int | None, stride: int | None) -> list[ScoredSequence]:
    """Cut one document's tokens (BOS first) into scored windows; every token after the first is scored once."""
    total = len(ids)
    if total < 2:
        return []
    if max_len is None or total <= max_len:
        return [ScoredSequence(list(ids), 1, total)]
    if not 1 <= stride <= max_len - 1:
        raise ValueError(f"stride={stride}: must be in [1, max_len - 1] = [1, {max_len - 1}]")
    windows = [ScoredSequence(list(ids[:max_len]), 1, max_len)]
    end = max_len
    while end < total:
        new_end = min(end + stride, total)
        begin = new_end - max_len
        windows.append(ScoredSequence(list(ids[begin:new_end]), end - begin, new_end - begin))
        end = new_end
    return windows


def bits_per_byte(
    model,
    tokenizer,
    texts,
    *,
    max_seq_len: int | str | None = "auto",
    stride: int | None = None,
    batch_size: int = 8,
    bos="auto",
    device=None,
    encode: Encoder | None = None,
    logits_to_keep: str = "auto",
) -> dict:
    """Bits per byte of ``model`` on ``texts`` (a string or a list of documents).

    Args:
        max_seq_len: window length ``L`` in tokens, BOS included; "auto" reads the model config, None means one
            window per document whatever its length.
        stride: new tokens scored per window after the first (default ``L // 2``).
        bos: "auto" (BOS, else EOS token), or a token id; every document starts with it.

    Returns:
        ``bits_per_byte``, ``nats`` (summed loss), ``num_tokens`` (scored), ``num_bytes``, ``bits_per_token``,
        ``tokens_per_byte``, ``num_documents``, ``num_windows``, ``max_seq_len``, ``stride``, ``bos_id`` and
        ``lossless_roundtrip`` (whether decoding the tokens gives the text back; when it does not, the bytes are
        still those of the input text).
    """
    if isinstance(texts, str):
        texts = [texts]
    if max_seq_len == "auto":
        max_seq_len = model_context_length(model)
    if max_seq_len is not None and max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len}: must be >= 2")
    if stride is None and max_seq_len is not None:
        stride = max(1, max_seq_len // 2)
    bos_id = resolve_bos_id(tokenizer, bos)
    if bos_id is None:
        raise ValueError("bits_per_byte needs a BOS id so that the first token of each document is predicted")
    encode = encode or hf_encoder(tokenizer)

    windows, num_bytes, num_tokens, lossless = [], 0, 0, True
    for text in texts:
        if not text:
            continue
        ids = encode([text])[0]
        num_bytes += len(text.encode("utf-8"))
        num_tokens += len(ids)
        if hasattr(tokenizer, "decode") and lossless:
            lossless = tokenizer.decode(ids) == text
        windows.extend(window_sequences([bos_id] + ids, max_seq_len, stride))
    if num_bytes == 0:
        raise ValueError("texts: nothing to score (empty text)")
    if not lossless:
        logger.warning("the tokenizer does not decode its tokens back to the exact text; bytes are the input's")
    scores = score_sequences(model, windows, batch_size, bos_id, device, logits_to_keep)
    scored = sum(s.num_tokens for s in scores)
    if scored != num_tokens:
        raise RuntimeError(f"scored {scored} tokens of {num_tokens}: the windows do not cover the text")
    nats = math.fsum(s.sum_loss for s in scores)
    return {
        "bits_per_byte": nats / (math.log(2) * num_bytes),
        "nats": nats,
        "num_tokens": num_tokens,
        "num_bytes": num_bytes,
        "bits_per_token": nats / (math.log(2) * num_tokens),
        "tokens_per_byte": num_tokens / num_bytes,
        "num_documents": sum(1 for t in texts if t),
        "num_windows": len(windows),
        "max_seq_len": max_seq_len,
        "stride": stride,
        "bos_id": bos_id,
        "lossless_roundtrip": lossless,
    }
