"""Reward-model scorer: an HF ``AutoModelForSequenceClassification`` (one logit) from a
local directory, batched; optionally served from a Ray actor.

Recipe::

    rewards:
      - fn: rewards.model:RewardModel
        args: {path: /models/my-rm, batch_size: 16, ray_actor: true, num_gpus: 1}

Text scored per sample: the tokenizer's chat template over prompt + completion messages
when the prompt is a message list and the tokenizer has a template, else
``prompt + completion``; either ends with the eos, as `rlkit rm` (and TRL's `RewardTrainer` on
plain text) trains on it. Score = the logit of label 0 (float32). An `rlkit rm` final/ loads as it is: its
tokenizer carries the template it was trained with.
"""

from __future__ import annotations

import threading
from typing import Any

from rlkit.reward.contract import completion_text, prompt_text, reward_range


class _Scorer:
    """Tokenizer + model on one device; ``score(texts) -> list[float]``."""

    def __init__(self, path: str, batch_size: int, max_length: int, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.model.to(device).eval()
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self._lock = threading.Lock()

    def chat_text(self, prompt: Any, completion: Any) -> str:
        """The text scored: the chat template's rendering (message prompts) or prompt + completion,
        ending with the eos unless it already does (as `rlkit rm` and TRL trained on it)."""
        if isinstance(prompt, list) and getattr(self.tok, "chat_template", None):
            reply = completion if isinstance(completion, list) else [
                {"role": "assistant", "content": completion_text(completion)}]
            text = self.tok.apply_chat_template(prompt + reply, tokenize=False)
        else:
            text = prompt_text(prompt) + completion_text(completion)
        eos = self.tok.eos_token
        return text if not eos or text.rstrip().endswith(eos) else text + eos

    def ready(self) -> bool:
        """True once its model is loaded (a served actor's start is waited on this)."""
        return True

    def score_pairs(self, prompts: list, completions: list) -> list[float]:
        return self.score([self.chat_text(p, c) for p, c in zip(prompts, completions)])

    def score(self, texts: list[str]) -> list[float]:
        out: list[float] = []
        with self._lock, self.torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                               truncation=True, max_length=self.max_length).to(self.device)
                logits = self.model(**enc).logits
                out.extend(logits[:, 0].float().cpu().tolist())
        return out


@reward_range(None, None)  # a learned score: any finite value
class RewardModel:
    """Scores (prompt, completion) pairs with a sequence-classification reward model.

    path: local model directory. batch_size: samples per forward pass. max_length: tokens
    (longer inputs are truncated on the right). device: the device kind it runs on (``"cpu"``,
    ``"cuda"``, ``"rocm"``, ``"npu"``; ``"auto"``: the driver's). dtype: ``"float32"`` /
    ``"bfloat16"``. ray_actor: serve the model from a Ray actor of its own when Ray is running,
    started as rlkit starts its other roles (named "the reward model" in fault messages), with
    ``devices`` devices of its kind (``num_gpus`` is the old name), ``num_cpus`` CPUs and
    ``resources``, Ray's custom resources (``{rm: 1}`` puts it on the node started with
    ``--resources='{"rm": 1}'``); each call waits at most ``timeout_s`` (its start
    ``start_timeout_s``), then the run stops with one line naming it. Otherwise it is loaded
    in-process. ``setup()`` loads it (rlkit calls it once before the first batch). On a cluster
    the node that hosts the actor must see ``path``.
    """

    def __init__(self, path: str, batch_size: int = 8, max_length: int = 2048, device: str = "cpu",
                 dtype: str = "float32", ray_actor: bool = False, devices: float | None = None,
                 num_gpus: float | None = None, num_cpus: float = 1, resources: dict[str, float] | None = None,
                 timeout_s: float = 600, start_timeout_s: float = 900) -> None:
        from rlkit.actors.served import Serving

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size, self.max_length, self.dtype = path, batch_size, max_length, dtype
        count = devices if devices is not None else num_gpus if num_gpus is not None else 1
        self.serving = Serving(device, count, num_cpus, dict(resources or {}), ray=ray_actor, timeout_s=timeout_s,
                               start_timeout_s=start_timeout_s, what="the reward model")
        self._local: _Scorer | None = None
        self._actor: Any = None

    def ray_resources(self) -> dict[str, float] | None:
        """What its actor asks of the Ray cluster (rlkit checks it before launch); None in-process."""
        return self.serving.bundle() if self.serving.ray else None

    def memory_parts(self) -> dict[str, Any]:
        """What the estimate counts for it: the model at `path`, `dtype`, scoring `batch_size` x
        `max_length` tokens at a time, apart from the learners when served from its actor."""
        return {"kind": "scorer", "path": self.path, "dtype": self.dtype, "tokens": self.batch_size * self.max_length,
                "actors": 1 if self.serving.ray else 0, "device": self.serving.device}

    def setup(self) -> None:
        if self._local is not None or self._actor is not None:
            return
        torch_device = self.serving.info.torch_device
        if self.serving.in_ray():
            (self._actor,) = self.serving.start(_Scorer, self.path, self.batch_size, self.max_length, torch_device,
                                                self.dtype)
            self.serving.wait([self._actor.ready.remote()], self.serving.names(), "loading its model", start=True)
            return
        self._local = _Scorer(self.path, self.batch_size, self.max_length, torch_device, self.dtype)

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        self.setup()
        if self._actor is not None:
            ref = self._actor.score_pairs.remote(list(prompts), list(completions))
            return self.serving.wait([ref], self.serving.names(), "scoring")[0]
        assert self._local is not None
        return self._local.score_pairs(prompts, completions)
