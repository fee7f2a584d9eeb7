"""langchain-openai against a jspec server, as a new user would call it.

    python langchain_check.py BASE_URL [completions|chat|both]

BASE_URL ends in /v1 (e.g. http://127.0.0.1:8011/v1). Runs `OpenAI` (the completions
model) and/or `ChatOpenAI`: invoke, stream and batch, each with default settings plus
max_tokens (the bundled model has no need for long answers). Prints one line per call,
`PASS` or `FAIL` with the error (for an HTTP error, its status and the server's body), and
exits 1 if any call failed.
"""
from __future__ import annotations

import os
import sys
import traceback

from langchain_openai import ChatOpenAI, OpenAI

MODEL = os.environ.get("JSPEC_MODEL", "jspec-bundled")
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):"]


def describe(err: Exception) -> str:
    status = getattr(err, "status_code", None)
    body = getattr(err, "body", None)
    if status is not None:
        return f"HTTP {status}: {body!r}"
    return f"{type(err).__name__}: {err}"


def run(label: str, fn) -> bool:
    try:
        out = fn()
    except Exception as err:  # noqa: BLE001  (each client error is a finding)
        print(f"FAIL {label}: {describe(err)}", flush=True)
        if os.environ.get("VERBOSE"):
            traceback.print_exc()
        return False
    text = out if isinstance(out, str) else repr(out)
    empty = (not out) or (isinstance(out, list) and not all(out))
    print(f"{'FAIL' if empty else 'PASS'} {label}: {text[:160]!r}", flush=True)
    return not empty


def text_of(msg) -> str:
    return msg if isinstance(msg, str) else msg.content


def check_completions(base: str) -> bool:
    llm = OpenAI(base_url=base, api_key="EMPTY", model=MODEL, max_tokens=16, max_retries=0, timeout=300)
    ok = run("completions invoke", lambda: llm.invoke(PROMPTS[0]))
    ok &= run("completions stream", lambda: "".join(llm.stream(PROMPTS[0])))
    ok &= run("completions batch", lambda: llm.batch(PROMPTS))
    return ok


def check_chat(base: str) -> bool:
    chat = ChatOpenAI(base_url=base, api_key="EMPTY", model=MODEL, max_tokens=16, max_retries=0, timeout=300)
    msgs = [("system", "You write Python."), ("human", PROMPTS[0])]
    ok = run("chat invoke", lambda: text_of(chat.invoke(msgs)))
    ok &= run("chat stream", lambda: "".join(text_of(c) for c in chat.stream(msgs)))
    ok &= run("chat batch", lambda: [text_of(m) for m in chat.batch([[("human", p)] for p in PROMPTS])])
    return ok


def main() -> int:
    base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011/v1"
    mode = sys.argv[2] if len(sys.argv) > 2 else "both"
    ok = True
    if mode in ("completions", "both"):
        ok &= check_completions(base)
    if mode in ("chat", "both"):
        ok &= check_chat(base)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
