"""The OpenAI-compatible server (`python -m jspec serve`, `jspec.serve.server`), started on
127.0.0.1 with the tiny Llama and an EAGLE-3 head, every program compiled before it
listens, talked to with the official `openai` client:

- completions (prompt as a string, strings, ids or id lists; n samples in order; echo;
  logprobs with the prompt's, as lm-eval's loglikelihood asks, max_tokens 0 and 1) and
  chat (content as parts, system and assistant messages, logprobs), streamed or not,
  each equal to the request run alone, logprobs equal to the target's log-softmax;
- usage in a last chunk only when asked; unknown fields ignored; vLLM's extras; structured
  output (response_format json_schema, structured_outputs regex and choice) equal to the
  request run alone under its constraint; a chat template encoded once (one BOS);
- requests without a seed sample afresh; per-request speculation off;
- errors: 4xx naming the field from the typed models, JSON 404 for an unknown model, 401
  without the API key, 429 when the queue is full, 500 / a stream's error event and a 503
  health check after an engine fault; Prometheus metrics under vLLM's names;
- the CLI starts, logs, serves and stops on SIGTERM; hub ids load from the cache offline.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

import jspec
from conftest import SERVED_ENGINE

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def running_server(engine, name: str, **kw):
    """Serves `engine` from a thread on a free 127.0.0.1 port -> (url, stop())."""
    from jspec.serve.server import build_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, name, **kw), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started

    def stop():
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive()
    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def served(with_draft):
    """(base url, params, engine) of a server running in a thread for this module."""
    params = with_draft("eagle3")
    tokenizer = copy.deepcopy(params.tokenizer)
    tokenizer.chat_template = TEMPLATE
    params = dataclasses.replace(params, tokenizer=tokenizer)
    engine = jspec.Engine(params, **SERVED_ENGINE, max_waiting=32)
    engine.warm_up()
    url, stop = running_server(engine, "tiny")
    yield url, params, engine
    stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


_ALONE: dict = {}


def alone(params, prompt, max_new, **kw):
    """The request run alone (a batch of one), through one compiled program per params."""
    if id(params) not in _ALONE:
        _ALONE[id(params)] = jspec.compile(params, ["x" * 60], max_new_tokens=24, temperature=0.5)
    return _ALONE[id(params)].run(prompt, max_new_tokens=max_new, **({"temperature": 0.0} | kw))


def post(url: str, body, headers=None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def get(url: str, headers=None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def log_softmax(params, ids):
    return np.asarray(jax.nn.log_softmax(jspec.logits(params.with_draft(None), [ids])[0], axis=-1))


def test_completion_chat_and_stream(served, client):
    _, params, _ = served
    prompt = "def add(a, b):"
    want = alone(params, prompt, 12)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text and out.choices[0].index == 0
    assert out.choices[0].finish_reason == want.finish_reasons
    assert out.usage.completion_tokens == len(want.tokens) and out.usage.prompt_tokens == len(params.tokenizer(
        prompt)["input_ids"])
    pieces = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True, temperature=0))
    assert "".join(p.choices[0].text for p in pieces) == want.text
    assert pieces[-1].choices[0].finish_reason == want.finish_reasons and pieces[-1].usage is None

    messages = [{"role": "system", "content": "go"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "c"}]
    rendered = [{"role": "system", "content": "go"}, {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": ""}, {"role": "user", "content": "c"}]
    ids = params.tokenizer(params.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    want = alone(params, ids, 10, temperature=0.8, seed=7)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.8, seed=7)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                            temperature=0.8, seed=7, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_prompt_forms_n_and_echo_logprobs(served, client):
    """Prompt lists come back in order, n samples each (seeded: reproducible, independent);
    echo with logprobs gives every prompt token's logprob (the first null) and the
    completion's, equal to the target's log-softmax, with max_tokens 1 and 0 (lm-eval)."""
    _, params, _ = served
    tok = params.tokenizer
    texts = ["import os\n", "class A:"]
    out = client.completions.create(model="tiny", prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [alone(params, t, 6).text for t in texts]
    ids = [tok(t)["input_ids"] for t in texts]
    assert [c.text for c in client.completions.create(model="tiny", prompt=ids, max_tokens=6,
                                                      temperature=0).choices] == [c.text for c in out.choices]
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == out.choices[0].text
    sampled = client.completions.create(model="tiny", prompt=texts, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert [c.index for c in sampled.choices] == list(range(6))
    again = client.completions.create(model="tiny", prompt=texts, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]
    assert len({c.text for c in sampled.choices[:3]}) > 1  # independent samples of one prompt
    assert sampled.usage.prompt_tokens == sum(len(i) for i in ids)
    assert sampled.choices[0].text == alone(params, texts[0], 8, temperature=1.0, seed=11).text

    for max_tokens in (1, 0):
        r = client.completions.create(model="tiny", prompt=texts[1], max_tokens=max_tokens, temperature=0,
                                      echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        full = ids[1] + alone(params, texts[1], 1).tokens[:max_tokens]
        ref = log_softmax(params, full)
        assert r.choices[0].text == texts[1] + (alone(params, texts[1], 1).text if max_tokens else "")
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(full)
        np.testing.assert_allclose(lp.token_logprobs[1:], [ref[j - 1, full[j]] for j in range(1, len(full))],
                                   atol=1e-4)
        for j in range(1, len(full)):  # the top alternative and the token itself are listed
            assert max(lp.top_logprobs[j].values()) == pytest.approx(ref[j - 1].max(), abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert r.usage.completion_tokens == max_tokens


def test_chat_logprobs_extras_and_speculation_off(served, client):
    _, params, engine = served
    messages = [{"role": "user", "content": "x ="}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    ids = params.tokenizer(params.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    want = alone(params, ids, 6)
    ref = log_softmax(params, ids + want.tokens)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.tokens) and all(len(c.top_logprobs) == 3 for c in content)
    np.testing.assert_allclose([c.logprob for c in content],
                               [ref[len(ids) - 1 + j, t] for j, t in enumerate(want.tokens)], atol=1e-4)
    # Unknown fields are ignored; vLLM's extras are understood; speculation off changes nothing but acceptance.
    rounds = engine.stats.accept_rounds
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "store": True,
            "metadata": {"a": 1}, "colour": 1, "speculative": False, "min_tokens": 4, "skip_special_tokens": True,
            "include_stop_str_in_output": False, "add_special_tokens": True, "ignore_eos": True,
            "stop_token_ids": [], "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
            "response_format": {"type": "text"}, "user": "me"}
    code, out, _ = post(served[0] + "/v1/completions", body)
    assert code == 200 and out["choices"][0]["text"] == alone(params, "def f(x):", 10, stop_token_ids=[],
                                                              min_tokens=4).text
    assert engine.stats.accept_rounds == rounds  # its rounds were not speculative
    # include_stop_str_in_output: the stop string stays in the text.
    text = alone(params, "def f(x):", 10).text
    stop = text[3:5]
    kept = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.find(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"


def test_fresh_seeds_and_usage_options(served, client):
    """Without a seed, identical sampled requests differ; continuous usage stats come with
    every chunk."""
    texts = {client.completions.create(model="tiny", prompt="def", max_tokens=20, temperature=1.0).choices[0].text
             for _ in range(3)}
    assert len(texts) == 3
    chunks = list(client.completions.create(model="tiny", prompt="def", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6


@pytest.mark.parametrize("body,status,param,match", [
    (b"{not json", 400, None, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 25}, 400, "max_tokens", "at most 24"),
    ({"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt", "prompt"),
    ({"model": "tiny", "prompt": []}, 400, "prompt", "prompt"),
    ({"model": "tiny", "prompt": "y" * 400}, 400, "prompt", "prompts of at most 64 tokens"),
    ({"model": "tiny", "prompt": "x", "n": 17}, 400, "n", "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": [3]}, 400, "stop", "stop"),
    ({"model": "tiny", "prompt": "x", "seed": "1"}, 400, "seed", "seed"),
    ({"model": "tiny", "prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format",
     "needs a json_schema"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "nonsense"}}}}, 400, "response_format", "Unsupported type: nonsense"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs",
     "invalid pattern"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"grammar": "root ::= 'a'"}}, 400, "structured_outputs",
     "grammar is not supported"),
    ({"model": "tiny", "prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, 400,
     "guided_regex", "give one"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format",
     "tables hold 63"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages", "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages",
     "only text parts"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools", "not supported"),
], ids=["json", "temperature", "top_p", "max_tokens_negative", "max_tokens_big", "model", "empty", "empty_list",
        "too_long", "n", "logprobs", "stop", "seed_type", "token_id", "suffix", "json_schema_missing",
        "json_schema_bad", "regex_bad", "grammar", "two_constraints", "json_object_too_big", "messages",
        "image", "tools"])
def test_bad_requests_get_4xx(served, body, status, param, match):
    url = served[0]
    route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    code, err, _ = post(url + route, body)
    assert code == status, err
    assert err["error"]["param"] == param and match in err["error"]["message"], err
    assert json.loads(get(url + "/health")[1])["status"] == "ok"


def test_structured_output(served, client):
    """response_format json_schema through the official client (chat), vLLM's
    structured_outputs regex and choice (completions, streamed too): each equals the request
    run alone under the same constraint, and is valid."""
    _, params, _ = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    messages = [{"role": "user", "content": "is it?"}]
    ids = params.tokenizer(params.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "answer", "schema": schema, "strict": True}})
    want = alone(params, ids, 24, constraint=jspec.JsonSchema(schema))
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    assert set(json.loads(want.text)) == {"ok"}
    for extra, constraint in [({"regex": "[0-9]{3}-[a-c]{2}"}, jspec.Regex("[0-9]{3}-[a-c]{2}")),
                              ({"choice": ["left", "right"]}, jspec.Choice(["left", "right"]))]:
        want = alone(params, "go ", 24, constraint=constraint)
        out = client.completions.create(model="tiny", prompt="go ", max_tokens=24, temperature=0,
                                        extra_body={"structured_outputs": extra})
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"
        assert re.fullmatch(constraint.regex(), want.text)
        pieces = list(client.completions.create(model="tiny", prompt="go ", max_tokens=24, temperature=0,
                                                stream=True, extra_body={"structured_outputs": extra}))
        assert "".join(p.choices[0].text for p in pieces) == want.text


def test_models_auth_metrics_and_queue(served, target):
    url, _, engine = served
    code, body = get(url + "/v1/models/tiny")
    assert code == 200 and json.loads(body)["id"] == "tiny"
    code, body = get(url + "/v1/models/nope")
    assert code == 404 and json.loads(body)["error"]["param"] == "model"
    assert post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200  # whatever ran before
    status, metrics = get(url + "/metrics")
    for name in ("jspec:time_to_first_token_seconds_bucket", "jspec:time_per_output_token_seconds_count",
                 "jspec:e2e_request_latency_seconds_sum", "jspec:request_queue_time_seconds_bucket",
                 "jspec:num_requests_running", "jspec:num_requests_waiting", "jspec:kv_cache_usage_perc",
                 "jspec:prompt_tokens_total", "jspec:generation_tokens_total", "jspec:num_preemptions_total",
                 "jspec:prefix_cache_queries_total", "jspec:prefix_cache_hits_total",
                 "jspec:spec_decode_num_draft_tokens_total", "jspec:spec_decode_num_accepted_tokens_total",
                 "jspec:spec_decode_accept_length_bucket", "jspec:request_success_total"):
        assert f"\n{name}" in "\n" + metrics, name
    generated = [line for line in metrics.splitlines() if line.startswith("jspec:generation_tokens_total ")]
    assert float(generated[0].split()[1]) == engine.stats.generation_tokens > 0
    # An API key: /v1 needs it, /health and /metrics do not.
    keyed = jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=4, max_waiting=0)
    url2, stop = running_server(keyed, "small", api_key="sesame")
    try:
        code, err, _ = post(url2 + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert code == 401 and err["error"]["type"] == "authentication_error"
        assert get(url2 + "/v1/models")[0] == 401 and get(url2 + "/health")[0] == 200
        assert get(url2 + "/metrics")[0] == 200
        assert get(url2 + "/v1/models", {"Authorization": "Bearer sesame"})[0] == 200
        code, err, headers = post(url2 + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2},
                                  {"Authorization": "Bearer sesame"})
        assert code == 429 and err["error"]["type"] == "rate_limit_error" and "max_waiting=0" in err["error"]["message"]
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
    finally:
        stop()


def test_tokenizer_routes(served):
    """vLLM's /tokenize (a prompt, or messages through the chat template), /detokenize and
    /tokenizer_info: what lm-eval's remote tokenizer reads."""
    url, params, _ = served
    tok = params.tokenizer
    code, out, _ = post(url + "/tokenize", {"prompt": "def f():", "add_special_tokens": False})
    assert code == 200 and out["tokens"] == tok("def f():", add_special_tokens=False)["input_ids"]
    assert out["count"] == len(out["tokens"])
    code, chat, _ = post(url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert code == 200 and chat["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    code, back, _ = post(url + "/detokenize", {"tokens": out["tokens"]})
    assert code == 200 and back["prompt"] == "def f():"
    assert post(url + "/detokenize", {"tokens": [10 ** 6]})[0] == 400
    assert post(url + "/tokenize", {"prompt": "x", "messages": []})[0] == 400
    code, info = get(url + "/tokenizer_info")
    info = json.loads(info)
    assert code == 200 and info["eos_token"] == tok.eos_token and info["chat_template"] == TEMPLATE


def test_disconnect_cancels_and_frees_the_row(served, client):
    url, _, engine = served
    cancelled = engine.stats.cancelled
    stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=24, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    for _ in range(1200):
        if json.loads(get(url + "/health")[1])["running"] == 0 and engine.stats.cancelled > cancelled:
            break
        time.sleep(0.05)
    assert json.loads(get(url + "/health")[1])["running"] == 0
    assert engine.stats.cancelled == cancelled + 1


def test_engine_fault_fails_requests_and_health(target):
    """A fault in the engine: a waiting non-streamed request gets a 500 with an error
    object, a stream an error event then [DONE]; /health answers 503 and new requests 503."""
    engine = jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=8, rounds_per_chunk=1)
    gate = threading.Event()
    chunk = engine.runner.chunk

    def failing(*args):
        if gate.is_set():
            raise RuntimeError("injected fault")
        return chunk(*args)
    engine.runner.chunk = failing
    url, stop = running_server(engine, "small")
    try:
        results = {}

        def ask():
            results["plain"] = post(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True})
        t = threading.Thread(target=ask)
        t.start()
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"prompt": [4, 5], "max_tokens": 8, "stream": True, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        time.sleep(0.2)
        gate.set()
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
        t.join(timeout=120)
        assert events[-1] == "data: [DONE]" and "injected fault" in events[-2] and '"error"' in events[-2]
        code, err, _ = results["plain"]
        assert code == 500 and "injected fault" in err["error"]["message"]
        code, body = get(url + "/health")
        assert code == 503 and "injected fault" in json.loads(body)["error"]
        assert post(url + "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 503
    finally:
        stop()


def test_chat_template_is_encoded_once(target, tmp_path):
    """A template that writes the BOS token itself, over a tokenizer that adds one: the
    prompt holds one BOS (the template's tokens encoded once), and a --chat-template
    string replaces the tokenizer's."""
    from tokenizers import processors
    tok = copy.deepcopy(target.tokenizer)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok("ab")["input_ids"][0] == 1
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    params = dataclasses.replace(target, tokenizer=tok)
    engine = jspec.Engine(params, max_batch=1, max_prompt_len=16, max_new_tokens=4)
    url, stop = running_server(engine, "bos", chat_template="{{ bos_token }}[{% for m in messages %}"
                                                            "{{ m['content'] }}{% endfor %}]")
    try:
        code, out, _ = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4, "temperature": 0})
        ids = [1] + tok("[hi]", add_special_tokens=False)["input_ids"]
        assert code == 200 and out["usage"]["prompt_tokens"] == len(ids)
        assert out["choices"][0]["message"]["content"] == alone(params, ids, 4).text
    finally:
        stop()


def test_cli_serves_logs_and_stops_on_sigterm(llama_dir, tmp_path):
    """`python -m jspec serve` with a target directory and a --chat-template string compiles
    its programs, logs, answers chat and completions with an API key, refuses a request its
    page pool (`--kv-cache-tokens`) could never hold, serves 8 concurrent requests on 2
    rows whose pages are 1.5 times the pool (preempting), and SIGTERM stops it cleanly
    (exit status 0). The 2-layer target without prefix caching and structured output (both
    are served in-process elsewhere; the bundled pair's 20 layers took 35 s of compiles
    more). (The issue's `--max-len 2048 --kv-cache-tokens 1536 --max-batch 8` with 8
    requests of 700 tokens, scaled down: docs/serving.md has the full-size run.)"""
    import os
    import signal
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    proc = subprocess.Popen([sys.executable, "-m", "jspec", "serve", "--target", llama_dir[0], "--draft", "none",
                             "--chat-template", template, "--port", str(port), "--max-batch", "2",
                             "--max-len", "128", "--max-new-tokens", "8", "--dtype", "float32",
                             "--max-logprobs", "0", "--served-model-name", "bundled", "--kv-cache-tokens", "64",
                             "--no-prefix-cache", "--constraint-states", "0", "--api-key", "k", "--log-level",
                             "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    auth = {"Authorization": "Bearer k"}
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(3000):
            try:
                if json.loads(get(url + "/health")[1])["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.1)
        code, out, _ = post(url + "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 8,
                                                      "temperature": 0}, auth)
        assert code == 200 and out["model"] == "bundled" and out["usage"]["completion_tokens"] == 8
        code, out, _ = post(url + "/v1/chat/completions", {"model": "bundled", "max_tokens": 8, "messages": [
            {"role": "user", "content": "a function that adds two numbers"}]}, auth)
        assert code == 200 and out["choices"][0]["message"]["content"]
        assert post(url + "/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": -1}, auth)[0] == 400
        # A request the page pool (4 pages of 16 tokens) could never hold: a 400 naming the limit.
        code, out, _ = post(url + "/v1/completions", {"prompt": [100] * 100, "max_tokens": 8}, auth)
        assert code == 400 and "page pool holds 4 (64 tokens)" in out["error"]["message"]
        # 8 at once of 8 + 36 tokens (3 pages each; two rows need 6): every one comes back whole.
        body = {"prompt": [3, 100, 7, 3, 5, 9, 11, 2], "max_tokens": 36, "temperature": 0, "ignore_eos": True}
        outs = [None] * 8
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, post(url + "/v1/completions", body, auth)))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert all(o[0] == 200 for o in outs), [o[:2] for o in outs]
        assert all(o[1]["choices"][0]["finish_reason"] == "length" and o[1]["usage"]["completion_tokens"] == 36
                   for o in outs)
        assert len({o[1]["choices"][0]["text"] for o in outs}) == 1  # greedy: the same tokens, preempted or not
        metrics = get(url + "/metrics", auth)[1]
        assert float(metrics.split("\njspec:num_preemptions_total ")[1].split()[0]) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    printed = proc.stdout.read()
    assert "programs compiled in" in printed and "serve: bundled on http://127.0.0.1" in printed
    assert "page pool of 4 pages of 16 tokens (64 tokens, 0.00 GiB)" in printed
    assert "no prefix caching; no structured output" in printed
    assert "/v1/completions 200 prompt_tokens=" in printed and "/v1/completions 400" in printed
    assert "serve: stopped (SIGTERM)" in printed
    bad = subprocess.run([sys.executable, "-m", "jspec", "serve", "--port", "70000"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr


def test_hub_ids_load_from_the_cache_offline(llama_dir, tmp_path):
    """`jspec.load("org/name")` reads huggingface_hub's cache with HF_HUB_OFFLINE=1 (no
    network; a process of its own, as huggingface_hub reads its settings at import): the
    same model as its directory; an id not in the cache is a clear error."""
    import os
    import shutil
    import subprocess
    import sys
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(llama_dir[0], repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    code = ("import jspec, numpy as np\n"
            f"direct = np.asarray(jspec.logits(jspec.load({llama_dir[0]!r}), [[5, 6, 7]]))\n"
            "hub = np.asarray(jspec.logits(jspec.load('tiny-org/tiny-llama'), [[5, 6, 7]]))\n"
            "assert (direct == hub).all()\n"
            "try:\n    jspec.load('tiny-org/missing')\nexcept ValueError as err:\n    print('refused:', err)\n")
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused: 'tiny-org/missing' is not a directory, and as a Hugging Face hub id" in out.stdout
