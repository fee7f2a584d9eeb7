"""An OpenAI-compatible HTTP server over a `jspec.Engine` (Starlette; uvicorn runs it).

Routes: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
"stream": true, ending with `data: [DONE]`), GET /v1/models and /v1/models/{id}, /health
and /metrics (Prometheus, vLLM's metric names under `jspec:`), and vLLM's tokenizer routes
POST /tokenize (a prompt, or chat messages rendered with the template), POST /detokenize
and GET /tokenizer_info (lm-eval's remote tokenizer reads them).

Request bodies are typed (`jspec.serve.protocol`): a bad field is a 400 with OpenAI's
error object ({"error": {"message", "type", "param", "code"}}) naming it; unknown fields
are ignored with a warning line. Completions take a prompt as a string, a list of strings,
token ids or a list of id lists, and return the choices in order (prompt by prompt, n
each). `echo` returns the prompt's text (and, with `logprobs`, its tokens' logprobs, the
first null), `logprobs` 0-20 the target's log-probabilities of each token and its top
alternatives; chat takes `logprobs` and `top_logprobs`. `n` (up to 16) independent
samples; `stream_options.include_usage` adds a last chunk with the usage. A full queue is
a 429 with Retry-After; an engine fault a 500 (a stream gets an error event, then
[DONE]), and /health answers 503 from then on. With an API key every /v1 route needs
`Authorization: Bearer KEY`. A client that disconnects cancels its requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from typing import Any

from jspec import requests as rq
from jspec.serve.engine import Engine, EngineError, QueueFull
from jspec.serve.protocol import (
    BadRequest,
    asks_structure,
    constraint_of,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_prompt,
    completion_prompts,
    parse,
    unknown_fields,
)
from jspec.serve.tiers import tier_name

log = logging.getLogger("jspec.serve")

# request field -> the engine's argument (OpenAI's names; vLLM's extras)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
FINISH = {"cancelled": "abort", "cache_full": "length"}  # the engine's reasons OpenAI names otherwise
DEFAULT_TEMPERATURE = 1.0  # OpenAI's (and vLLM's without a generation config)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def child_seed(seed: int, j: int) -> int:
    """The seed of a request's j-th sample (n > 1): the request's own for the first."""
    return seed if j == 0 else (seed + j * 0x9E3779B1) % rq.SEED_RANGE


class Server:
    """The routes' logic over one engine. model_name: what /v1/models lists and requests
    must name; chat_template: a template to use instead of the tokenizer's."""

    def __init__(self, engine: Engine, model_name: str, chat_template: str | None = None,
                 default_max_tokens: int | None = None):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.default_max_tokens = default_max_tokens or engine.max_new_tokens
        self.tokenizer = engine.params.tokenizer
        self.started = time.time()

    # ------------------------------------------------------------------ requests

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise BadRequest(f"model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                             404, "model_not_found")

    def prompts(self, req, chat: bool) -> list[list[int]]:
        if chat:
            return [chat_prompt(req.messages, req, self.tokenizer, self.chat_template, req.add_special_tokens)]
        return completion_prompts(req, self.tokenizer)

    def submit_kwargs(self, req, chat: bool) -> dict:
        """The engine's arguments for each sample of a request (seed: the first sample's)."""
        max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # (cut to each prompt's room in `submit`)
            max_tokens = self.default_max_tokens if chat else min(16, self.default_max_tokens)
        kw: dict[str, Any] = {"max_new_tokens": max(max_tokens, 1), "min_tokens": min(req.min_tokens,
                                                                                     max(max_tokens, 1)),
                              "speculative": req.speculative, "skip_special_tokens": req.skip_special_tokens,
                              "include_stop_str_in_output": req.include_stop_str_in_output}
        for name in SAMPLING_FIELDS:
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        kw.setdefault("temperature", DEFAULT_TEMPERATURE)
        if kw.get("top_k") == -1:  # vLLM's "off"
            kw["top_k"] = 0
        kw["seed"] = req.seed if req.seed is not None else rq.fresh_seed()
        if req.stop:
            kw["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
            if not all(kw["stop"]):
                raise BadRequest("stop strings must not be empty", "stop")
        eos = [] if req.ignore_eos else rq.stop_ids(self.engine.params, None, 1)[0]
        kw["stop_token_ids"] = sorted(set(eos) | set(req.stop_token_ids or ()))
        if chat:
            kw["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        else:
            kw["logprobs"] = req.logprobs
            kw["prompt_logprobs"] = req.logprobs if req.echo and req.logprobs is not None else None
        return kw

    def submit(self, req, chat: bool) -> list:
        """Submits every sample of every prompt -> [(prompt ids, handle)] in choice order."""
        prompts = self.prompts(req, chat)
        kw = self.submit_kwargs(req, chat)
        kw["constraint"], constraint_field = constraint_of(req)
        seed = kw.pop("seed")
        given = (req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens)
        handles = []
        try:
            for ids in prompts:
                each = kw
                if given is None:  # the default, within the prompt's room (max_model_len less the prompt)
                    m = max(min(kw["max_new_tokens"], self.engine.max_len - len(ids)), 1)
                    each = kw | {"max_new_tokens": m, "min_tokens": min(kw["min_tokens"], m)}
                for j in range(req.n):
                    handles.append((ids, self.engine.submit(ids, seed=child_seed(seed, j), **each)))
        except QueueFull as err:
            self.cancel(handles)
            raise BadRequest(str(err), None, 429, "queue_full") from None
        except EngineError as err:
            self.cancel(handles)
            raise BadRequest(str(err), None, 503, "engine_error") from None
        except (ValueError, TypeError) as err:
            self.cancel(handles)
            msg = str(err).replace("max_new_tokens", "max_tokens")
            fields = ("prompt", "max_tokens", "stop_token_ids", "stop", "min_tokens", "logprobs", "prompt_logprobs",
                      *SAMPLING_FIELDS)
            field = next((f for f in fields if msg.startswith(f)), None) or next(
                (f for f in fields if f" {f}" in msg), None)
            if msg.startswith(("constraint", "Json", "Regex", "Choice")):  # compiling the constraint for the vocabulary
                field = constraint_field
            raise BadRequest(msg, "logprobs" if field == "prompt_logprobs" else field) from None
        return handles

    @staticmethod
    def cancel(handles) -> None:
        for _, h in handles:
            h.cancel()

    # ------------------------------------------------------------------ responses

    @functools.lru_cache(maxsize=65536)  # noqa: B019  (one server a process; ids are few)
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def completion_logprobs(self, lps: list, offset: int) -> dict:
        """OpenAI's completions logprobs of `TokenLogprob`s (None: a position with none),
        text offsets from `offset`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            if lp is None:  # the prompt's first token
                continue
            text = self.token_text(lp.token)
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def echo_logprobs(self, prompt: list[int], prompt_lps: list | None, lps: list) -> dict:
        """Completions logprobs with the prompt's tokens first (the first has none)."""
        first = self.token_text(prompt[0])
        rest = self.completion_logprobs([*(prompt_lps or [None])[1:], *lps], len(first))
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}

    def chat_logprobs(self, lps: list, k: int) -> dict:
        def entry(token: int, lp: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top[:k]])
                            for lp in lps]}

    def prompt_text(self, prompt: list[int]) -> str:
        return self.tokenizer.decode(prompt) if self.tokenizer is not None else ""


def finish_reason(reason: str) -> str:
    return FINISH.get(reason, reason)


def usage(prompts: list[list[int]], outputs: list) -> dict:
    """Prompt tokens counted once a prompt (not once a sample), completion tokens of all."""
    p = sum(len(x) for x in prompts)
    c = sum(outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, allow_nan=False, default=lambda v: None if isinstance(v, float) and
                                 math.isnan(v) else str(v)) + "\n\n"


def metrics_collector(engine: Engine):
    """A Prometheus collector reading the engine's statistics at each scrape."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self):
            s = engine.stats
            yield GaugeMetricFamily("jspec:num_requests_running", "Requests in the batch's rows.",
                                    value=engine.running)
            yield GaugeMetricFamily("jspec:num_requests_waiting", "Requests waiting for a row.", value=engine.waiting)
            yield GaugeMetricFamily("jspec:kv_cache_usage_perc", "Share of the cache's pages the requests in rows "
                                    "hold (1 = full).", value=engine.kv_cache_usage())
            for name, doc, value in (
                    ("prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens),
                    ("generation_tokens", "Tokens generated.", s.generation_tokens),
                    ("num_preemptions", "Requests preempted (their rows taken back for want of pages; each resumes).",
                     s.num_preemptions),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
                    ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens)):
                yield CounterMetricFamily(f"jspec:{name}", doc, value=value)
            success = CounterMetricFamily("jspec:request_success", "Requests finished, by finish reason.",
                                          labels=["finished_reason"])
            for reason, n in sorted(s.finish_reasons.items()):
                success.add_metric([reason], n)
            yield success
            for name, doc, h in (
                    ("time_to_first_token_seconds", "Time to the first token.", s.ttft),
                    ("time_per_output_token_seconds", "Time per output token after the first.", s.tpot),
                    ("e2e_request_latency_seconds", "Time from arrival to the end.", s.e2e),
                    ("request_queue_time_seconds", "Time waiting for a row.", s.queue_time),
                    ("spec_decode_accept_length", "Tokens a verify round commits per row (root included).",
                     s.accept_length)):
                yield HistogramMetricFamily(f"jspec:{name}", doc, buckets=h.cumulative(), sum_value=h.sum)
            tier = GaugeMetricFamily("jspec:speculation_tier", "The speculation tier in use (1).", labels=["tier"])
            chunks = CounterMetricFamily("jspec:tier_chunks", "Chunks of rounds run on each tier.", labels=["tier"])
            for t, n in s.tier_chunks.items():
                tier.add_metric([t], int(t == engine.tier))
                chunks.add_metric([t], n)
            yield tier
            yield chunks
            yield GaugeMetricFamily("jspec:mean_accept_length", "Tokens committed per verify round, all rounds.",
                                    value=s.mean_accept_length)

    return Collector()


def build_app(engine: Engine, model_name: str, *, api_key: str | None = None, chat_template: str | None = None,
              default_max_tokens: int | None = None):
    """The Starlette app serving `engine` (started and closed with the app).
    default_max_tokens: a chat request's max_tokens when it gives none (a completion's: at
    most 16, as OpenAI's), within each prompt's room; None: the engine's max_new_tokens."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    server = Server(engine, model_name, chat_template, default_max_tokens)
    registry = CollectorRegistry()
    registry.register(metrics_collector(engine))

    def error(err: BadRequest, path: str, t0: float) -> JSONResponse:
        kind = {429: "rate_limit_error", 401: "authentication_error", 404: "not_found_error" if err.param != "model"
                else "invalid_request_error", 503: "service_unavailable", 500: "internal_server_error"}.get(
            err.status, "invalid_request_error")
        headers = {"Retry-After": "1"} if err.status == 429 else None
        log.warning("%s %d %.3fs: %s%s", path, err.status, time.perf_counter() - t0, err.message,
                    f" (param {err.param})" if err.param else "")
        return JSONResponse(error_body(err.message, err.param, kind, err.code), status_code=err.status,
                            headers=headers)

    def access(path: str, status: int, prompt: int, completion: int, t0: float) -> None:
        log.info("%s %d prompt_tokens=%d completion_tokens=%d %.3fs", path, status, prompt, completion,
                 time.perf_counter() - t0)

    async def completion(request: Request, chat: bool):
        t0, path = time.perf_counter(), request.url.path
        try:
            req = parse(ChatCompletionRequest if chat else CompletionRequest, await request.body())
            server.check_model(req.model)
            extra = unknown_fields(req)
            if extra:
                log.warning("%s: ignoring unknown fields %s", path, ", ".join(extra))
            if asks_structure(req):  # compiling a new constraint may take seconds: not on the event loop
                handles = await asyncio.to_thread(server.submit, req, chat)
            else:
                handles = server.submit(req, chat)
        except BadRequest as err:
            return error(err, path, t0)
        prompts = [ids for ids, _ in handles[::req.n]]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        zero = (req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens) == 0
        echo = (not chat) and req.echo
        k = (req.top_logprobs or 0) if chat else req.logprobs

        def text_of(out) -> str:
            return "" if zero or out.text is None else out.text

        if req.stream:
            return StreamingResponse(stream(request, req, handles, prompts, rid, created, obj, chat, zero, echo, k,
                                            t0, path), media_type="text/event-stream")

        waiter = asyncio.ensure_future(asyncio.gather(*(h.wait() for _, h in handles)))
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.5)
            if not waiter.done() and await request.is_disconnected():
                server.cancel(handles)
        outs = waiter.result()
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:
            return error(BadRequest(f"the engine failed: {failed.error}", None, 500, "engine_error"), path, t0)
        choices = []
        for i, ((ids, _), out) in enumerate(zip(handles, outs)):
            lps = [] if zero else (out.logprobs or [])
            text = text_of(out)
            if chat:
                choice = {"index": i, "message": {"role": "assistant", "content": text},
                          "logprobs": server.chat_logprobs(lps, k) if req.logprobs else None,
                          "finish_reason": finish_reason(out.finish_reason)}
            else:
                prefix = server.prompt_text(ids) if echo else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs = (server.echo_logprobs(ids, out.prompt_logprobs, lps) if echo else
                                server.completion_logprobs(lps, 0))
                choice = {"index": i, "text": prefix + text, "logprobs": logprobs,
                          "finish_reason": "length" if zero else finish_reason(out.finish_reason)}
            choices.append(choice)
        counts = [0 if zero else len(o.tokens) for o in outs]
        access(path, 200, sum(len(p) for p in prompts), sum(counts), t0)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                             "usage": usage(prompts, counts)})

    async def stream(request, req, handles, prompts, rid, created, obj, chat, zero, echo, k, t0, path):
        """Server-sent events: each choice's deltas as they come, its end, the usage if
        asked, [DONE]."""
        kind = obj + (".chunk" if chat else "")
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = opts is not None and opts.continuous_usage_stats
        counts = [0] * len(handles)
        offsets = [0] * len(handles)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            try:
                async for delta in h.stream():
                    await queue.put((i, delta, None))
                await queue.put((i, None, h.output))
            except Exception as err:  # noqa: BLE001
                await queue.put((i, None, err))

        def chunk(choices, with_usage=False):
            body = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices}
            if with_usage or continuous:
                body["usage"] = usage(prompts, counts)
            return _sse(body)

        tasks = []
        status = 200
        try:
            for i, (ids, _) in enumerate(handles):  # the first chunk of each choice
                if chat:
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                elif echo:
                    lps = server.echo_logprobs(ids, None, []) if req.logprobs is not None else None
                    text = server.prompt_text(ids)
                    offsets[i] = len(text)
                    yield chunk([{"index": i, "text": text, "logprobs": lps, "finish_reason": None}])
            tasks = [asyncio.ensure_future(pump(i, h)) for i, (_, h) in enumerate(handles)]
            open_choices = len(handles)
            while open_choices:
                i, delta, end = await queue.get()
                if delta is not None:
                    if zero or not (delta.tokens or delta.text):
                        continue
                    counts[i] += len(delta.tokens)
                    lps = delta.logprobs or []
                    if chat:
                        choice = {"index": i, "delta": {"content": delta.text or ""},
                                  "logprobs": server.chat_logprobs(lps, k) if req.logprobs else None,
                                  "finish_reason": None}
                    else:
                        logprobs = server.completion_logprobs(lps, offsets[i]) if req.logprobs is not None else None
                        offsets[i] += len(delta.text or "")
                        choice = {"index": i, "text": delta.text or "", "logprobs": logprobs, "finish_reason": None}
                    yield chunk([choice])
                    continue
                open_choices -= 1
                if isinstance(end, BaseException) or end.finish_reason == "error":
                    status = 500
                    message = f"the engine failed: {end.error if not isinstance(end, BaseException) else end}"
                    log.warning("%s 500 (stream) %.3fs: %s", path, time.perf_counter() - t0, message)
                    yield _sse(error_body(message, None, "internal_server_error", "engine_error"))
                    server.cancel(handles)
                    break
                reason = "length" if zero else finish_reason(end.finish_reason)
                last = ({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason} if chat else
                        {"index": i, "text": "", "logprobs": None, "finish_reason": reason})
                yield chunk([last])
            if status == 200 and include_usage:
                yield chunk([], with_usage=True)
            yield "data: [DONE]\n\n"
            if status == 200:
                access(path, 200, sum(len(p) for p in prompts), sum(counts), t0)
        finally:
            for t in tasks:
                t.cancel()
            server.cancel(handles)  # a client that left: its rows are freed (no-op once finished)

    async def completions(request):
        return await completion(request, chat=False)

    async def chat_completions(request):
        return await completion(request, chat=True)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(server.started), "owned_by": "jspec",
                "max_model_len": engine.max_len}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):
        name = request.path_params["name"]
        if name != model_name:
            return error(BadRequest(f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                                    404, "model_not_found"), request.url.path, time.perf_counter())
        return JSONResponse(model_card())

    async def tokenize(request):
        t0 = time.perf_counter()
        try:
            req = parse(TokenizeRequest, await request.body())
            server.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise BadRequest("give either prompt or messages", "prompt")
            if server.tokenizer is None:
                raise BadRequest("this model has no tokenizer", "prompt")
            if req.messages is not None:
                ids = chat_prompt(req.messages, req, server.tokenizer, server.chat_template, False)
            else:
                ids = list(server.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        except BadRequest as err:
            return error(err, request.url.path, t0)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_len,
                             "tokens": ids})

    async def detokenize(request):
        t0 = time.perf_counter()
        try:
            req = parse(DetokenizeRequest, await request.body())
            server.check_model(req.model)
            vocab = engine.params.config.vocab_size
            if server.tokenizer is None or any(not 0 <= t < vocab for t in req.tokens):
                raise BadRequest(f"tokens must be ids in [0, {vocab}) of a model with a tokenizer", "tokens")
        except BadRequest as err:
            return error(err, request.url.path, t0)
        return JSONResponse({"prompt": server.tokenizer.decode(req.tokens)})

    async def tokenizer_info(request):
        tok = server.tokenizer
        if tok is None:
            return error(BadRequest("this model has no tokenizer", None, 404), request.url.path, time.perf_counter())
        return JSONResponse({"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
                             "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                             "chat_template": server.chat_template or getattr(tok, "chat_template", None),
                             "model_max_length": engine.max_len})

    async def health(request):
        if not engine.healthy:
            return JSONResponse({"status": "error", "error": engine.error}, status_code=503)
        return JSONResponse({"status": "ok", "running": engine.running, "waiting": engine.waiting,
                             "tier": tier_name(engine.spec)})

    async def metrics(request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.close()  # after uvicorn's graceful stop (SIGINT, SIGTERM): what is left is cancelled

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/v1/models/{name:path}", model),
                            Route("/tokenize", tokenize, methods=["POST"]),
                            Route("/detokenize", detokenize, methods=["POST"]),
                            Route("/tokenizer_info", tokenizer_info),
                            Route("/health", health), Route("/metrics", metrics)],
                    lifespan=lifespan)
    return Authorized(app, api_key) if api_key else app


class Authorized:
    """ASGI wrapper: every /v1 route needs `Authorization: Bearer <key>` (a 401 with
    OpenAI's error object otherwise); /health and /metrics stay open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key
        self.router = getattr(app, "router", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if given != f"Bearer {self.key}":
                from starlette.responses import JSONResponse
                log.warning("%s 401: missing or wrong API key", scope["path"])
                response = JSONResponse(error_body("a valid API key is needed: Authorization: Bearer <key>", None,
                                                   "authentication_error", "invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
