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
    (longer inputs are truncated on the right). device/dtype: where the model runs
    (``"cpu"``/``"cuda"``; ``"float32"``/``"bfloat16"``). ray_actor: serve the model from
    one Ray actor (with ``num_gpus``, ``num_cpus`` and ``resources``, Ray's custom resources:
    ``{rm: 1}`` puts it on the node started with ``--resources='{"rm": 1}'``) when Ray is
    initialised; otherwise it is loaded in-process. ``setup()`` loads it (rlkit calls it once
    before the first batch). On a cluster the node that hosts the actor must see ``path``.
    """

    def __init__(self, path: str, batch_size: int = 8, max_length: int = 2048, device: str = "cpu",
                 dtype: str = "float32", ray_actor: bool = False, num_gpus: float = 0, num_cpus: float = 1,
                 resources: dict[str, float] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size, self.max_length = path, batch_size, max_length
        self.device, self.dtype, self.ray_actor, self.num_gpus = device, dtype, ray_actor, num_gpus
        self.num_cpus, self.resources = num_cpus, dict(resources or {})
        self._local: _Scorer | None = None
        self._actor: Any = None

    def ray_resources(self) -> dict[str, float] | None:
        """What its actor asks of the Ray cluster (rlkit checks it before launch); None in-process."""
        if not self.ray_actor:
            return None
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}

    def setup(self) -> None:
        if self._local is not None or self._actor is not None:
            return
        if self.ray_actor:
            import ray  # only on this path: the module itself stays Ray-free

            if ray.is_initialized():
                needs = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
                has = ray.cluster_resources()
                short = {k: v for k, v in needs.items() if v and has.get(k, 0) < v}
                if short:  # Ray would wait for them forever
                    raise ValueError(f"the reward model's actor needs {short}; the cluster has "
                                     f"{ {k: has.get(k, 0) for k in short} } (start a node with them or change "
                                     "num_gpus / num_cpus / resources)")
                cls = ray.remote(num_gpus=self.num_gpus, num_cpus=self.num_cpus, resources=self.resources)(_Scorer)
                self._actor = cls.remote(self.path, self.batch_size, self.max_length, self.device, self.dtype)
                return
        self._local = _Scorer(self.path, self.batch_size, self.max_length, self.device, self.dtype)

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        self.setup()
        if self._actor is not None:
            import ray

            return ray.get(self._actor.score_pairs.remote(list(prompts), list(completions)))
        assert self._local is not None
        return self._local.score_pairs(prompts, completions)
