"""The GRPO recipe type: cross-field rules, vocabularies taken from the code that reads them,
values checked under their own key."""

import pytest

from rlkit import stages
from rlkit.errors import ConfigError
from tests.helpers import GRPO_BASE


def test_grpo_cross_field_rules(tmp_path):
    base = ("stage: grpo\noutput_dir: o\nmodel: {path: m}\ndata: {train: t.jsonl}\n"
            "rewards: [{fn: 'rewards.exact:exact_match'}]\n")
    r = tmp_path / "g.yaml"
    r.write_text(base)
    assert stages.load("grpo", r).grpo.group_size == 8
    with pytest.raises(ConfigError, match="grpo.group_size: group-relative advantages need >= 2, got 1"):
        stages.load("grpo", r, ["grpo.group_size=1"])
    with pytest.raises(ConfigError, match="grpo.micro_batch_size: a mini-batch of 64 completions does not divide"):
        stages.load("grpo", r, ["grpo.micro_batch_size=5"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].fn: expected 'module.path:function'"):
        stages.load("grpo", r, ["rewards=[{fn: nocolon}]"])


def test_accepted_values_come_from_the_code_that_reads_them(tmp_path):
    """data.format from the loader, data.template from the templates, loss/KL from the loss, the
    advantage from its registry (a newly registered estimator is accepted at once)."""
    from rlkit.data.schema import ROW_FORMATS
    from rlkit.data.templates import TEMPLATES
    from rlkit.grpo.advantages import ADVANTAGES, register_advantage
    from rlkit.grpo.loss import KL_KINDS, LOSS_TYPES

    r = tmp_path / "g.yaml"
    r.write_text(GRPO_BASE)
    for fmt in ROW_FORMATS:
        assert stages.load("grpo", r, [f"data.format={fmt}"]).data.format == fmt
    for template in TEMPLATES:
        assert stages.load("grpo", r, [f"data.template={template}"]).data.template == template
    for loss in LOSS_TYPES:
        cap = ["grpo.epsilon_high=5"] if loss == "cispo" else []  # cispo's epsilon_high is its weight cap
        assert stages.load("grpo", r, [f"grpo.loss_type={loss}", *cap]).grpo.loss_type == loss
    for kl in KL_KINDS:
        assert stages.load("grpo", r, [f"grpo.kl={kl}"]).grpo.kl == kl
    with pytest.raises(ConfigError, match=r"data.format: expected one of 'auto' \| 'alpaca' \| 'messages' \| "
                                          r"'sharegpt', got 'dataset_info'"):
        stages.load("grpo", r, ["data.format=dataset_info"])
    with pytest.raises(ConfigError, match=r"grpo.advantage: unknown estimator 'gdpo' \(registered: .*\); "
                                          r"GDPO is `multi_objective_aggregation: normalize_then_sum`"):
        stages.load("grpo", r, ["grpo.advantage=gdpo"])
    for name in ("dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert stages.load("grpo", r, [f"grpo.advantage={name}"]).grpo.advantage == name
    with pytest.raises(ConfigError, match="unknown estimator 'my_adv'"):
        stages.load("grpo", r, ["grpo.advantage=my_adv"])
    register_advantage("my_adv")(lambda rewards, group_size, **kw: rewards - rewards.mean())
    try:
        assert stages.load("grpo", r, ["grpo.advantage=my_adv"]).grpo.advantage == "my_adv"
    finally:
        del ADVANTAGES["my_adv"]


@pytest.mark.parametrize("override, message", [
    ("grpo.mini_batches=0", "grpo.mini_batches: must be >= 1, got 0"),
    ("grpo.num_learners=0", "grpo.num_learners: must be >= 1, got 0"),
    ("grpo.micro_batch_size=0", "grpo.micro_batch_size: must be >= 1, got 0"),
    ("grpo.epsilon_high=-0.1", "grpo.epsilon_high: must be >= 0, got -0.1"),
    ("rewards=[{fn: 'a:b', weight: .nan}]", "rewards[0].weight: expected a finite number, got nan"),
    ("rewards=[{fn: 'a:b', on_error: {defualt: 0}}]", "rewards[0].on_error: expected {default: <number>}"),
    ("eval.every=-1", "eval.every: must be >= 0, got -1"),
    ("rollout.sync_timeout_s=-1", "rollout.sync_timeout_s: must be >= 0 (0 = no limit), got -1"),
    ("rollout.start_timeout_s=-5", "rollout.start_timeout_s: must be >= 0 (0 = no limit), got -5"),
    ("rollout.sync_check_every=-2", "rollout.sync_check_every: must be >= 0 (0 = off), got -2"),
    ("rollout.sync_check_tol=0", "rollout.sync_check_tol: must be > 0 nats, got 0"),
    ("rollout={calculator: true, tools: ['m:f']}",
     "rollout.calculator: the inline calculator runs its own rollout loop: not with tools, an environment or an "
     "interaction"),
    ("grpo.max_tokens_per_micro_batch=-1", "grpo.max_tokens_per_micro_batch: must be >= 0 (0 = off), got -1"),
    ("grpo.max_tokens_per_micro_batch=100",
     "grpo.max_tokens_per_micro_batch: must hold the longest sequence, rollout.max_model_len (1024), got 100"),
    ("rollout.lora_sync=adapter",
     "rollout.lora_sync: adapter sync sends a LoRA adapter: it needs finetuning: lora or qlora (use merged)"),
    ("grpo.streaming=true",
     "grpo.streaming: streamed groups train up to max_staleness versions after they started: set max_staleness >= 1"),
    ("grpo.max_interruptions=-1", "grpo.max_interruptions: must be >= 0 (or null), got -1"),
    ("grpo.max_running_groups=0", "grpo.max_running_groups: must be >= 1 (or null), got 0"),
    ("online_difficulty={keep: 0}", "online_difficulty.keep: must be in (0, 1] (1 = off), got 0"),
    ("online_difficulty={failed_at: 1, solved_at: 1}", "online_difficulty.failed_at: must be < solved_at (1), got 1"),
    ("curriculum.phases=[{until: 0.5, mix: [1, 0, 0]}, {until: 0.4, mix: [1, 0, 0]}]",
     "curriculum.phases[1].until: phase ends must increase within (0, 1], got 0.4 after 0.5"),
])
def test_grpo_values_are_checked_under_their_own_key(tmp_path, override, message):
    r = tmp_path / "g.yaml"
    r.write_text(GRPO_BASE)
    with pytest.raises(ConfigError) as e:
        stages.load("grpo", r, [override])
    assert f"g.yaml: {message}" in str(e.value) and "\n" not in str(e.value)


def test_grad_accum_follows_the_batch_split(tmp_path):
    r = tmp_path / "g.yaml"
    r.write_text(GRPO_BASE)
    cfg = stages.load("grpo", r, ["grpo.prompts_per_step=8", "grpo.group_size=8", "grpo.mini_batches=2",
                                  "grpo.num_learners=2", "grpo.micro_batch_size=4"])
    assert cfg.grpo.grad_accum == 64 // (2 * 2 * 4)
