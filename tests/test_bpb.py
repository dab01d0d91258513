"""Bits per byte: the definition, the strided sliding window, documents, and the CLI."""

import json
import lzma
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_helpers import TableLM, UniformLM, byte_bpe_tokenizer, sample_texts, save_tiny_llama, tiny_llama  # noqa: E402

from hf_rbf.eval.bpb import bits_per_byte, read_documents, window_sequences  # noqa: E402


TEXT = "Once upon a time, a little fox found a shiny key. Élodie said: «c'est à moi!» 🦊\nThe end."


@pytest.fixture(scope="module")
def tok():
    return byte_bpe_tokenizer(sample_texts())


def test_uniform_model_gives_log2_vocab_bits_per_token(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    num_bytes = len(TEXT.encode("utf-8"))
    assert num_bytes > len(TEXT)  # multi-byte characters are counted as bytes
    expected = math.log2(len(tok)) * len(ids) / num_bytes
    for max_len, stride in ((None, None), (16, 5), (9, 8)):
        model = UniformLM(len(tok), max_len=max_len)
        out = bits_per_byte(model, tok, TEXT, max_seq_len=max_len, stride=stride, batch_size=3)
        assert out["bits_per_byte"] == pytest.approx(expected, rel=1e-6)
        assert out["num_tokens"] == len(ids) and out["num_bytes"] == num_bytes
        assert out["bits_per_token"] == pytest.approx(math.log2(len(tok)), rel=1e-6)
        assert out["lossless_roundtrip"]
        if max_len is not None:
            assert max(model.lengths) <= max_len and out["num_windows"] > 1


def test_windows_score_every_token_once_with_enough_context():
    ids = list(range(100, 137))  # 37 tokens, BOS-first
    for max_len, stride in ((8, 1), (8, 3), (8, 7), (10, 5), (37, 4), (50, 49)):
        windows = window_sequences(ids, max_len, stride)
        scored = [w.tokens[p] for w in windows for p in range(w.start, w.end)]
        assert scored == ids[1:]
        for i, w in enumerate(windows):
            assert len(w.tokens) <= max_len and w.start >= 1
            assert w.tokens == ids[ids.index(w.tokens[0]) : ids.index(w.tokens[0]) + len(w.tokens)]
            if i > 0:
                assert w.start >= max_len - stride  # each new token sees at least L - stride tokens before it
    with pytest.raises(ValueError, match="stride=8"):
        window_sequences(ids, 8, 8)


def test_windowed_losses_match_a_hand_computation(tok):
    model = tiny_llama(len(tok), max_position_embeddings=64, seed=3)
    text = "The little fox ran to the river and looked at the moon."
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    t = len(ids)
    assert t > 12
    x = torch.tensor(ids)

    def nats(begin, end, first_target):
        logits = model(input_ids=x[None, begin:end]).logits[0].float()
        return F.cross_entropy(logits[first_target - begin - 1 : end - begin - 1], x[first_target:end], reduction="sum").item()

    with torch.no_grad():
        full = nats(0, t, 1)
        # L = 8, stride = 3: windows end at 8, 11, 14, ...; each scores the targets since the previous end
        manual, end = nats(0, 8, 1), 8
        while end < t:
            new_end = min(end + 3, t)
            manual += nats(new_end - 8, new_end, end)
            end = new_end
    one_window = bits_per_byte(model, tok, text, max_seq_len=None)
    windowed = bits_per_byte(model, tok, text, max_seq_len=8, stride=3, batch_size=4)
    assert one_window["nats"] == pytest.approx(full, rel=1e-5)
    assert windowed["nats"] == pytest.approx(manual, rel=1e-5)
    assert windowed["bits_per_byte"] == pytest.approx(manual / (math.log(2) * len(text.encode())), rel=1e-5)
    assert windowed["nats"] != pytest.approx(full, rel=1e-3)  # the windows really cut the context


def test_context_free_model_is_stride_independent(tok):
    torch.manual_seed(0)
    model = TableLM(torch.randn(len(tok), len(tok)) * 3)
    results = [bits_per_byte(model, tok, TEXT, max_seq_len=m, stride=s)["nats"] for m, s in ((None, None), (12, 11), (6, 2))]
    assert results[1] == pytest.approx(results[0], rel=1e-6) and results[2] == pytest.approx(results[0], rel=1e-6)


def test_documents_each_start_with_bos(tok, tmp_path):
    path = tmp_path / "stories.txt.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        f.write("First story.\n<|endoftext|>\n\n<|endoftext|>\nSecond story, longer.\n<|endoftext|>\n")
    docs = read_documents(str(path), separator="<|endoftext|>")
    assert docs == ["First story.", "Second story, longer."]
    assert read_documents(str(path), max_chars=5) == ["First"]
    torch.manual_seed(1)
    model = TableLM(torch.randn(len(tok), len(tok)) * 3)
    out = bits_per_byte(model, tok, docs)
    n_tokens = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs)
    assert out["num_documents"] == 2 and out["num_windows"] == 2
    assert out["num_tokens"] == n_tokens and out["num_bytes"] == len("First story.") + len("Second story, longer.")
    # documents are scored independently, each first token predicted from the BOS
    separate = sum(bits_per_byte(model, tok, d)["nats"] for d in docs)
    assert out["nats"] == pytest.approx(separate, rel=1e-6)
    bos_row = torch.log_softmax(model.table[tok.bos_token_id], -1)
    first = [tok(d, add_special_tokens=False)["input_ids"][0] for d in docs]
    rest = out["nats"] + sum(bos_row[i].item() for i in first)
    with torch.no_grad():
        for d in docs:
            ids = tok(d, add_special_tokens=False)["input_ids"]
            rest -= sum(-torch.log_softmax(model.table[a], -1)[b].item() for a, b in zip(ids, ids[1:]))
    assert rest == pytest.approx(0, abs=1e-4)
    with pytest.raises(ValueError, match="BOS"):
        bits_per_byte(model, tok, docs, bos="none")


def test_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import eval_bpb

    model_dir = save_tiny_llama(str(tmp_path / "model"), max_position_embeddings=32)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    output = tmp_path / "bpb.json"
    eval_bpb.main(["--model", model_dir, "--text", str(text), "--device", "cpu", "--dtype", "float32",
                   "--stride", "10", "--output", str(output)])
    out = json.loads(output.read_text())
    assert out["max_seq_len"] == 32 and out["stride"] == 10 and out["num_bytes"] == len((TEXT * 3).encode())
    assert out["num_windows"] > 1
    assert out["bits_per_byte"] == pytest.approx(out["nats"] / (math.log(2) * out["num_bytes"]))
    assert f"{out['bits_per_byte']:.4f}" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    direct = bits_per_byte(AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir),
                           TEXT * 3, stride=10)
    assert direct["nats"] == pytest.approx(out["nats"], rel=1e-5)
