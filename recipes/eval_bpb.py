"""Bits per byte of any causal LM on a text file: summed token losses in nats / (ln 2 * UTF-8 bytes).

    python recipes/eval_bpb.py --model <dir or hub name> --text FILE[.xz|.gz] [--separator "<|endoftext|>"]
        [--max-chars N] [--max-seq-len L] [--stride S] [--batch-size B] [--device cpu|cuda] [--dtype ...]
        [--trust-remote-code] [--output bpb.json]

Texts longer than the model's context are scored with a strided sliding window (each token once, with at least
L - S tokens of context); see hf_rbf/eval/bpb.py and docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


try:
    import hf_rbf  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_rbf.eval.bpb import bits_per_byte, read_documents  # noqa: E402
from hf_rbf.eval.loading import load_model_and_tokenizer  # noqa: E402


def eval_bpb(
    model: str,
    text: str,
    *,
    separator: str | None = None,
    max_chars: int | None = None,
    max_seq_len: int | str | None = "auto",
    stride: int | None = None,
    batch_size: int = 8,
    bos="auto",
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    output: str | None = None,
) -> dict:
    """Load ``model``, score the file ``text`` and optionally write the JSON to ``output``."""
    lm, tokenizer = load_model_and_tokenizer(model, device, dtype, trust_remote_code)
    docs = read_documents(text, separator, max_chars)
    out = bits_per_byte(
        lm, tokenizer, docs, max_seq_len=max_seq_len, stride=stride, batch_size=batch_size, bos=bos,
        device=next(lm.parameters()).device,
    )
    out = {"model": model, "text": text, "separator": separator, "max_chars": max_chars,
           "dtype": str(next(lm.parameters()).dtype), **out}
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True, help="UTF-8 text file (.xz and .gz are read directly)")
    p.add_argument("--separator", default=None, help="split the file into documents on this string")
    p.add_argument("--max-chars", type=int, default=None, help="only the file's first N characters")
    p.add_argument("--max-seq-len", default="auto", type=lambda v: v if v == "auto" else None if v == "none" else int(v),
                   help="window length in tokens: auto (model config), none (one window per document), or an int")
    p.add_argument("--stride", type=int, default=None, help="new tokens per window (default max_seq_len // 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bos", default="auto", type=lambda v: v if v == "auto" else int(v))
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    out = eval_bpb(
        a.model, a.text, separator=a.separator, max_chars=a.max_chars, max_seq_len=a.max_seq_len, stride=a.stride,
        batch_size=a.batch_size, bos=a.bos, device=a.device, dtype=a.dtype, trust_remote_code=a.trust_remote_code,
        output=a.output,
    )
    print(f"bits per byte: {out['bits_per_byte']:.4f}  ({out['num_tokens']} tokens, {out['num_bytes']} bytes, "
          f"{out['num_documents']} documents, {out['num_windows']} windows of <= {out['max_seq_len']} tokens, "
          f"stride {out['stride']})")
    return out


if __name__ == "__main__":
    main()
