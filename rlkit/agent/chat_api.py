"""OpenAI's Chat Completions format, as rlkit's endpoint (rlkit/agent/endpoint.py) reads and
writes it: a request checked and its messages made what transformers' chat templates take; a
turn written back as a Chat Completion, whole or as server-sent chunks. A Responses API request
(its input items, `instructions`, `previous_response_id`) becomes the same chat request, and the
turn goes back as a Response."""

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


def chunks(answer: dict[str, Any], include_usage: bool = False) -> Iterator[bytes]:
    """A Chat Completion as server-sent `chat.completion.chunk` events, then `[DONE]`; with
    `include_usage` (the request's `stream_options`) every chunk has `usage: null` and one more
    chunk, with no choices, carries the turn's usage, as OpenAI streams it."""
    message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
    deltas = [{"role": "assistant", "content": message["content"] or ""}]
    if message.get("tool_calls"):
        deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]})
    head = {**{k: answer[k] for k in ("id", "created", "model")}, "object": "chat.completion.chunk"}
    usage = {"usage": None} if include_usage else {}
    for i, delta in enumerate([*deltas, {}]):
        last = finish if i == len(deltas) else None
        chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": last}], **usage}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    if include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': answer['usage']})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _arguments(args: Any) -> str:
    """A tool call's arguments as OpenAI sends them: a JSON string."""
    return args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)


# ---------------------------------------------------------------------------------- Responses API


def responses_to_chat(body: Any, previous: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A Responses API request as the Chat Completions request it stands for; `previous`: the
    conversation (chat messages, with the answer) of each earlier response id of the session."""
    if not isinstance(body, dict):
        raise RequestError(400, "malformed", "the request body is not a JSON object")
    if body.get("stream"):
        raise RequestError(400, "malformed", "the Responses API is served without streaming (stream: false)")
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list) or not items:
        raise RequestError(400, "malformed", "`input` must be text or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    if body.get("previous_response_id") is not None:
        if body["previous_response_id"] not in previous:
            raise RequestError(400, "malformed", f"previous_response_id {body['previous_response_id']!r} is no "
                                                 "earlier response of this rollout")
        messages = [dict(m) for m in previous[body["previous_response_id"]] if m.get("role") != "system"]
    if body.get("instructions"):
        messages.insert(0, {"role": "system", "content": str(body["instructions"])})
    for item in items:
        _item(item, messages)
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    if len(tools) != len(body.get("tools") or ()):
        raise RequestError(400, "malformed", "only function tools are served ({type: function, name, parameters})")
    chat = {k: body[k] for k in ("temperature", "top_p", "seed") if k in body}
    return {**chat, "messages": messages, "tools": tools, "max_tokens": body.get("max_output_tokens")}


def _item(item: Any, messages: list[dict[str, Any]]) -> None:
    """One input item appended to the chat messages (a function call joins the assistant turn before it)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
        content = item.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text") for p in content):
                raise RequestError(400, "malformed", "only text content is served (the policy is text-only)")
            content = "".join(str(p.get("text", "")) for p in content)
        messages.append({"role": item["role"], "content": content})
    elif kind == "function_call" and isinstance(item.get("name"), str):
        call = {"id": item.get("call_id", ""), "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": str(item.get("output"))})
    else:
        raise RequestError(400, "malformed", f"an input item of type {kind!r} is not served (message, "
                                             "function_call, function_call_output)")


def chat_to_response(answer: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completion (of `completion`) as a Response."""
    message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
    ident = answer["id"].removeprefix("chatcmpl-")
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{ident}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or ():
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = answer["usage"]
    return {"id": f"resp_{ident}", "object": "response", "created_at": answer["created"], "model": answer["model"],
            "status": "incomplete" if finish == "length" else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
