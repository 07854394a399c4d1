"""The other multiple-choice tasks and metrics: prompts as lm-evaluation-harness defines them, acc_norm, the
batched path against the definition, next-token KL, and the CLI on fixture files in the tasks' Hub schemas."""
import json
import math

import pytest
import torch
from helpers import cais_file, write_rows
from tiny import run_cli, save_tiny, tiny_model

from prune_heads.data.mmlu import load_mmlu
from prune_heads.data.tasks import TASKS, Question, load_task
from prune_heads.errors import UserError
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.passes import task_loglik, task_loglik_many, task_loglik_reference
from prune_heads.eval.results import EvalResult, answer_kl
from prune_heads.eval.textkl import next_token_damage
from prune_heads.heads import HeadSet
from prune_heads.plan.ablation import ablate

# --- prompts, written by hand from lm-evaluation-harness's task definitions -----------------------------------------


def requests(task, data, i=0):
    subject = data.subjects[0]
    return TASKS[task].requests(subject, subject.questions[i])


def test_mmlu_cloze_prompt_matches_lm_eval(tmp_path):
    # tasks/mmlu/continuation: description "The following are questions (with answers) about {subject}.\n\n",
    # doc_to_text "Question: {{question.strip()}}\nAnswer:", doc_to_choice "{{choices}}", target delimiter " ", 0-shot.
    data = load_mmlu(str(cais_file(tmp_path)), task="mmlu-cloze")
    q = data.subjects[0].questions[0]
    assert data.task == "mmlu-cloze" and q.norm_lengths == (5.0, 7.0, 5.0, 6.0)
    assert requests("mmlu-cloze", data) == [
        ("The following are questions (with answers) about subject 0.\n\nQuestion: Which answer is right for item 5 of "
         "set 0? The quick brown fox.\nAnswer:", " " + c) for c in ["Femur", "Humerus", "Tibia", "Fibula"]]
    # Same split as the letter task, so the two compare question by question.
    letters = load_mmlu(str(cais_file(tmp_path)))
    assert [x.index for x in letters.questions] == [x.index for x in data.questions]
    assert letters.questions[0].norm_lengths is None


def test_arc_prompt_labels_and_skipped_rows(tmp_path):
    data = load_task("arc_easy", str(write_rows(tmp_path, "arc_easy")))
    assert data.skipped_rows == 1 and [q.gold for q in data.questions] == [1, 2, 4]
    assert [len(q.choices) for q in data.questions] == [4, 3, 5]
    # arc_easy.yaml: doc_to_text "Question: {{question}}\nAnswer:", doc_to_choice "{{choices.text}}"
    assert requests("arc_easy", data) == [("Question: Which part of the arm is a bone?\nAnswer:", " " + c)
                                          for c in ["Femur", "Humerus", "Tibia", "Fibula"]]


def test_hellaswag_preprocessing_matches_lm_eval(tmp_path):
    data = load_task("hellaswag", str(write_rows(tmp_path, "hellaswag")))
    assert data.skipped_rows == 1 and [q.gold for q in data.questions] == [3, 0]
    # utils.process_docs: query = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())
    assert requests("hellaswag", data)[3] == (
        "Removing ice from car: Then, the man writes over the snow covering the window of a car, and a woman wearing "
        "winter clothes smiles. Then", " , the man continues removing the snow on his car.")
    # preprocess: " [title]" -> ". ", other [..] removed, double spaces squeezed
    second = requests("hellaswag", data, 1)
    assert second[0] == ("Baking cookies: A woman is in a kitchen.. She mixes flour. She", " bakes the dough in the oven.")


def test_piqa_and_winogrande_prompts(tmp_path):
    piqa = load_task("piqa", str(write_rows(tmp_path, "piqa")))
    assert piqa.skipped_rows == 1
    assert requests("piqa", piqa, 1) == [("Question: To open a jar\nAnswer:", " twist the lid."),
                                         ("Question: To open a jar\nAnswer:", " push the lid.")]
    wino = load_task("winogrande", str(write_rows(tmp_path, "winogrande")))
    assert wino.skipped_rows == 1 and wino.questions[0].norm_lengths is None  # winogrande reports acc
    # Partial evaluation: the option fills the blank in the context; the rest of the sentence is the continuation.
    assert requests("winogrande", wino) == [
        ("Sarah was a much better surgeon than Maria so Sarah", " always got the harder cases."),
        ("Sarah was a much better surgeon than Maria so Maria", " always got the harder cases.")]
    assert TASKS["winogrande"].gold_text(wino.questions[1]) == "The trophy does not fit in the suitcase because the trophy is too big."


def test_missing_or_malformed_task_data_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="needs its questions: pass `task_data`"):
        load_task("piqa", None)
    with pytest.raises(UserError, match="does not exist"):
        load_task("piqa", str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"goal": "x"}) + "\n")
    with pytest.raises(UserError, match="no usable piqa rows; expected the ybisk/piqa"):
        load_task("piqa", str(bad))


# --- metrics by hand -------------------------------------------------------------------------------------------


def test_acc_norm_divides_by_choice_characters():
    # choice lengths 1 and 10: loglik -2 vs -5 -> acc picks 0, acc_norm picks 1 (-2/1 < -5/10)
    q = Question("piqa", 0, "g", ("a", "abcdefghij"), 1, (1.0, 10.0))
    res = EvalResult([q], torch.tensor([[-2.0, -5.0]], dtype=torch.float64))
    assert int(res.pred[0]) == 1 and res.accuracy == 1.0
    raw = EvalResult([Question("piqa", 0, "g", ("a", "abcdefghij"), 1)], res.loglik)
    assert int(raw.pred[0]) == 0


def test_answer_kl_over_questions_with_different_numbers_of_choices():
    qs = [Question("arc", 0, "q", ("a", "b", "c"), 0), Question("arc", 1, "q", ("a", "b", "c", "d"), 0)]
    inf = float("-inf")
    base = EvalResult(qs, torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25), inf],
                                        [math.log(0.25)] * 4], dtype=torch.float64))
    abl = EvalResult(qs, torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.25), inf],
                                       [math.log(0.25)] * 4], dtype=torch.float64))
    kl = answer_kl(abl, base)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5)) and kl[1].item() == 0.0
    assert torch.equal(answer_kl(base, base), torch.zeros(2, dtype=torch.float64))


# --- the batched path against the definition --------------------------------------------------------------------


@pytest.mark.parametrize("family,task", [("llama", "arc_easy"), ("qwen2", "winogrande"), ("gemma2", "hellaswag"),
                                         ("olmo2", "piqa")])
def test_batched_path_equals_reference_on_multi_token_tasks(tmp_path, family, task):
    lm = tiny_model(family)
    enc = encode_task(lm, load_task(task, str(write_rows(tmp_path, task))))
    assert not any(it.fast for it in enc.items)
    assert any(len(c) > 1 for it in enc.items for c in it.continuations)
    if task == "winogrande":
        assert all(it.contexts and it.contexts[0] != it.contexts[1] for it in enc.items)
    for heads in (None, HeadSet.of({0: [1, 2], 2: [5]})):
        fast = task_loglik(lm, enc, heads, batch_size=3, progress=False)
        ref = task_loglik_reference(lm, enc, heads)
        assert torch.equal(fast.pred, ref.pred)
        assert torch.allclose(fast.loglik, ref.loglik, atol=1e-4)  # -inf pads match too (3- and 5-choice ARC)


def test_mmlu_cloze_batched_many_sets_and_dynamic_masks_equal_reference(tmp_path):
    lm = tiny_model("llama")
    enc = encode_task(lm, load_mmlu(str(cais_file(tmp_path, per_subject=7)), task="mmlu-cloze"))
    sets = [HeadSet(), HeadSet.of({1: [0, 3]})]
    for hs, res in zip(sets, task_loglik_many(lm, enc, sets, batch_size=4, progress=False)):
        ref = task_loglik_reference(lm, enc, hs)
        assert torch.allclose(res.loglik, ref.loglik, atol=1e-4)
    masks = torch.ones(len(enc), 4, 6)
    for i in range(len(enc)):
        masks[i, i % 4, (2 * i) % 6] = 0
    assert torch.allclose(task_loglik(lm, enc, masks, batch_size=5, progress=False).loglik,
                          task_loglik_reference(lm, enc, masks).loglik, atol=1e-4)


# --- next-token KL -----------------------------------------------------------------------------------------------


def test_next_token_damage_by_hand_and_none_against_itself():
    lm = tiny_model("qwen3")
    seqs = [[5, 9, 33, 7, 100, 4], [8, 8, 300], [1, 2]]
    heads = HeadSet.of({0: [0, 4], 3: [1]})
    damage = next_token_damage(lm, seqs, heads, batch_size=2)
    scored = next_token_damage(lm, seqs, heads, batch_size=2, scored=[3, 1, 1])
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        p = torch.log_softmax(lm.model(input_ids=ids).logits.double(), -1)[0]
        with ablate(lm, heads):
            q = torch.log_softmax(lm.model(input_ids=ids).logits.double(), -1)[0]
        kl, agree = (p.exp() * (p - q)).sum(-1), (p.argmax(-1) == q.argmax(-1)).double()
        assert damage.kl[i].item() == pytest.approx(kl.mean().item(), rel=1e-4, abs=1e-7)
        assert damage.agreement[i].item() == pytest.approx(agree.mean().item())
        assert damage.same[i].item() == float(bool(agree.all()))
        n = [3, 1, 1][i]  # the last n tokens, predicted at positions len-1-n .. len-2
        assert scored.kl[i].item() == pytest.approx(kl[len(s) - 1 - n:len(s) - 1].mean().item(), rel=1e-4, abs=1e-7)
        assert scored.agreement[i].item() == pytest.approx(agree[len(s) - 1 - n:len(s) - 1].mean().item())
    assert damage.kl.min() > 0 and damage.agreement.min() < 1
    none = next_token_damage(lm, seqs, HeadSet(), batch_size=2)
    assert torch.allclose(none.kl, torch.zeros(3, dtype=torch.float64)) and none.same.tolist() == [1.0] * 3


# --- CLI on fixture files ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")



def test_eval_on_piqa_with_ablation_reports_kl_and_agreement(model_dir, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [1], "1": [0, 3]}))
    kl_text = tmp_path / "held_out.txt"
    kl_text.write_text("The quick brown fox jumps over the lazy dog.\nAttention heads that do not matter can go.\n")
    code, _, err = run_cli(["eval", "--model", model_dir, "--task", "piqa", "--task-data", write_rows(tmp_path, "piqa"),
                            "--ablate", heads, "--kl-text", kl_text, "--out", tmp_path / "ev", "--no-progress"], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "ev" / "piqa.jsonl").read_text().splitlines()]
    assert summary["task"] == "piqa" and summary["metric"] == "acc_norm" and len(rows) == 2
    assert summary["accuracy"]["chance"] == 0.5 and len(rows[0]["loglik"]) == 2
    assert summary["kl_answer_nats"] >= 0 and 0 <= summary["agreement"] <= 1 and summary["kl_text"]["kl_text_nats"] > 0


def test_main_command_with_a_next_token_kl_budget_and_contradictions(model_dir, tmp_path, capsys):
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=12)
    out = tmp_path / "run"
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--mmlu-per-subject", "3", "--metric", "kl-text",
                            "--budget", "0.05nat", "--calibration-size", "4", "--no-export", "--no-progress",
                            "--out", out], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["budget"]["metric"] == "kl-text" and report["task"]["kl_text"]["texts"] == 8  # 2 x (12-5-3) held out
    assert all("kl_text_nats" in p for p in report["search_points"])
    assert all(p["within_budget"] == (p["kl_text_nats"] <= 0.05) for p in report["search_points"])
    code, _, err = run_cli(["--model", model_dir, "--metric", "mmlu-cloze", "--task", "piqa", "--out", tmp_path / "x"], capsys)
    assert code == 2 and "--metric mmlu-cloze is the accuracy on the mmlu-cloze task, but --task is piqa" in err
    code, _, err = run_cli(["--model", model_dir, "--task", "hellaswag", "--out", tmp_path / "y"], capsys)
    assert code == 2 and "--task hellaswag needs its questions: pass --task-data FILE" in err
