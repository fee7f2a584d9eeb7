"""An OpenAI-compatible HTTP server over a `jspec.Engine` (Starlette; uvicorn runs it).

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
"stream": true, ending with `data: [DONE]`), GET /v1/models, /health and /metrics
(Prometheus text). A bad request gets a 4xx with OpenAI's error object
({"error": {"message", "type", "param", "code"}}) naming the field; a full queue gets 429
with Retry-After. A client that disconnects cancels its request, which frees its row.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from typing import Any

from jspec.serve.engine import Engine, QueueFull

# request field -> the engine's sampling argument (OpenAI's names; top_k, min_p and
# repetition_penalty as vLLM and SGLang accept them)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty", "seed": "seed"}
# fields OpenAI clients send that change nothing here
IGNORED_FIELDS = {"model", "stream", "stream_options", "user", "prompt", "messages", "max_tokens",
                  "max_completion_tokens", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "echo",
                  "best_of", "suffix", "logit_bias", "ignore_eos"} | set(SAMPLING_FIELDS)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _field_of(message: str, names) -> str | None:
    """The request field an engine error names (its message starts with the argument)."""
    for name in names:
        if message.startswith(name) or f" {name}" in message:
            return name
    return None


class Server:
    """The routes over one engine. model_name: what /v1/models lists and requests must name."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.started = time.time()
        self.tokens_window: list[tuple[float, int]] = []

    # ------------------------------------------------------------------ parsing

    def parse(self, body: Any, chat: bool) -> tuple[Any, dict, bool]:
        """A request body -> (prompt, submit keyword arguments, stream); BadRequest for
        anything the engine cannot do."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                             404, "model_not_found")
        for name, bad, why in (("n", lambda v: v not in (None, 1), "only n=1 is supported"),
                               ("best_of", lambda v: v not in (None, 1), "only best_of=1 is supported"),
                               ("logprobs", lambda v: v not in (None, False, 0), "logprobs are not supported"),
                               ("top_logprobs", lambda v: v not in (None, 0), "logprobs are not supported"),
                               ("echo", lambda v: v not in (None, False), "echo is not supported"),
                               ("suffix", lambda v: v is not None, "suffix is not supported"),
                               ("logit_bias", lambda v: v not in (None, {}), "logit_bias is not supported"),
                               ("tools", lambda v: v not in (None, []), "tools are not supported"),
                               ("tool_choice", lambda v: v not in (None, "none"), "tools are not supported"),
                               ("response_format", lambda v: v not in (None, {"type": "text"}),
                                "response formats other than text are not supported")):
            if bad(body.get(name)):
                raise BadRequest(why, name)
        unknown = sorted(set(body) - IGNORED_FIELDS - {"tools", "tool_choice", "response_format"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
        if chat:
            prompt = self.chat_prompt(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
                raise BadRequest("prompt must be a string or a list of token ids (one prompt a request)", "prompt")
            if not isinstance(prompt, (str, list)) or not prompt:
                raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(16 if not chat else self.engine.max_new_tokens, self.engine.max_new_tokens)
        kw: dict[str, Any] = {"max_new_tokens": max_tokens}
        for field, arg in SAMPLING_FIELDS.items():
            v = body.get(field)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise BadRequest(f"{field} must be a number, got {v!r}", field)
                kw[arg] = v
        for field in ("top_k", "seed"):
            if field in kw:
                if kw[field] != int(kw[field]):
                    raise BadRequest(f"{field} must be an integer, got {kw[field]!r}", field)
                kw[field] = int(kw[field])
        if kw.get("top_k") == -1:  # vLLM's "off"
            kw["top_k"] = 0
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise BadRequest("stop must be a non-empty string or a list of them", "stop")
            kw["stop"] = stops
        ids = body.get("stop_token_ids")
        if ids is not None:
            kw["stop_token_ids"] = ids
        if body.get("ignore_eos"):
            kw["stop_token_ids"] = kw.get("stop_token_ids", [])
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be true or false", "stream")
        return prompt, kw, stream

    def chat_prompt(self, messages) -> str:
        tok = self.engine.params.tokenizer
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects with string content",
                             "messages")
        if tok is None or not getattr(tok, "chat_template", None):
            raise BadRequest("this model has no chat template: use /v1/completions", "messages")
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001  (a template that rejects these messages)
            raise BadRequest(f"the chat template rejected these messages: {err}", "messages") from None

    def submit(self, prompt, kw: dict):
        try:
            return self.engine.submit(prompt, **kw)
        except QueueFull as err:
            raise BadRequest(str(err), None, 429, "queue_full") from None
        except (ValueError, TypeError) as err:
            msg = str(err)
            fields = {"max_new_tokens": "max_tokens", "prompt": "prompt", "stop_token_ids": "stop_token_ids",
                      "stop": "stop", **SAMPLING_FIELDS}
            field = _field_of(msg, fields)
            msg = msg.replace("max_new_tokens", "max_tokens")
            raise BadRequest(msg, fields.get(field, field)) from None

    # ------------------------------------------------------------------ responses

    def record(self, tokens: int) -> None:
        now = time.time()
        self.tokens_window.append((now, tokens))
        self.tokens_window = [(t, n) for t, n in self.tokens_window if now - t < 10.0]

    def metrics(self) -> str:
        e = self.engine
        now = time.time()
        recent = sum(n for t, n in self.tokens_window if now - t < 10.0) / 10.0
        s = e.stats
        tau = s["accept_tokens"] / s["accept_rounds"] if s["accept_rounds"] else 1.0
        steps = e.spec.num_steps if e.spec is not None else 0
        lines = [("jspec_requests_running", "gauge", "requests in the batch", e.running),
                 ("jspec_requests_waiting", "gauge", "requests waiting for a row", e.waiting),
                 ("jspec_batch_occupancy", "gauge", "share of the batch's rows in use", e.running / e.batch),
                 ("jspec_generated_tokens_total", "counter", "tokens generated", s["tokens"]),
                 ("jspec_requests_finished_total", "counter", "requests finished", s["finished"]),
                 ("jspec_requests_cancelled_total", "counter", "requests cancelled", s["cancelled"]),
                 ("jspec_tokens_per_second", "gauge", "tokens generated a second over the last 10 s", recent),
                 ("jspec_mean_accept_length", "gauge", "tokens committed per verify round", tau),
                 ("jspec_speculation_steps", "gauge", "draft steps a round in use (0: plain decoding)", steps)]
        out = []
        for name, kind, help_text, value in lines:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        out += ["# HELP jspec_speculation_tier the speculation tier in use (1), S,K,N or plain",
                "# TYPE jspec_speculation_tier gauge"]
        out += [f'jspec_speculation_tier{{tier="{t}"}} {int(t == e.tier)}' for t in s["tier_chunks"]]
        out += ["# HELP jspec_tier_chunks_total chunks of rounds run on each speculation tier",
                "# TYPE jspec_tier_chunks_total counter"]
        out += [f'jspec_tier_chunks_total{{tier="{t}"}} {n}' for t, n in s["tier_chunks"].items()]
        return "\n".join(out) + "\n"


def build_app(engine: Engine, model_name: str):
    """The Starlette app serving `engine` (started and closed with the app)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    server = Server(engine, model_name)

    def error(err: BadRequest) -> JSONResponse:
        kind = "rate_limit_error" if err.status == 429 else "invalid_request_error"
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return JSONResponse(error_body(err.message, err.param, kind, err.code), status_code=err.status,
                            headers=headers)

    async def completion(request: Request, chat: bool):
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
                raise BadRequest("the request body is not valid JSON") from None
            prompt, kw, stream = server.parse(body, chat)
            handle = server.submit(prompt, kw)
        except BadRequest as err:
            return error(err)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage(out):
            n = len(out.tokens)
            return {"prompt_tokens": out.prompt_tokens, "completion_tokens": n, "total_tokens": out.prompt_tokens + n}

        def reason(out):
            return {"cancelled": "abort", "cache_full": "length"}.get(out.finish_reason, out.finish_reason)

        if stream:
            async def events():
                try:
                    first = True
                    async for tokens, text in handle.stream():
                        server.record(len(tokens))
                        if chat:
                            delta = {"role": "assistant", "content": text or ""} if first else {"content": text or ""}
                            choice = {"index": 0, "delta": delta, "finish_reason": None}
                        else:
                            choice = {"index": 0, "text": text or "", "finish_reason": None, "logprobs": None}
                        first = False
                        yield _sse({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                    "model": model_name, "choices": [choice]})
                    out = handle.output
                    last = ({"index": 0, "delta": {}, "finish_reason": reason(out)} if chat else
                            {"index": 0, "text": "", "finish_reason": reason(out), "logprobs": None})
                    yield _sse({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                "model": model_name, "choices": [last], "usage": usage(out)})
                    yield "data: [DONE]\n\n"
                finally:
                    handle.cancel()  # a client that left: its row is freed (no-op once finished)
            return StreamingResponse(events(), media_type="text/event-stream")

        waiter = asyncio.ensure_future(handle.wait())
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.5)
            if not waiter.done() and await request.is_disconnected():
                handle.cancel()
        out = waiter.result()
        server.record(len(out.tokens))
        text = out.text if out.text is not None else ""
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason(out)}
                  if chat else {"index": 0, "text": text, "finish_reason": reason(out), "logprobs": None})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [choice], "usage": usage(out)})

    async def completions(request):
        return await completion(request, chat=False)

    async def chat_completions(request):
        return await completion(request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model",
                                                         "created": int(server.started), "owned_by": "jspec"}]})

    async def health(request):
        return JSONResponse({"status": "ok", "running": engine.running, "waiting": engine.waiting})

    async def metrics(request):
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.close()  # after uvicorn's graceful stop (SIGINT, SIGTERM): what is left is cancelled

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)],
                     lifespan=lifespan)


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, allow_nan=False, default=lambda v: None if isinstance(v, float) and
                                 math.isnan(v) else str(v)) + "\n\n"
