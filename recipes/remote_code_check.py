"""Check that a saved checkpoint loads with ``trust_remote_code=True`` in a fresh process where hf_rbf cannot be
imported, and gives the same logits and the same generated text as the checkpoint loaded with hf_rbf.

Generation is checked three ways, because a cache that is silently dropped (transformers 5.24 renamed
``past_key_values`` to ``cache``) still gives the right logits for a full forward: greedy ``generate`` with the cache
in the child, greedy ``generate`` without the cache in the child, and greedy ``generate`` with the cache here must
produce the same tokens.

The child process installs a meta-path hook that makes every ``import hf_rbf...`` fail, so the model can only come
from the Python files that ``save_pretrained`` copied next to the weights.  It loads the tokenizer with
``AutoTokenizer`` and the model with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` on the CPU
in float32, runs the given token ids and writes the logits and greedy continuations (with and without the cache); this
process compares them with its own.

Usable from the command line too::

    python recipes/remote_code_check.py <checkpoint dir> [--text "Once upon a time"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class BlockHfRbf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "hf_rbf" or name.startswith("hf_rbf."):
                raise ImportError("hf_rbf is hidden in this process")
            return None

    sys.meta_path.insert(0, BlockHfRbf())
    try:
        import hf_rbf  # noqa: F401
        raise SystemExit("hf_rbf was importable despite the hook")
    except ImportError:
        pass

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, ids_file, out_file = sys.argv[1], sys.argv[2], sys.argv[3]
    tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.load(ids_file)
    new_tokens = int(sys.argv[4])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(ids).logits
        greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        cached = model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=True, **greedy)
        uncached = model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=False, **greedy)
    torch.save({"logits": logits, "cached": cached, "uncached": uncached}, out_file)
    print("REMOTE_CHECK_RESULT " + json.dumps({
        "model_class": type(model).__name__,
        "model_module": type(model).__module__,
        "tokenizer_class": type(tokenizer).__name__,
        "hf_rbf_loaded": any(m == "hf_rbf" or m.startswith("hf_rbf.") for m in sys.modules),
    }))
    """
)


def remote_code_check(checkpoint: str, input_ids, *, new_tokens: int = 16, timeout: float = 600.0) -> dict:
    """Load ``checkpoint`` with remote code in a child process without hf_rbf and compare its logits on
    ``input_ids`` (``[B, N]`` long tensor) and its greedy continuations (``new_tokens`` tokens, with and without the
    KV cache) with ``AutoModelForCausalLM.from_pretrained(checkpoint)`` here (hf_rbf imported), both on the CPU in
    float32.

    Returns ``{"ok", "max_abs_diff", "logits_equal", "generate_ok", "generated_ids", "model_class", "model_module",
    "hf_rbf_loaded", ...}``; ``ok`` needs the child to succeed, hf_rbf to stay unloaded there, the logits to agree to
    1e-5 (relative to their largest magnitude; they are computed by the same code on the same CPU, so they normally
    agree bit for bit) and ``generate_ok``: the child's cached and uncached greedy tokens and this process's cached
    greedy tokens all equal.
    """
    import torch
    from transformers import AutoModelForCausalLM

    import hf_rbf  # noqa: F401

    checkpoint = os.path.abspath(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    input_ids = torch.as_tensor(input_ids, dtype=torch.long).cpu()
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else 0
    with torch.no_grad():
        reference = model(input_ids).logits
        here = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            use_cache=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    with tempfile.TemporaryDirectory(prefix="hf_rbf_remote_check_") as tmp:
        ids_file, out_file = os.path.join(tmp, "ids.pt"), os.path.join(tmp, "logits.pt")
        script = os.path.join(tmp, "load_remote.py")
        torch.save(input_ids, ids_file)
        with open(script, "w", encoding="utf-8") as f:
            f.write(CHILD_SCRIPT)
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the repository is not on the child's path; the hook hides hf_rbf anyway
        env["HF_MODULES_CACHE"] = os.path.join(tmp, "modules")  # a private remote-code module cache
        env["HF_HUB_OFFLINE"] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.run(
            [sys.executable, script, checkpoint, ids_file, out_file, str(new_tokens)],
            cwd=tmp,
            env=env,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            return {"ok": False, "error": proc.stderr[-4000:], "returncode": proc.returncode}
        marked = [line for line in proc.stdout.splitlines() if line.startswith("REMOTE_CHECK_RESULT ")]
        if not marked:
            return {"ok": False, "error": "the child printed no result:\n" + proc.stdout[-2000:] + proc.stderr[-2000:]}
        info = json.loads(marked[-1].split(" ", 1)[1])
        child = torch.load(out_file)
    logits = child["logits"]
    diff = (logits - reference).abs().max().item()
    scale = max(reference.abs().max().item(), 1.0)
    generate_ok = torch.equal(child["cached"], child["uncached"]) and torch.equal(child["cached"], here)
    ok = (not info["hf_rbf_loaded"]) and logits.shape == reference.shape and diff <= 1e-5 * scale and generate_ok
    return {
        "ok": bool(ok),
        "max_abs_diff": diff,
        "logits_equal": bool(torch.equal(logits, reference)),
        "generate_ok": bool(generate_ok),
        "generated_ids": here[0, input_ids.shape[1] :].tolist(),
        "generated_ids_remote_cached": child["cached"][0, input_ids.shape[1] :].tolist(),
        "generated_ids_remote_uncached": child["uncached"][0, input_ids.shape[1] :].tolist(),
        "num_tokens": int(input_ids.numel()),
        **info,
    }


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--text", default="Once upon a time, there was a little")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = tokenizer(args.text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    result = remote_code_check(args.checkpoint, ids)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
