"""Prompt templates: the seeds' alpaca template and the tokenizer's chat template.

alpaca (from the seed guides)::

    {system}\\n\\n                                  only when system is non-empty
    ### 指令:\\n{q}\\n\\n### 回答:\\n{a}\\n\\n         one block per history pair [q, a]
    ### 指令:\\n{instruction}\\n\\n### 输入:\\n{input}\\n\\n### 回答:\\n
                                                  (the 输入 block only when input is non-empty)

chat: ``tokenizer.apply_chat_template``; the prompt is rendered with
``add_generation_prompt=True``, the response is the rest of the full conversation.

Any row shape works with either template: alpaca rows become messages (system, history
turns, user = instruction + "\\n\\n" + input) and messages become alpaca fields (system,
user/assistant pairs as history, last user turn as instruction).
`render_sft` splits a row into prompt and final response (earlier turns are prompt);
`sft_turns` splits it at every assistant turn, so each one can be a training target (as
LLaMA-Factory trains multi-turn rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkit.data.images import count_placeholders, image_parts
from rlkit.errors import DataError

TEMPLATES = ("alpaca", "chat")  # what rows are rendered with; data.template also takes "auto"

# The alpaca format as a Jinja chat template, written into final/'s tokenizer so that
# `apply_chat_template(messages, add_generation_prompt=True)` (vLLM's and HF's chat APIs) gives
# the prompt the model was trained on. An alpaca row with an input is the user message
# {"role": "user", "content": instruction, "input": input} (`served_messages`); a plain user
# message renders as an instruction without input. The last assistant turn ends with eos, as trained.
ALPACA_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
    "{% elif m['role'] == 'user' %}{{ '### 指令:\\n' + m['content'] + '\\n\\n' }}"
    "{% if m.get('input') %}{{ '### 输入:\\n' + m['input'] + '\\n\\n' }}{% endif %}{{ '### 回答:\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{% if loop.last %}{{ eos_token }}"
    "{% else %}{{ '\\n\\n' }}{% endif %}"
    "{% endif %}{% endfor %}")


def resolve_template(template: str, row: dict[str, Any], tokenizer: Any, source: str) -> str:
    """The template rows are rendered with: `auto` is the tokenizer's chat template for chat rows
    (messages, or a prompt given as messages), as TRL does, and the seeds' alpaca template for
    alpaca and plain-text rows; a named template is used as named."""
    if template != "auto":
        return template
    chat = "messages" in row or isinstance(row.get("prompt"), list) or bool(row.get("images"))
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source}: data.template: auto renders chat rows with the tokenizer's chat template, and "
                        "this tokenizer has none: set data.template: alpaca, or use a chat model's tokenizer")
    return "chat" if chat else "alpaca"


def chat_template_for(template: str, tokenizer: Any) -> str | None:
    """The chat template a model trained with `template` must ship (None: the tokenizer's own,
    which is what it was trained with)."""
    if template != "alpaca":
        return None
    ids = tokenizer("a")["input_ids"]
    adds_bos = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
    return ("{{ bos_token }}" if adds_bos else "") + ALPACA_CHAT_TEMPLATE  # as encode_sft tokenises it


def served_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The prompt of a row as chat messages for a model trained by rlkit: with the template
    `chat_template_for` wrote, `apply_chat_template(..., add_generation_prompt=True)` on them is
    the training prompt (an alpaca input goes in the user message's `input` field)."""
    if "instruction" not in row:
        return prompt_messages(row)
    msgs = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for q, a in row.get("history") or []:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    user = {"role": "user", "content": row["instruction"]}
    return msgs + [{**user, "input": row["input"]} if row.get("input") else user]


def render_alpaca(instruction: str, input: str = "", system: str = "",  # noqa: A002
                  history: list[list[str]] | tuple = ()) -> str:
    """The alpaca prompt text, ending with '### 回答:\\n' (the response follows directly)."""
    parts = [f"{system}\n\n"] if system else []
    parts += [f"### 指令:\n{q}\n\n### 回答:\n{a}\n\n" for q, a in history]
    if input:
        parts.append(f"### 指令:\n{instruction}\n\n### 输入:\n{input}\n\n### 回答:\n")
    else:
        parts.append(f"### 指令:\n{instruction}\n\n### 回答:\n")
    return "".join(parts)


def alpaca_to_messages(row: dict[str, Any], with_output: bool) -> list[dict[str, str]]:
    """Chat turns for an alpaca row; the output becomes the last assistant turn if asked."""
    msgs = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for q, a in row.get("history") or []:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    msgs.append({"role": "user", "content": user})
    if with_output:
        msgs.append({"role": "assistant", "content": row["output"]})
    return msgs


def messages_to_alpaca(msgs: list[dict[str, str]]) -> dict[str, Any]:
    """Alpaca fields from turns [system?] (user, assistant)* user [assistant?]."""
    system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else ""
    turns = msgs[1:] if msgs and msgs[0]["role"] == "system" else list(msgs)
    output = turns.pop()["content"] if turns and turns[-1]["role"] == "assistant" else None
    roles = [m["role"] for m in turns]
    if not turns or roles != ["user", "assistant"] * (len(turns) // 2) + ["user"]:
        raise DataError("the alpaca template needs alternating user/assistant turns ending "
                        f"with a user turn, got roles {roles}; use template: chat")
    history = [[turns[i]["content"], turns[i + 1]["content"]] for i in range(0, len(turns) - 1, 2)]
    return {"instruction": turns[-1]["content"], "input": "", "system": system,
            "history": history, "output": output}


def _check(template: str, tokenizer: Any) -> None:
    if template not in TEMPLATES:
        raise DataError(f"unknown template {template!r} (expected one of {', '.join(TEMPLATES)})")
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError("template 'chat' needs a tokenizer with a chat_template; "
                        "use template: alpaca or a chat model's tokenizer")


def _chat(tokenizer: Any, msgs: list[dict[str, str]], generation_prompt: bool, tools: Any = None,
          images: int | None = None) -> str:
    """The chat template's rendering; `tools`: a row's tool schemas (TRL's `tools` column); `images`
    (`_images`): None for a text row, else its turns go to the template as text and image parts,
    with that many images put first (a row whose text names none of them)."""
    if images is not None:
        msgs = image_parts(msgs, images)
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                         tools=tools or None)


def _images(row: dict[str, Any], template: str) -> int | None:
    """None for a row without images; else how many go first in its first user turn (all of them
    when its text names none, else 0). Images need the chat template, which places them."""
    n = len(row.get("images") or ())
    if not n:
        return None
    if template != "chat":
        raise DataError(f"a row with images needs the chat template (the model's places the images), not {template}: "
                        "set data.template: chat (or auto)")
    return 0 if count_placeholders(row_turns(row)) else n


def row_turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every turn a row's text has, as messages, whatever its shape (alpaca fields without the
    output, messages, or a prompt): where its images may be named."""
    if "instruction" in row:
        return alpaca_to_messages(row, with_output=False)
    if "messages" in row:
        return row["messages"]
    return row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]


def prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """Prompt turns (ending with a user turn) for any row shape."""
    if "instruction" in row:
        return alpaca_to_messages(row, with_output=False)
    if "messages" in row:
        msgs = row["messages"]
        return msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
    p = row["prompt"]
    return [{"role": "user", "content": p}] if isinstance(p, str) else p


def render_prompt(row: dict[str, Any], template: str, tokenizer: Any = None) -> str:
    """Prompt text for a row (alpaca, messages or prompt row), ready for generation.

    The tokenizer is only needed for the chat template.
    """
    _check(template, tokenizer)
    images = _images(row, template)
    if template == "chat":
        return _chat(tokenizer, prompt_messages(row), True, row.get("tools"), images)
    if "instruction" in row:
        f = row
    elif "messages" in row or isinstance(row["prompt"], list):
        f = messages_to_alpaca(prompt_messages(row))
    else:
        f = {"instruction": row["prompt"]}
    return render_alpaca(f["instruction"], f.get("input", ""), f.get("system", ""),
                         f.get("history") or ())


def render_sft(row: dict[str, Any], template: str, tokenizer: Any = None) -> tuple[str, str]:
    """(prompt_text, response_text) for an SFT row; the response excludes the eos token.

    For the chat template the response is the full rendering minus the prompt rendering
    (so it carries the template's end-of-turn text); an eos token at its end, with
    trailing whitespace after it, is cut, since encode_sft appends eos.
    """
    _check(template, tokenizer)
    images = _images(row, template)
    if template == "alpaca":
        f = row if "instruction" in row else messages_to_alpaca(row["messages"])
        if not f.get("output"):
            raise DataError("render_sft needs a row with a response (output)")
        return render_prompt(f, "alpaca"), f["output"]
    msgs = alpaca_to_messages(row, with_output=True) if "instruction" in row else row["messages"]
    prompt = _chat(tokenizer, msgs[:-1], True, row.get("tools"), images)
    full = _chat(tokenizer, msgs, False, row.get("tools"), images)
    if not full.startswith(prompt):
        raise DataError("the chat template renders the prompt differently inside the full "
                        "conversation; cannot split prompt and response")
    response = full[len(prompt):]
    eos = tokenizer.eos_token
    if eos and response.rstrip().endswith(eos):
        response = response.rstrip()[: -len(eos)]
    return prompt, response


def sft_turns(row: dict[str, Any], template: str, tokenizer: Any = None) -> list[tuple[str, str]]:
    """(prompt piece, response piece) for every assistant turn of an SFT row, in order: joined,
    they are the whole conversation as the template renders it (for alpaca rows, history
    answers are assistant turns). A piece of prompt holds whatever the template writes
    between two responses (the next user turn, end-of-turn text).

    Raises DataError when the template renders an earlier turn differently once later turns
    follow it (e.g. a template that drops the reasoning of past turns): such a row can only
    train its last turn.
    """
    _check(template, tokenizer)
    images = _images(row, template)
    msgs = alpaca_to_messages(row, with_output=True) if "instruction" in row else row["messages"]
    if template == "alpaca":
        f = row if "instruction" in row else messages_to_alpaca(msgs)
        if not f.get("output"):
            raise DataError("sft_turns needs a row with a response (output)")
        history = [list(p) for p in f.get("history") or []]
        # (prompt up to turn k, the same plus its answer): history turns, then the final one
        prefixes = [(render_alpaca(q, "", f.get("system", ""), history[:k]), a) for k, (q, a) in enumerate(history)]
        prefixes.append((render_prompt(f, "alpaca"), f["output"]))
        prefixes = [(p, p + a) for p, a in prefixes]
    else:
        ends = [i + 1 for i, m in enumerate(msgs) if m["role"] == "assistant"]
        tools = row.get("tools")
        prefixes = [(_chat(tokenizer, msgs[:e - 1], True, tools, images),
                     _chat(tokenizer, msgs[:e], False, tools, images)) for e in ends]
    out, done = [], ""
    for k, (prompt, full) in enumerate(prefixes):
        if not prompt.startswith(done):
            raise DataError(f"the {template} template renders assistant turn {k} differently once turn {k + 1} "
                            "follows it; set data.mask_history: true to train the last turn only")
        if not full.startswith(prompt):
            raise DataError(f"the {template} template renders the prompt differently inside the full conversation "
                            f"(assistant turn {k + 1}); cannot split prompt and response")
        out.append((prompt[len(done):], full[len(prompt):]))
        done = full
    return out


def ship_template(model_dir: Path, template: str) -> None:
    """Write the prompt template a model was trained with into its tokenizer (chat_template), so
    that serving it with a chat API renders the prompts it learned (the alpaca template; a chat
    template is the tokenizer's own already)."""
    from transformers import AutoTokenizer

    if not (Path(model_dir) / "tokenizer_config.json").exists():
        return  # no tokenizer was saved with this model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jinja = chat_template_for(template, tokenizer)
    if jinja is not None:
        tokenizer.chat_template = jinja
        tokenizer.save_pretrained(model_dir)
