"""The RL task of a GRPO run: prompt rows (train and held-out), how a row becomes prompt text,
and the reward functions. Loaded and checked before any actor starts."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.agent.program import program_reward
from rlkit.agent.rollouts import Rollouts
from rlkit.agent.tools import environment_rewards, load_environments, load_interaction, load_tools
from rlkit.config import DataConfig, ModelConfig
from rlkit.errors import ConfigError, DataError
from rlkit.reward import RewardScorer, RewardSpec
from rlkit.rollout.config import RolloutConfig


@dataclass
class Task:
    """Prompt rows keep their dataset columns: the reward functions receive them as kwargs."""

    rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    template: str
    tokenizer: Any
    scorer: RewardScorer
    agent: Rollouts | None = None  # multi-turn rollouts: tools / environments, the calculator, an agent program
    images: Any = None  # rlkit.data.images.ImageInputs: a vision-language model's processor

    def render(self, row: dict[str, Any]) -> str:
        """The prompt text of a row (the recipe's template)."""
        from rlkit.data.templates import render_prompt

        return render_prompt(row, self.template, self.tokenizer)

    def engine_prompts(self, rows: list[dict[str, Any]], texts: list[str]) -> list[Any]:
        """What the engines get for `rows` rendered as `texts`: the text, or for a row with images
        vLLM's prompt dict of the text (one image mark per image, as the template wrote it) and
        the pictures (`multi_modal_data`), which vLLM expands into the model's image tokens once
        (the processor's already expanded ids would be expanded again). A row with `max_tokens` or
        `min_tokens` columns gets them as its own sampling limits (`limits`, within the recipe's)."""
        from rlkit.data.images import load_image

        out: list[Any] = []
        for row, text in zip(rows, texts):
            own = {"limits": {k: int(row[k]) for k in ("max_tokens", "min_tokens") if row.get(k) is not None}}
            own = {k: v for k, v in own.items() if v}
            if row.get("images"):
                own["multi_modal_data"] = {"image": [load_image(r) for r in row["images"]]}
            out.append({"prompt": text, **own} if own else text)
        return out

    def probe(self, rows: list[dict[str, Any]]) -> Any:
        """The parity probe of `rows`' prompts (`rlkit.grpo.parity.Probe`): their token ids; for
        rows with images the ids the processor expands them to, the prompts as the engines get
        them in rollouts, and the learner's pixel inputs."""
        from rlkit.grpo.parity import Probe
        from rlkit.learner.objective import MicroBatch

        texts = [self.render(row) for row in rows]
        sequences = [self.images.encode(text, row["images"]) if row.get("images") else self.tokenizer(text).input_ids
                     for row, text in zip(rows, texts)]
        if not any(row.get("images") for row in rows):
            return Probe(sequences)
        pixels = self.images.pixels([row.get("images") for row in rows], MicroBatch.padded(sequences)["input_ids"])
        return Probe(sequences, self.engine_prompts(rows, texts), pixels)

    @property
    def difficulties(self) -> list[str | None]:
        return [r.get("difficulty") for r in self.rows]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def load_task(model: ModelConfig, data: DataConfig, rewards: tuple[RewardSpec, ...],
              reward_default: float | None, recipe_dir: str | None, seed: int = 0,
              rollout: RolloutConfig | None = None, on_cpu: bool = False) -> Task:
    """Load the prompts, the tokenizer and the rewards (resolved against the prompts' columns;
    `file.py:function` paths are relative to `recipe_dir`; `seed` draws `num_samples` rows), and
    the `rollout`'s tools and environments (multi-turn rollouts) when it names any. `on_cpu`: the
    engines' KV caches are `rollout.kv_cache_gib`, so the calculator plays as many episodes at once
    as they hold."""
    from rlkit.data.formats import load_prompts
    from rlkit.data.templates import resolve_template
    from rlkit.model.load import load_tokenizer

    tokenizer = load_tokenizer(model)
    rows = load_prompts(data.train, data.format, data.dataset, data.skip_bad_rows, data.split, seed=seed).rows
    eval_rows = load_prompts(data.eval, data.format, data.dataset, split=data.eval_split,
                             seed=seed).rows if data.eval else []
    template = resolve_template(data.template, rows[0], tokenizer, data.train) if rows else data.template
    multi_turn = rollout and (rollout.tools or rollout.environment or rollout.interaction or rollout.program.on)
    images = _image_inputs(model, tokenizer, ((data.train, rows), (data.eval, eval_rows)),
                           bool(multi_turn or (rollout and rollout.calculator)))
    agent = _agent(rollout, template, tokenizer, recipe_dir) if multi_turn else None
    if rollout and rollout.calculator:
        from rlkit.agent.calculator import Calculator, kv_cache_tokens
        from rlkit.data.templates import render_prompt

        agent = Calculator(tokenizer, lambda row: render_prompt(dict(row), template, tokenizer), rollout.max_model_len,
                           kv_cache_tokens(rollout, model.path, model.dtype) if on_cpu else None)
    environments = agent.environments if agent else None
    program = bool(rollout and rollout.program.on)
    columns = (set(rows[0]) | ({"environments", "env_rewards"} if environments else set()) |
               ({"env_rewards"} if program else set())) if rows else None
    if not rewards and not (environments and environments.rewards) and not program:
        raise ConfigError("name at least one reward function (the environment has no get_reward)", "rewards")
    extra = environment_rewards(environments) if environments else [program_reward()] if program else ()
    scorer = RewardScorer(list(rewards), recipe_dir, columns=columns, default=reward_default, extra=extra)
    for source, some in ((data.train, rows), (data.eval, eval_rows)):
        scorer.check_rows(str(source), some)
    task = Task(rows, eval_rows, template, tokenizer, scorer, agent, images)
    check_prompts(task, ((data.train, rows), (data.eval, eval_rows)), rollout)
    return task


_CHECK_CHUNK = 4096  # prompts rendered and tokenised at a time before launch


def check_prompts(task: Task, sources: Any, rollout: RolloutConfig | None) -> None:
    """Render every prompt, and fit it in the engines' `rollout.max_model_len`, before launch: a
    chat template that refuses a row (a system turn it does not take, turns that do not alternate)
    or a prompt longer than the engine's context would otherwise stop the run, with vLLM's or
    jinja's traceback, at the step that first draws that row. Prompts whose completion budget
    (`rollout.max_tokens`) runs past the context are counted in a warning: vLLM cuts them there.
    A prompt with images is measured with its image tokens, as the processor expands them."""
    import logging

    from jinja2 import TemplateError

    cut = 0
    for source, rows in sources:
        for start in range(0, len(rows), _CHECK_CHUNK):  # a chunk at a time: a large file's texts are not all held
            chunk = rows[start:start + _CHECK_CHUNK]
            texts = []
            for n, row in enumerate(chunk, start + 1):
                try:
                    texts.append(task.render(row))
                except TemplateError as e:
                    raise DataError(f"{source}: prompt {n}: the tokenizer's chat template refuses it ({e}); fix the "
                                    "row, or set data.template: alpaca") from None
            if rollout is None or not texts:
                continue
            tokenized = task.tokenizer(texts).input_ids  # one batch: the fast tokenizer's threads
            for n, (row, text, ids) in enumerate(zip(chunk, texts, tokenized), start + 1):
                # a row with images: its marks as the engines expand them into image tokens
                length = len(task.images.encode(text, row["images"])) if row.get("images") else len(ids)
                if length >= rollout.max_model_len:
                    raise ConfigError(f"{source}: prompt {n} is {length} tokens, the engines hold "
                                      f"{rollout.max_model_len} with its completion: raise it, or shorten or drop the "
                                      "row", "rollout.max_model_len")
                cut += length + rollout.max_tokens > rollout.max_model_len
    if cut:
        logging.getLogger("rlkit").warning(
            "%d prompts leave less than rollout.max_tokens (%d) of rollout.max_model_len (%d): their completions end "
            "at the context's end", cut, rollout.max_tokens, rollout.max_model_len)


def _image_inputs(model: ModelConfig, tokenizer: Any, sources: Any, multi_turn: bool) -> Any:
    """A vision-language model's processor for prompt rows with images (None when no row has any);
    rows with images need a vision-language model, and single-turn rollouts."""
    from rlkit.model.load import load_image_inputs

    first = next(((path, n) for path, rows in sources for n, r in enumerate(rows, 1) if r.get("images")), None)
    if first is None:
        return None
    images = load_image_inputs(model, tokenizer)
    if images is None:
        raise DataError(f"{first[0]}: row {first[1]} has images, and {model.path} is a text-only model (no vision "
                        "tower): use a vision-language model, or prompts without images")
    if multi_turn:
        raise DataError(f"{first[0]}: row {first[1]} has images: multi-turn rollouts (tools, environments, the "
                        "calculator) take text prompts only")
    return images


def _agent(rollout: RolloutConfig, template: str, tokenizer: Any, recipe_dir: str | None) -> Any:
    """The run's tools and environments, or its agent program, checked (one line each) before launch."""
    from rlkit.agent.loop import Agent
    from rlkit.agent.template import prepare_tokenizer

    key = "rollout.tools" if rollout.tools else "rollout.environment" if rollout.environment else \
        "rollout.interaction" if rollout.interaction else "rollout.program"
    if template != "chat":
        raise ConfigError("tool calls need the tokenizer's chat template: set data.template: chat (rows of any "
                          "format become chat messages)", key)
    if rollout.program.on:
        from rlkit.agent.program import ProgramAgent, load_program
        from rlkit.rollout.generation import sampling

        sample = sampling(rollout)  # what the engines sample with: the programs' requests are held to it
        recipe = {"temperature": sample.temperature, "top_p": sample.top_p}
        with contextlib.suppress(ConfigError):  # tool calls parsed into OpenAI's format; without, a turn is text
            tokenizer = prepare_tokenizer(tokenizer, key)
        program = load_program(rollout.program.fn, recipe_dir) if rollout.program.fn else None
        return ProgramAgent(tokenizer, program, rollout.program, rollout.max_tokens, rollout.max_model_len, recipe,
                            recipe_dir)
    tools = load_tools(rollout.tools, recipe_dir)
    environments = load_environments(rollout.environment, recipe_dir) if rollout.environment else \
        load_interaction(rollout.interaction, recipe_dir) if rollout.interaction else None
    return Agent(tokenizer, tools, environments, rollout.max_tool_calls, rollout.tool_timeout_s, rollout.max_tokens,
                 rollout.max_model_len)


def recipe_notes(cfg: Any, recipe_path: str | Path | None) -> list[str]:
    """What `--print-config` says of a GRPO recipe's rewards: resolved."""
    from rlkit.reward.resolve import describe_rewards

    return ["rewards, resolved:", *(f"  {line}" for line in describe_rewards(cfg.rewards, recipe_dir(recipe_path)))]


def recipe_dir(recipe_path: str | Path | None) -> str | None:
    """The folder `file.py:function` reward paths are relative to."""
    return str(Path(recipe_path).resolve().parent) if recipe_path else None
