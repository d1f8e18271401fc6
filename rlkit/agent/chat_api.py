"""OpenAI's Chat Completions format, as rlkit's endpoint (rlkit/agent/endpoint.py) reads and
writes it: a request checked and its messages made what transformers' chat templates take; a
turn written back as a Chat Completion, whole or as server-sent chunks."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

MODEL_NAME = "rlkit-policy"
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status, its kind (a metric) and the message."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind



def check_request(body: Any, sampling: str, recipe: dict[str, Any],
                  overridden: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The request's messages and tools, as the chat template takes them. A sampling key set to
    another value than the recipe's is added to `overridden`, or refused (`sampling` "refuse")."""
    if not isinstance(body, dict):
        raise RequestError(400, "malformed", "the request body is not a JSON object")
    messages, tools = body.get("messages"), body.get("tools") or []
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "developer", "user", "assistant", "tool")
            for m in messages):
        raise RequestError(400, "malformed", "`messages` must be a non-empty list of {role, content} objects "
                                             "(roles system, developer, user, assistant, tool)")
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError(400, "malformed", "`tools` must be a list of {type: function, function: {name, "
                                             "description, parameters}}")
    if body.get("n") not in (None, 1):
        raise RequestError(400, "malformed", "n must be 1: a rollout samples one answer per turn")
    for key in SAMPLING_KEYS:
        if body.get(key) is None or body.get(key) == recipe.get(key):
            continue
        if sampling == "refuse":
            raise RequestError(400, "sampling", f"{key}={body[key]!r}: the run samples with the recipe's "
                                                "settings (rollout.program.sampling: refuse)")
        overridden.add(key)
    return normalise(messages), tools


def normalise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as transformers' chat templates take them: text parts joined, no content
    (None, as `message.model_dump()` sends it with tool calls) as empty text, a tool
    call's JSON arguments as an object (as the model wrote them), a tool result's name from the
    call it answers, `developer` as `system`."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        m["role"] = "system" if m["role"] == "developer" else m["role"]
        m["content"] = _text(m.get("content")) or ""  # None and absent as every template renders them: nothing
        calls = [_call(c) for c in m.get("tool_calls") or ()]
        for c in calls:
            names[c.get("id", "")] = c["function"]["name"]
        if calls:
            m["tool_calls"] = calls
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _text(content: Any) -> str | None:
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise RequestError(400, "malformed", "only text content parts are served (the policy is text-only)")
        return "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestError(400, "malformed", "a message's content must be text or text parts")
    return content


def _call(call: Any) -> dict[str, Any]:
    """A tool call with its arguments as the object the model wrote (JSON text that is not an
    object stays text: the tokens will tell)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(400, "malformed", "a tool call must be {id, type: function, function: {name, arguments}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    return {**call, "function": {**fn, "arguments": args}}


def completion(ident: str, calls: list[dict[str, Any]], content: str, finish: str, completion_tokens: int,
               prompt_tokens: int) -> dict[str, Any]:
    """A Chat Completion: the turn's text and tool calls (ids `call_<ident>_<i>`)."""
    tool_calls = [{"id": f"call_{ident}_{i}", "type": "function",
                   "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
                  for i, c in enumerate(calls) if isinstance(c, dict) and "function" in c]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": f"chatcmpl-{ident}", "object": "chat.completion", "created": int(time.time()), "model": MODEL_NAME,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chunks(answer: dict[str, Any]) -> Iterator[bytes]:
    """A Chat Completion as server-sent `chat.completion.chunk` events, then `[DONE]`."""
    message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
    deltas = [{"role": "assistant", "content": message["content"] or ""}]
    if message.get("tool_calls"):
        deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]})
    head = {k: answer[k] for k in ("id", "created", "model")}
    for i, delta in enumerate([*deltas, {}]):
        chunk = {**head, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish if i == len(deltas) else None}]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _arguments(args: Any) -> str:
    """A tool call's arguments as OpenAI sends them: a JSON string."""
    return args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
