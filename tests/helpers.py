"""Helpers the tests share: data files in the schemas prune-heads reads, fixed inputs, snapshots of directories, a
LoRA adapter, the CLI in a subprocess, a disk filled up. Tiny models of every family are in ``tiny.py``; the fixtures
every test file may ask for (``small_disk``) in ``conftest.py``. No test imports another test file."""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
import sys

import torch

from prune_heads.heads import HeadSet

MiB = 1 << 20


# -- data files ----------------------------------------------------------------------------------------------------------


def cais_file(tmp_path, n_subjects=2, per_subject=8, bad=True):
    """An MMLU file in the cais/mmlu schema: ``n_subjects`` x ``per_subject`` rows (and, with ``bad``, two broken
    rows the loader must skip)."""
    rows = []
    for s in range(n_subjects):
        for i in range(per_subject):
            rows.append({"question": f"Which answer is right for item {i} of set {s}? The quick brown fox.",
                         "subject": f"subject_{s}", "choices": ["Femur", "Humerus", "Tibia", "Fibula"], "answer": (i + s) % 4})
    if bad:
        rows.insert(3, {"question": "broken", "subject": "subject_0", "choices": ["a", "b", "c", "d"], "answer": 7})
        rows.insert(4, {"question": "no choices", "subject": "subject_0", "answer": 1})
    path = tmp_path / "mmlu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- task files in the Hub schemas -----------------------------------------------------------------------------

ARC = [
    {"id": "a1", "question": "Which part of the arm is a bone?", "answerKey": "B",
     "choices": {"text": ["Femur", "Humerus", "Tibia", "Fibula"], "label": ["A", "B", "C", "D"]}},
    {"id": "a2", "question": "What do plants need?", "answerKey": "3",
     "choices": {"text": ["Rocks", "Salt", "Light"], "label": ["1", "2", "3"]}},  # 3 choices, numeric labels
    {"id": "a3", "question": "Pick the fox.", "answerKey": "E",
     "choices": {"text": ["dog", "cat", "the quick brown fox", "lazy", "jumps"], "label": ["A", "B", "C", "D", "E"]}},
    {"id": "bad", "question": "No key", "answerKey": "Z", "choices": {"text": ["a", "b"], "label": ["A", "B"]}},
]
HELLASWAG = [
    {"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.",
     "ctx_b": "then", "ctx": "...", "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow as the we girls sled.", ", the man puts on a christmas coat, knitted with netting.", ", the man continues removing the snow on his car."],
     "source_id": "x", "split": "val", "split_type": "indomain", "label": "3"},
    {"ind": 9, "activity_label": "Baking cookies", "ctx_a": "A woman is in a kitchen. [title] She mixes flour.", "ctx_b": "she",
     "ctx": "...", "endings": ["bakes the  dough [step] in the oven.", "eats it.", "sings.", "leaves."],
     "source_id": "y", "split": "val", "split_type": "indomain", "label": "0"},
    {"ind": 10, "activity_label": "x", "ctx_a": "y", "ctx_b": "z", "ctx": "", "endings": ["a", "b", "c", "d"], "label": ""},
]
PIQA = [
    {"goal": "How do I ready a guinea pig cage for it's new occupants?", "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, you will also need to supply it with a water bottle and a food dish.", "sol2": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, you will also need to supply it with a water bottle and a food dish.", "label": 0},
    {"goal": "To open a jar", "sol1": "twist the lid.", "sol2": "push the lid.", "label": 0},
    {"goal": "unlabelled test row", "sol1": "a", "sol2": "b", "label": -1},
]
WINOGRANDE = [
    {"sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.", "option1": "Sarah",
     "option2": "Maria", "answer": "1"},
    {"sentence": "The trophy does not fit in the suitcase because the _ is too big.", "option1": "trophy",
     "option2": "suitcase", "answer": "1"},
    {"sentence": "no answer _ here", "option1": "a", "option2": "b", "answer": ""},
]
FIXTURES = {"arc_easy": ARC, "arc_challenge": ARC, "hellaswag": HELLASWAG, "piqa": PIQA, "winogrande": WINOGRANDE}


def write_rows(tmp_path, task):
    path = tmp_path / f"{task}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in FIXTURES[task]))
    return path


# -- fixed inputs and head sets of the tiny models ---------------------------------------------------------------------------


IDS = torch.tensor([[3, 17, 45, 99, 120, 7, 250, 33, 61, 5, 9, 11, 200, 201], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
# Layer 0: uneven groups (one head gone from group 0, two from group 1); layer 1: nothing removed;
# layer 2: every head of KV group 0; layer 3: every head of the layer.
UNEVEN = HeadSet.of({0: [0, 3, 4], 2: [0, 1, 2], 3: [0, 1, 2, 3, 4, 5]})
EVEN = HeadSet.of({0: [0, 3], 1: [1, 4], 2: [2, 5], 3: [0, 3]})  # one head per group in every layer: uniform (4, 2)


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


# -- files, processes, disks ------------------------------------------------------------------------------------------------


def snapshot(directory):
    """Every file under ``directory`` by relative path, with its sha256: equal snapshots, nothing changed."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def lora_adapter(lm, tmp_path, targets):
    """A peft LoRA adapter of ``lm`` on ``targets``, saved under ``tmp_path/adapter``, with weights that matter."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(lm.model)
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # make the adapter matter
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    d = tmp_path / "adapter"
    peft_model.save_pretrained(d)
    return d, peft_model


def cli_subprocess(args, env):
    """``prune-heads ARGS`` in a fresh Python with ``env`` (HF_ENDPOINT must be set before huggingface_hub loads)."""
    return subprocess.run([sys.executable, "-m", "prune_heads_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def fill(disk, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free (a file beside the run's, removed by ``free_up``)."""
    with open(disk / "filler", "ab") as f:
        missing = shutil.disk_usage(disk).free - leave
        while missing > 0:
            f.write(b"\0" * min(missing, 4 * MiB))
            missing = shutil.disk_usage(disk).free - leave


def free_up(disk) -> None:
    (disk / "filler").unlink()
