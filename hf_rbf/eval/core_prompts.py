"""Prompts of the CORE tasks, as nanochat's ``core_eval`` builds them, and the token spans that get scored.

Text layout (``D`` = the task's continuation delimiter, shots separated by a blank line, the example last):

- multiple_choice, one prompt per choice:   ``shot.query D shot.choices[shot.gold] \\n\\n ... query D choice``
- schema, one prompt per context option:    ``shot.options[shot.gold] D shot.continuation \\n\\n ... option D continuation``
- language_modeling, one prompt:            ``strip(shot.context) D shot.continuation \\n\\n ... strip(context) D`` is the
  prompt *without* the answer (then stripped of surrounding whitespace), the same plus ``continuation`` the prompt
  *with* it.

Shots: ``random.Random(1234 + idx).sample([every index but idx], k)`` over the (shuffled, capped) task data.

Token spans: every prompt is encoded without special tokens and a BOS id is prepended.  The scored tokens are
``tokens[start:end]`` (each predicted from the position before it):

- multiple_choice: from the end of the longest common token prefix of all choices' prompts to the end;
- schema: the longest common token suffix of all options' prompts;
- language_modeling: the tokens that the prompt with the answer adds to the prompt without it.

Prompts longer than the model's context keep their right-most ``max_len`` tokens (the BOS and the oldest shots go
first); the span moves with them and must keep a token before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

# nanochat draws example idx's shots with random.Random(FEWSHOT_SEED + idx).
FEWSHOT_SEED = 1234

Encoder = Callable[[list[str]], list[list[int]]]


@dataclass
class ScoredSequence:
    """A token sequence whose targets ``tokens[start:end]`` are scored (each from the logits at the position before).

    ``cropped``: how many tokens were dropped from the left to fit the context (0 when none).
    """

    tokens: list[int]
    start: int
    end: int
    cropped: int = 0


def draw_fewshot(data: Sequence[dict], idx: int, num_fewshot: int) -> list[dict]:
    """The ``num_fewshot`` shots of example ``idx``: a seeded draw from the other examples (nanochat's rule)."""
    if num_fewshot <= 0:
        return []
    if num_fewshot > len(data) - 1:
        raise ValueError(
            f"num_fewshot={num_fewshot} needs at least {num_fewshot + 1} examples in the task but it has {len(data)}; "
            "raise max_per_task (shots are drawn from the capped data, as in nanochat)"
        )
    rng = random.Random(FEWSHOT_SEED + idx)
    others = [i for i in range(len(data)) if i != idx]
    return [data[i] for i in rng.sample(others, num_fewshot)]


def render_multiple_choice(item: dict, delimiter: str, fewshot: Sequence[dict] = ()) -> list[str]:
    """One prompt per choice; the shots show their gold choice."""
    shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_schema(item: dict, delimiter: str, fewshot: Sequence[dict] = ()) -> list[str]:
    """One prompt per context option, all ending in the shared continuation; the shots show their gold option."""
    shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    return [f"{shots}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]


def render_language_modeling(item: dict, delimiter: str, fewshot: Sequence[dict] = ()) -> tuple[str, str]:
    """``(prompt_without, prompt_with)``: contexts are stripped, and the prompt without the answer is stripped too.

    The second strip matters: a trailing space (the delimiter) would merge into the answer's first token, and the
    answerless prompt would no longer be a token prefix of the full one.
    """
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    head = f"{shots}{item['context'].strip()}{delimiter}"
    return head.strip(), head + item["continuation"]


def render_example(task_type: str, item: dict, delimiter: str, fewshot: Sequence[dict] = ()) -> list[str]:
    """The prompts of one example (two for language_modeling: without and with the answer)."""
    if task_type == "multiple_choice":
        return render_multiple_choice(item, delimiter, fewshot)
    if task_type == "schema":
        return render_schema(item, delimiter, fewshot)
    if task_type == "language_modeling":
        return list(render_language_modeling(item, delimiter, fewshot))
    raise ValueError(f"task_type={task_type!r}: allowed values are multiple_choice, schema, language_modeling")


def common_length(sequences: Sequence[Sequence[int]], from_end: bool = False) -> int:
    """Length of the longest common prefix (or suffix with ``from_end``) of the sequences."""
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        pos = -1 - i if from_end else i
        first = sequences[0][pos]
        if any(s[pos] != first for s in sequences[1:]):
            return i
    return shortest


def hf_encoder(tokenizer) -> Encoder:
    """An :data:`Encoder` for a ``transformers`` tokenizer: token ids of each text, no special tokens added."""

    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    return encode


def build_sequences(
    task_type: str, prompts: list[str], encode: Encoder, bos_id: int | None
) -> tuple[list[ScoredSequence], bool]:
    """Encode one example's prompts and mark the scored spans (see the module docstring).

    Returns ``(sequences, boundary_fallback)``.  For language_modeling the answerless prompt's tokens should be a
    prefix of the full prompt's; when a tokenizer merges across that boundary (nanochat stops with an assertion),
    the answer text is encoded on its own and appended instead, and ``boundary_fallback`` is True so that callers
    can count it.
    """
    prefix = [] if bos_id is None else [bos_id]
    encoded = [prefix + ids for ids in encode(prompts)]
    fallback = False
    if task_type == "multiple_choice":
        start = common_length(encoded)
        sequences = [ScoredSequence(t, start, len(t)) for t in encoded]
    elif task_type == "schema":
        suffix = common_length(encoded, from_end=True)
        sequences = [ScoredSequence(t, len(t) - suffix, len(t)) for t in encoded]
    elif task_type == "language_modeling":
        without, with_answer = encoded
        if with_answer[: len(without)] != without or len(with_answer) <= len(without):
            fallback = True
            answer_text = prompts[1][len(prompts[0]):] if prompts[1].startswith(prompts[0]) else None
            if answer_text is None:
                raise ValueError("language_modeling prompts: the prompt with the answer must extend the one without it")
            with_answer = without + encode([answer_text])[0]
        if len(with_answer) <= len(without):
            raise ValueError(f"language_modeling example with an empty answer: {prompts[1][-80:]!r}")
        sequences = [ScoredSequence(with_answer, len(without), len(with_answer))]
    else:
        raise ValueError(f"task_type={task_type!r}: allowed values are multiple_choice, schema, language_modeling")
    for s in sequences:
        if s.start < 1:
            # Only possible without a BOS: the first token has nothing to be predicted from.
            raise ValueError("a scored span starts at the first token; use a BOS token (bos='auto' or an id)")
    return sequences, fallback


def crop_left(seq: ScoredSequence, max_len: int | None) -> ScoredSequence:
    """Keep the right-most ``max_len`` tokens and shift the span; the span and one token before it must survive."""
    if max_len is None or len(seq.tokens) <= max_len:
        return seq
    drop = len(seq.tokens) - max_len
    if seq.start - drop < 1:
        raise ValueError(
            f"the scored span ({seq.end - seq.start} tokens) does not fit a context of max_len={max_len} tokens "
            "together with one token before it"
        )
    return ScoredSequence(seq.tokens[drop:], seq.start - drop, seq.end - drop, cropped=drop)
