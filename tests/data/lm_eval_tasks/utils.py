"""Dataset loader for the local lm-evaluation-harness tasks (files resolved next to this file, no hub access)."""

import os

import datasets


HERE = os.path.dirname(os.path.abspath(__file__))
COPA = os.path.join(HERE, "..", "core_sample", "eval_data", "commonsense_reasoning", "copa.jsonl")


def load_core_sample_copa(**kwargs):
    """The 12 COPA rows of the CORE sample bundle as a DatasetDict with one split, "test"."""
    return datasets.load_dataset("json", data_files={"test": os.path.normpath(COPA)})
