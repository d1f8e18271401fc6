"""An agent program as a user writes one for `rollout.program.fn`: plain ``openai`` code that owns
its conversation and runs its tools itself. The calculator task (rlkit/tiny_tools.py,
``write_tool_task``) trains it: ``rollout.program.fn: rlkit.agent.examples:calculator``."""

from __future__ import annotations

import json
from typing import Any

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first integer."},
                                                    "b": {"type": "integer", "description": "The second integer."}},
                   "required": ["a", "b"]},
    "return": {"type": "integer"}}}


def calculator(row: dict[str, Any], client: Any, max_turns: int = 3) -> None:
    """Ask the row's question with the `add` tool offered; run each call the model makes and send
    its result back; stop at an answer without calls. Returns None: the recipe's reward functions
    score the transcript (the row's `answer` against the last answer)."""
    prompt = row["prompt"]
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            return None
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = json.dumps(int(args["a"]) + int(args["b"])) if call.function.name == "add" else \
                    json.dumps({"error": f"no tool {call.function.name}"})
            except (ValueError, KeyError, TypeError) as e:
                result = json.dumps({"error": str(e)})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
