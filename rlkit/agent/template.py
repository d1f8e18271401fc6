"""The chat template's side of multi-turn rollouts: a tokenizer that can render tool calls and
parse them back (TRL's response template where it has none), and the tokens the template puts
between an assistant turn and the next (tool results, an interaction's user turn), appended to
the completion as they are, never re-tokenised."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlkit.errors import ConfigError


def prepare_tokenizer(tokenizer: Any, key: str = "rollout.tools") -> Any:
    """The tokenizer, able to render tool calls and to parse them back; one line if it cannot.
    A tokenizer without a ``response_template`` gets TRL's for the chat templates TRL knows
    (Qwen2.5/3, Llama 3.x, GLM-4, GPT-OSS, ...), as TRL's GRPOTrainer does."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        raise ConfigError("the tokenizer's chat template cannot render a tool call and its result (user -> assistant "
                          "with tool_calls -> tool); use a tool-calling model's tokenizer (model.tokenizer)", key)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise ConfigError("the tokenizer has no response_template to parse the model's tool calls with, and its "
                              "chat template is not one TRL knows; set `response_template` in its "
                              "tokenizer_config.json (transformers' chat response parsing)", key) from None
    return tokenizer


def suffix_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens the chat template puts after an assistant turn that ended at EOS and before the
    next assistant turn: `messages` (tool results, or an interaction's user turn) and the
    generation prompt."""
    if messages[0]["role"] == "tool":  # the real tool name: some templates derive the result header from it
        call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    else:
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
    before = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False)
    after = tokenizer.apply_chat_template(dummy + list(messages), add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    eos = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    if eos:  # "...<|im_end|>\n": the model's turn ends at EOS, the newline belongs to the suffix
        before = before[:eos[-1] + 1]
    if after[:len(before)] != before:
        raise ValueError("the chat template renders the conversation before the new turns differently with them")
    return after[len(before):]
