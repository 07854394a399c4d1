"""Batched greedy generation (``eval.generation``): a batch with a shared prefix, padding between it and each prompt's
own tokens, a prefix kept for the next batch and rows leaving as they finish generates exactly what transformers'
``generate`` gives each prompt alone."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny import tiny_model

from prune_heads.eval.generation import GreedyRequest, common_prefix, greedy_batches, greedy_generate, shared_lengths
from prune_heads.heads import HeadSet
from prune_heads.io.parallel import Ranks
from prune_heads.plan.ablation import ablate

NEW = 12


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = [torch.randint(5, 250, (30,), generator=g).tolist(), torch.randint(5, 250, (20,), generator=g).tolist()]
    return [shared[i % 2] + torch.randint(5, 250, (3 + i % 7,), generator=g).tolist() for i in range(12)]


def _alone(lm, prompt: list[int], eos: int | None) -> list[int]:
    out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                            pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_batch_generates_what_each_prompt_generates_alone(family):
    lm = tiny_model(family)
    prompts = _prompts()
    free = [_alone(lm, p, None) for p in prompts]
    # an end-of-sequence token the prompts reach at different steps, so rows leave their batch one by one
    eos = Counter(t for f in free for t in f[1:-1]).most_common(1)[0][0]
    assert len({f.index(eos) for f in free if eos in f}) > 1
    want = [_alone(lm, p, eos) for p in prompts]
    request = GreedyRequest(NEW, (), frozenset([eos]))
    for batch_size in (1, 3, 4, 12):  # 3: the second batch of each prefix reuses its cache
        assert greedy_generate(lm, prompts, request, batch_size) == want, batch_size


def test_the_ablation_is_applied_to_every_generated_token_and_stop_sequences_end_a_row():
    lm = tiny_model("llama")
    prompts = _prompts()
    heads = HeadSet.of({0: [0, 1], 2: [3]})
    with ablate(lm, heads):
        want = [_alone(lm, p, None) for p in prompts]
        got = greedy_generate(lm, prompts, GreedyRequest(NEW, (), frozenset()), 4)
    assert got == want
    assert got != greedy_generate(lm, prompts, GreedyRequest(NEW, (), frozenset()), 4)
    # a stop sequence ends a row at the token whose text completes it
    stop = lm.tokenizer.decode(want[0][3:5], skip_special_tokens=False)
    with ablate(lm, heads):
        stopped = greedy_generate(lm, prompts, GreedyRequest(NEW, (stop,), frozenset()), 4)
    ends = next(n for n in range(1, NEW + 1) if stop in lm.tokenizer.decode(want[0][:n], skip_special_tokens=False))
    assert stopped[0] == want[0][:ends] and ends < NEW


def test_ranks_dealt_the_batches_generate_what_one_process_does():
    """Under torchrun each rank runs its deal of the very batches one process would (the shared prefix of a batch is
    fixed by the batches, not by which batch ran before), so the tokens are the same, bit for bit."""
    lm = tiny_model("llama")
    prompts, request = _prompts(), GreedyRequest(NEW, (), frozenset())
    one = dict(pair for chunk, gen in greedy_batches(lm, prompts, request, 3) for pair in zip(chunk, gen))
    dealt = {}
    for rank in (0, 1):
        for chunk, gen in greedy_batches(lm, prompts, request, 3, Ranks(rank, 2)):
            dealt.update(zip(chunk, gen))
    assert dealt == one and len(one) == len(prompts)
    batches = [[0, 2, 4], [6, 8, 10], [1, 3, 5], [7, 9, 11]]  # sorted order: the two prefixes' prompts side by side
    assert shared_lengths(prompts, batches) == [30, 30, 20, 20]


def test_common_prefix_leaves_each_row_a_token_of_its_own():
    assert common_prefix([[1, 2, 3], [1, 2, 4]]) == 2
    assert common_prefix([[1, 2], [1, 2, 3]]) == 1
    assert common_prefix([[5, 6], [7, 8]]) == 0
