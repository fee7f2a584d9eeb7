"""The OpenAI-compatible server (`python -m jspec serve`, `jspec.serve.server`), started on
127.0.0.1 with the tiny Llama and an EAGLE-3 head, talked to with the official `openai`
client: completions, chat, streaming, concurrent requests arriving at staggered times
(each equal to the request run alone), cancellation by disconnecting, every bad input
answered with a 4xx error object naming the field, and the server healthy afterwards."""
from __future__ import annotations

import copy
import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import jspec

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def running_server(engine, name: str):
    """Serves `engine` from a thread on a free 127.0.0.1 port -> (url, stop())."""
    from jspec.serve.server import build_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, name), host="127.0.0.1", port=port,
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
    engine = jspec.Engine(params, max_batch=3, max_prompt_len=48, max_new_tokens=24, rounds_per_chunk=2,
                          max_waiting=8)
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
        _ALONE[id(params)] = jspec.compile(params, ["x" * 40], max_new_tokens=24, temperature=0.5)
    return _ALONE[id(params)].run(prompt, max_new_tokens=max_new, **({"temperature": 0.0} | kw))


def post(url: str, body) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def test_completion_chat_and_stream(served, client):
    _, params, _ = served
    prompt = "def add(a, b):"
    want = alone(params, prompt, 12)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reasons
    assert out.usage.completion_tokens == len(want.tokens) and out.usage.prompt_tokens == len(params.tokenizer(
        prompt)["input_ids"])
    pieces = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == want.text
    assert pieces[-1].choices[0].finish_reason == want.finish_reasons

    messages = [{"role": "user", "content": "a loop"}]
    chat_prompt = params.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = alone(params, chat_prompt, 10, temperature=0.8, seed=7)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.8, seed=7)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.8, seed=7,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_staggered_concurrent_requests_equal_alone(served, client):
    _, params, _ = served
    cases = [("import os\n", {}), ("class Stack:", {"temperature": 0.9, "seed": 1}), ("for i in", {}),
             ("x = [", {"temperature": 0.7, "top_p": 0.9, "seed": 2}), ("while True:", {"frequency_penalty": 0.5})]
    results = {}

    def ask(i):
        prompt, kw = cases[i]
        results[i] = client.completions.create(model="tiny", prompt=prompt, max_tokens=9 + i, **kw).choices[0].text
    threads = []
    for i in range(len(cases)):
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        time.sleep(0.05 * i)  # arrivals while earlier requests run
    for t in threads:
        t.join()
    for i, (prompt, kw) in enumerate(cases):
        assert results[i] == alone(params, prompt, 9 + i, **kw).text, i


def test_disconnect_cancels_and_frees_the_row(served, client):
    url, _, engine = served
    cancelled = engine.stats["cancelled"]
    stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=24, stream=True,
                                       stop=None, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    for _ in range(2400):  # up to 2 minutes: the first request of a worker compiles the programs
        if json.loads(get(url + "/health"))["running"] == 0:
            break
        time.sleep(0.05)
    assert json.loads(get(url + "/health")) == {"status": "ok", "running": 0, "waiting": 0}
    assert engine.stats["cancelled"] == cancelled + 1


@pytest.mark.parametrize("body,status,param,match", [
    (b"{not json", 400, None, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be finite"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be in"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 25}, 400, "max_tokens", "at most 24"),
    ({"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt", "prompt"),
    ({"model": "tiny", "prompt": "y" * 400}, 400, "prompt", "prompts of at most 48 tokens"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n", "only n=1"),
    ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs", "not supported"),
    ({"model": "tiny", "prompt": "x", "stop": [3]}, 400, "stop", "stop must be"),
    ({"model": "tiny", "prompt": "x", "seed": "1"}, 400, "seed", "must be a number"),
    ({"model": "tiny", "prompt": "x", "colour": 1}, 400, "colour", "unknown field"),
    ({"model": "tiny", "prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    ({"model": "tiny", "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
], ids=["json", "temperature", "top_p", "max_tokens0", "max_tokens_big", "model", "empty", "too_long", "n",
        "logprobs", "stop", "seed_type", "unknown", "token_id", "tools"])
def test_bad_requests_get_4xx(served, body, status, param, match):
    url = served[0]
    code, err, _ = post(url + "/v1/completions", body)
    assert code == status, err
    assert err["error"]["param"] == param and match in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    assert json.loads(get(url + "/health"))["status"] == "ok"


def test_chat_errors_queue_full_and_metrics(served, target):
    url, params, engine = served
    code, err, _ = post(url + "/v1/chat/completions", {"model": "tiny", "messages": "hi"})
    assert code == 400 and err["error"]["param"] == "messages"
    from jspec.serve.server import BadRequest, Server
    plain = Server(jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=4, max_waiting=0), "t")
    with pytest.raises(BadRequest, match="no chat template") as info:
        plain.parse({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert info.value.param == "messages" and info.value.status == 400
    with pytest.raises(BadRequest, match="max_waiting=0") as info:
        plain.submit([1, 2], {"max_new_tokens": 2})
    assert info.value.status == 429
    metrics = get(url + "/metrics")
    for name in ("jspec_requests_running", "jspec_requests_waiting", "jspec_tokens_per_second",
                 "jspec_mean_accept_length", "jspec_speculation_steps", "jspec_batch_occupancy"):
        assert f"\n{name} " in "\n" + metrics
    steps = [line for line in metrics.splitlines() if line.startswith("jspec_speculation_steps ")]
    assert steps == [f"jspec_speculation_steps {engine.plan.spec.num_steps}"]
    tier = engine.tier
    assert f'jspec_speculation_tier{{tier="{tier}"}} 1' in metrics
    assert f'jspec_tier_chunks_total{{tier="{tier}"}} {engine.stats["tier_chunks"][tier]}' in metrics


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    """`python -m jspec serve` with the bundled pair answers /health and a completion, and
    SIGTERM stops it cleanly (exit status 0)."""
    import os
    import signal
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jspec", "serve", "--port", str(port), "--max-batch", "2",
                             "--max-len", "96", "--max-new-tokens", "8"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                if json.loads(get(url + "/health"))["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.1)
        code, out, _ = post(url + "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 8})
        assert code == 200 and out["model"] == "jspec-bundled" and out["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    printed = proc.stdout.read()
    assert "serve: jspec-bundled on http://127.0.0.1" in printed and "serve: stopped (SIGTERM)" in printed
    bad = subprocess.run([sys.executable, "-m", "jspec", "serve", "--port", "70000"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--port" in bad.stderr


def test_full_queue_answers_429(target):
    """A queue with no room (max_waiting=0): 429, OpenAI's rate-limit error, Retry-After."""
    url, stop = running_server(jspec.Engine(target, max_batch=1, max_prompt_len=8, max_new_tokens=4, max_waiting=0),
                               "small")
    try:
        code, err, headers = post(url + "/v1/completions", {"model": "small", "prompt": [1, 2], "max_tokens": 2})
        assert code == 429 and err["error"]["type"] == "rate_limit_error" and "max_waiting=0" in err["error"]["message"]
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        assert json.loads(get(url + "/health"))["status"] == "ok"
    finally:
        stop()
