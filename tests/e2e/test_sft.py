"""`rlkit sft` on the tiny model, for real: Ray actors, DeepSpeed on gloo, peft, bitsandbytes."""

from __future__ import annotations

import pytest
import torch

from rlkit import stages
from rlkit.sft.run import run_sft
from tests.helpers import ROOT, eval_losses, sft_overrides

pytestmark = pytest.mark.slow
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"


def _run(tiny_model, task_data, out, *extra):
    cfg = stages.load("sft", RECIPE, sft_overrides(tiny_model, task_data, out, *extra))
    return run_sft(cfg), out


def _generate(model_dir, prompt="### 指令:\n计算\n\n### 输入:\n3+4=\n\n### 回答:\n"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    return tok.decode(out[0, ids.input_ids.shape[1]:])


def test_full_sft_learns_and_output_loads(ray_module, tiny_model, task_data, task_containers, tmp_path):
    """Trained from the CSV copy of the task, evaluated on its Arrow copy (the same rows as the JSONL:
    tests/data/test_containers.py)."""
    final, out = _run(tiny_model, task_data, tmp_path / "full", "train.max_steps=60", "eval.every=30",
                      "checkpoint.every=30", f"data.train={task_containers['csv']['sft_train']}",
                      f"data.eval={task_containers['arrow']['sft_eval']}")
    losses = eval_losses(out)
    assert losses[-1] < 0.5 * losses[0], f"eval loss did not fall enough: {losses}"
    assert (final / "model.safetensors").exists() and (final / "tokenizer.json").exists()
    assert isinstance(_generate(final), str)
    _exports_match_final(out, final, tmp_path / "exports")
    # final/ ships the template trained: a chat API on it renders the training prompt, token for token
    import json

    from transformers import AutoTokenizer

    from rlkit.data.collate import encode_sft
    from rlkit.data.templates import render_prompt, served_messages

    served = AutoTokenizer.from_pretrained(final)
    row = {"system": "", "history": [], **json.loads(task_data["sft_eval"].read_text().splitlines()[0])}
    messages = served_messages(row)
    assert served.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        render_prompt(row, "alpaca")
    trained = encode_sft(row, AutoTokenizer.from_pretrained(tiny_model), "alpaca", 512)
    ids = served.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    first_target = next(i for i, label in enumerate(trained["labels"]) if label != -100)
    assert list(ids) == trained["input_ids"][:first_target]


@pytest.mark.parametrize("mode", ["lora", "qlora"])
def test_adapter_sft_learns_and_merges(ray_module, tiny_model, task_data, tmp_path, mode):
    extra = [f"finetuning={mode}", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0",
             "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
             "train.max_steps=40", "eval.every=20", "optim.lr=1e-2", "checkpoint.every=40"]
    if mode == "qlora":
        extra += ["qlora.compute_dtype=fp32", "eval.every=10"]  # evals between steps: the bnb CPU trap
    final, out = _run(tiny_model, task_data, tmp_path / mode, *extra)
    losses = eval_losses(out)
    assert losses[-1] < 0.85 * losses[0], f"{mode}: eval loss did not fall: {losses}"
    assert (final / "adapter" / "adapter_config.json").exists()
    for name, (got, want, bound) in _merge_against_float64(tiny_model, final).items():
        err = (got - want).abs()
        assert bool((err <= bound).all()), f"{name}: merged weight off by {float(err.max()):.3g} (> fp32 rounding)"
    adapted, merged = _logits_float64(tiny_model, final)
    assert torch.allclose(adapted, merged, atol=1e-4), float((adapted - merged).abs().max())
    _exports_match_final(out, final, tmp_path / "exports")


def _exports_match_final(run_dir, final, work):
    """`rlkit export` of every checkpoint of the run: the one the final model was saved from gives
    the same weights (and adapter), bit for bit; another one does not."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlkit.commands.export import export_checkpoint

    def weights(model_dir):
        files = ["model.safetensors"] + (["adapter/adapter_model.safetensors"] if (final / "adapter").exists() else [])
        return [load_file(model_dir / f) for f in files]

    want, same = weights(final), []
    for ckpt in sorted((run_dir / "checkpoints").glob("step-*")):
        got = weights(export_checkpoint(ckpt, work / ckpt.name))
        assert [set(g) for g in got] == [set(w) for w in want]
        assert AutoTokenizer.from_pretrained(work / ckpt.name).chat_template == \
            AutoTokenizer.from_pretrained(final).chat_template  # the template trained, as in final/
        same.append(all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w))
    assert same and sum(same) == 1, same


def _logits_float64(base_dir, final, ids=((5, 6, 7, 8, 9),)):
    """Logits of the adapter on its base and of the saved merged model, both computed in float64: the
    check the test always made (atol 1e-4), without fp32 matmul rounding, which differs between CPUs
    and which the trained tiny model amplifies (on one EPYC host fp32 logits differed by 8.7e-4)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64),
                                        final / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64)
    x = torch.tensor(ids)
    with torch.no_grad():
        return adapted(x).logits, merged(x).logits


def _merge_against_float64(base_dir, final):
    """Per weight of the merged model: (saved value, W + s*B@A computed in float64 from the saved base and
    adapter, the largest error an fp32 merge can make). The bound is the fp32 rounding of B@A (r terms),
    of the scaling and of the sum: u * ((r + 2) * s * |B|@|A| + |W| + |W + s*B@A|), u = 2**-24.

    The merge is checked on the weights because a logit comparison is not exact for these models: after
    a high-lr LoRA run the tiny model turns weight noise of half an fp32 ulp into ~3e-5 of logit (measured),
    so two correct fp32 merges can differ by more than any fixed logit tolerance on another CPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64),
                                           final / "adapter")
    slack = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            rank, scale = a.shape[0], module.scaling["default"]
            key = name.removeprefix("base_model.model.") + ".weight"
            slack[key] = (rank + 2) * scale * (b.abs() @ a.abs()) + module.base_layer.weight.abs()
    want = {k: v.detach() for k, v in peft_model.merge_and_unload().state_dict().items()}
    got = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64).state_dict()
    assert set(got) == set(want) and set(slack) <= set(want) and len(slack) == 7 * 2  # 7 modules x 2 layers
    u = 2.0**-24
    return {k: (got[k], want[k], u * (slack[k] + want[k].abs()) if k in slack else torch.zeros_like(want[k]))
            for k in want}


@pytest.mark.parametrize("stage", [2, 3])
def test_two_learners_zero(ray_module, tiny_model, task_data, tmp_path, stage):
    """ZeRO-2 from the recipe; ZeRO-3 from a user's ds_config.json in seed 002's shape ("auto"
    batch sizes, precision and clipping; the stage and its tuning keys from the file)."""
    zero = [f"deepspeed.zero_stage={stage}"]
    if stage == 3:
        import json

        from tests.helpers import SEED_002
        (tmp_path / "ds_config.json").write_text(json.dumps(SEED_002))
        zero = [f"deepspeed.config={tmp_path / 'ds_config.json'}", "deepspeed.zero_stage=null"]
    final, out = _run(tiny_model, task_data, tmp_path / f"z{stage}", "train.num_learners=2", *zero,
                      "train.micro_batch_size=8", "train.max_steps=40", "eval.every=20", "checkpoint.every=40")
    losses = eval_losses(out)
    assert losses[-1] < 0.6 * losses[0], f"zero{stage}: {losses}"
    assert isinstance(_generate(final), str)
    _exports_match_final(out, final, tmp_path / "exports")  # ZeRO shards of two ranks, gathered


def test_a_checkpoint_whose_optimizer_state_this_run_cannot_read_is_one_line(ray_module, tiny_model, task_data,
                                                                               tmp_path):
    """The optimizer state of a checkpoint in another layout (ZeRO-0 fp32 keeps it in the model states,
    ZeRO-1 one file per rank), or partitioned over another rank count, resumed anyway
    (`checkpoint.force_resume`): one line naming the checkpoint and how to start from its weights, not
    DeepSpeed's FileNotFoundError or a partition that does not fit."""
    from rlkit.errors import UserError

    common = ["train.max_steps=2", "checkpoint.every=2", "eval.every=0", "checkpoint.keep_last=1"]
    _run(tiny_model, task_data, tmp_path / "z0", *common, "deepspeed.zero_stage=0")
    assert not list((tmp_path / "z0" / "checkpoints" / "step-2" / "engine").glob("*optim_states.pt"))
    with pytest.raises(UserError, match=r"^checkpoint.resume: \S+step-2 has no zero_pp_rank_0_mp_rank_00_optim_"
                                        r"states.pt: its optimizer state is in another layout .* start from its "
                                        r"weights alone: rlkit export \S+step-2 --out DIR, then model.path=DIR "
                                        r"checkpoint.resume=never$"):
        _run(tiny_model, task_data, tmp_path / "z0", *common, "train.max_steps=4", "deepspeed.zero_stage=1",
             "checkpoint.force_resume=true")
    _run(tiny_model, task_data, tmp_path / "two", *common, "deepspeed.zero_stage=1", "train.num_learners=2")
    with pytest.raises(UserError, match=r"^checkpoint.resume: \S+step-2 holds the optimizer state of 2 learners "
                                        r"\(.*\), this run has 1: resume with 2, or start from its weights alone"):
        _run(tiny_model, task_data, tmp_path / "two", *common, "train.max_steps=4", "deepspeed.zero_stage=1",
             "train.num_learners=1", "checkpoint.force_resume=true")
