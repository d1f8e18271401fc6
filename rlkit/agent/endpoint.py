"""An OpenAI-compatible Chat Completions endpoint in front of the rollout engines, with the exact
tokens of every turn kept per session (token-in/token-out).

Each rollout of an agent program (`rollout.program`, rlkit/agent/program.py) is a session: its
base URL ``http://HOST:PORT/s/SESSION/v1`` (or the shared ``/v1`` with the session's key as the
API key). A request's messages (and tools, in OpenAI's format) are rendered with the policy's chat
template; when the rendered tokens begin with everything the session holds (its prompt, and every
token sampled or appended since), the new tokens after them (tool results, the next user turn)
join the completion out of the loss, and the engines generate the next turn from exactly those
tokens. A request whose tokens do not extend the session's (the harness rewrote or cut its
history, a template that drops earlier thinking, tool-call arguments written another way) starts a
new sample of the same rollout (a fork, counted): rlkit never splices re-tokenised text into a
sample. The model's tokens carry the engine's logprobs; nothing is re-tokenised.

Sampling is the recipe's: a request's own temperature, max_tokens and the like are logged and
overridden, or refused (`rollout.program.sampling`). A session answers at most
`rollout.program.max_requests` requests. Every refusal is an OpenAI-style error body with an
HTTP status, counted per kind for the rollout: it costs that rollout, never the step.

Requests of a generation wait up to `batch_wait_s` to share one engine call (continuous batching
at the turn's grain): a call goes as soon as every running program has a request waiting.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from typing import Any

from rlkit.agent.chat_api import (
    MODEL_NAME,
    RequestError,
    chat_to_response,
    check_request,
    chunks,
    completion,
    responses_to_chat,
)
from rlkit.agent.session import Batcher, Segment, Session
from rlkit.program_config import ProgramConfig


class Endpoint:
    """The HTTP server (aiohttp, in a thread of its own) and its sessions."""

    def __init__(self, tokenizer: Any, cfg: ProgramConfig, max_tokens: int, max_model_len: int,
                 recipe: dict[str, Any], unix_path: str | None = None):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.recipe = recipe  # the recipe's sampling values, by OpenAI's names
        self.unix_path = unix_path  # also served on this Unix socket (a sandboxed command's way out)
        self.sessions: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url: str | None = None
        self._runner: Any = None
        self._lock = threading.Lock()
        # no token of this tokenizer spells more characters: a request whose text exceeds
        # max_model_len times this cannot fit, whatever the template adds
        self.max_chars = max_model_len * max((len(t) for t in tokenizer.get_vocab()), default=1)

    # ------------------------------------------------------------------ life

    def start(self) -> str:
        """Serve (once); the base URL."""
        if self.url is not None:
            return self.url
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(self._serve())
            except BaseException as e:  # noqa: BLE001 — the address taken: raised in the caller
                failure.append(e)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, name="rlkit-endpoint", daemon=True).start()
        ready.wait()
        if failure:
            from rlkit.errors import ConfigError

            raise ConfigError(f"cannot serve on {self.cfg.host}:{self.cfg.port}: {failure[0]} (choose a free port, "
                              "or 0 for any)", "rollout.program.port")
        return self.url

    async def _serve(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/s/{session}/v1/responses", self._responses)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/s/{session}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.cfg.host}:{self.port}"
        if self.unix_path is not None:
            await web.UnixSite(self._runner, self.unix_path).start()
            os.chmod(self.unix_path, 0o777)  # a sandboxed command's throwaway uid connects to it

    def stop(self) -> None:
        if self.loop is None or self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.url = None

    def open(self, batcher: Batcher) -> Session:
        """A new session (thread-safe)."""
        session = Session(secrets.token_hex(8), "rlkit-" + secrets.token_hex(16), batcher)
        with self._lock:
            self.sessions[session.id] = session
            self.by_key[session.key] = session
        return session

    def base_url(self, session: Session) -> str:
        return f"{self.url}/s/{session.id}/v1"

    def close(self, session: Session) -> None:
        """The rollout is over: the session's later requests are refused, and it is forgotten."""
        session.closed = True
        with self._lock:
            self.sessions.pop(session.id, None)
            self.by_key.pop(session.key, None)

    # ------------------------------------------------------------------ requests

    def _session(self, request: Any) -> Session:
        sid = request.match_info.get("session")
        if sid is not None:
            session = self.sessions.get(sid)
        else:
            auth = request.headers.get("Authorization", "")
            session = self.by_key.get(auth.removeprefix("Bearer ").strip())
        if session is None:
            raise RequestError(401 if sid is None else 404, "unknown_session",
                               "no rollout has this session (it ended, or the URL or API key is not rlkit's)")
        return session

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                                "owned_by": "rlkit", "created": 0}]})

    async def _chat(self, request: Any) -> Any:
        return await self._serve_turn(request, responses=False)

    async def _responses(self, request: Any) -> Any:
        return await self._serve_turn(request, responses=True)

    async def _serve_turn(self, request: Any, responses: bool) -> Any:
        """One request of a session, as a Chat Completion or a Response; a refusal is an error body."""
        from aiohttp import web

        t0 = time.perf_counter()
        session = None
        try:
            session = self._session(request)
            if session.lock is None:
                session.lock = asyncio.Lock()
            try:
                body = await request.json()
            except ValueError:
                raise RequestError(400, "malformed", "the request body is not JSON") from None
            async with session.lock:
                if session.closed:
                    raise RequestError(410, "closed", "the rollout is over (its deadline passed)")
                session.requests += 1
                if session.requests > self.cfg.max_requests:
                    raise RequestError(429, "flooded", f"this rollout sent more than rollout.program.max_requests "
                                                       f"({self.cfg.max_requests}) requests")
                chat = responses_to_chat(body, session.responses) if responses else body
                answer, seconds = await self._turn(session, chat)
                if responses:
                    answer = chat_to_response(answer)
                    session.responses[answer["id"]] = session.segments[-1].messages if session.segments else []
            session.served_s += time.perf_counter() - t0 - seconds
        except RequestError as e:
            if session is not None:
                session.refused(e)
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error", "code": e.kind}},
                                     status=e.status)
        if not responses and body.get("stream"):
            options = body.get("stream_options")
            return await self._stream(request, answer, isinstance(options, dict) and bool(options.get("include_usage")))
        return web.json_response(answer)

    async def _turn(self, session: Session, body: Any) -> tuple[dict[str, Any], float]:
        """Render, extend or fork, generate, record; the Chat Completion and the engines' seconds."""
        from jinja2 import TemplateError

        messages, tools = check_request(body, self.cfg.sampling, self.recipe, session.overridden)
        chars = sum(_text_chars(m.get("content")) for m in messages)
        if chars > self.max_chars:  # refused before the template renders and the tokenizer reads it
            raise RequestError(400, "context_length_exceeded", f"the conversation holds {chars} characters, more "
                               f"than {self.max_model_len} tokens (rollout.max_model_len) can spell")
        try:  # off the loop: a long render or tokenization delays no other session's request
            ids = await asyncio.to_thread(self._render, messages, tools)
        except (TemplateError, TypeError, ValueError, KeyError) as e:
            raise RequestError(400, "malformed", "the policy's chat template cannot render these messages: "
                               f"{' '.join(str(e).split())[:200]}") from None
        if len(ids) >= self.max_model_len:
            raise RequestError(400, "context_length_exceeded", f"the conversation is {len(ids)} tokens; the engines "
                               f"hold {self.max_model_len} (rollout.max_model_len) with the answer")
        seg = session.segments[-1] if session.segments else None
        history = seg.history if seg is not None else []
        if seg is not None and len(ids) > len(history) and ids[:len(history)] == history:
            new = ids[len(history):]
            budget = min(self.max_tokens - len(seg.completion_ids) - len(new), self.max_model_len - len(ids))
        else:
            if seg is not None:
                session.forks += 1
            seg, new = None, []
            budget = min(self.max_tokens, self.max_model_len - len(ids))
        if budget <= 0:  # the sample's completion budget is spent: the turn is not taken (TRL's rollback)
            return completion(self._ident(session), [], "", "length", 0, len(ids)), 0.0
        t0 = time.perf_counter()
        sample, _ = await session.batcher(ids, budget)
        seconds = time.perf_counter() - t0  # waiting for the engines (and for the others' requests)
        if seg is None:
            seg = Segment(ids)
            session.segments.append(seg)
        else:
            seg.append(new)
        sampled = list(sample.token_ids[:budget])
        seg.append(sampled, list(sample.logprobs[:budget]))
        seg.finish = "length" if len(sampled) < len(sample.token_ids) else sample.finish_reason
        seg.turns += 1
        message = self._parse(sampled, ids, tools)
        seg.tool_calls += len(message.get("tool_calls") or ())
        finish = "length" if seg.finish == "length" else "tool_calls" if message.get("tool_calls") else "stop"
        answer = completion(self._ident(session), message.get("tool_calls") or [], message.get("content") or "",
                            finish, len(sampled), len(ids))
        seg.messages = messages + [answer["choices"][0]["message"]]
        return answer, seconds

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The request's prompt tokens: its messages and tools through the policy's chat template."""
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def _parse(self, sampled: list[int], prefix: list[int], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The model's turn as a chat message (transformers' response parsing, as the turn loop)."""
        from trl.chat_template_utils import parse_response

        if not sampled:
            return {}
        try:
            return parse_response(self.tokenizer, sampled, prefix=prefix, tools=tools or None) or {}
        except Exception:  # noqa: BLE001 — a turn the parser cannot read is its text
            return {"role": "assistant", "content": self.tokenizer.decode(sampled, skip_special_tokens=True)}

    @staticmethod
    def _ident(session: Session) -> str:
        """The turn's id: the session's and its count of turns."""
        return f"{session.id}_{sum(s.turns for s in session.segments)}"

    async def _stream(self, request: Any, answer: dict[str, Any], include_usage: bool = False) -> Any:
        """The answer as server-sent chunks (the whole turn is generated first), its usage last
        when the request's `stream_options` asks for it."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in chunks(answer, include_usage):
            await response.write(chunk)
        await response.write_eof()
        return response


def _text_chars(content: Any) -> int:
    """The characters of a message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict))
    return 0
