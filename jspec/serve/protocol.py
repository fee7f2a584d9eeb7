"""The OpenAI API's request bodies as typed models (pydantic), with vLLM's extras, and
what turns them into engine requests: prompts in every form the completions API takes,
chat messages rendered with the model's chat template and encoded once.

A body that does not validate is a `BadRequest` naming the field (a 400 over HTTP); a
field the server does not know is ignored (`unknown_fields` lists them, the server logs
one warning line), as vLLM does. Values OpenAI allows and jspec cannot honour (a JSON
response format, tools, suffix, logit_bias, best_of above n) are refused with a 400 naming
the field.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jspec.loop.state import MAX_LOGPROBS

MAX_N = 16  # choices a request may ask for


class BadRequest(Exception):
    """A request the server refuses: status (400, 404, 429 ...), the field it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class Sampling(BaseModel):
    """The fields both endpoints share: sampling, limits, stops, streaming, vLLM's extras."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, lt=2 ** 31)
    max_tokens: int | None = Field(None, ge=0)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class ChatTemplating(BaseModel):
    """How chat messages become a prompt (vLLM's fields): the chat template's options and
    whether the tokenizer adds its special tokens to the rendered text (False for chat:
    the template writes them)."""

    model_config = ConfigDict(extra="allow")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(Sampling, ChatTemplating):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Any = None


class TokenizeRequest(ChatTemplating):
    """vLLM's /tokenize: a prompt (special tokens added by default), or chat messages
    rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    """A request body (JSON text) -> the request model, its types strict (no string for a
    number); BadRequest naming the first bad field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        req = model.model_validate_json(raw, strict=True)
    except pydantic.ValidationError as err:
        e = err.errors()[0]
        field = ".".join(str(p) for p in e["loc"] if not isinstance(p, int) or len(e["loc"]) == 1) or None
        top = str(e["loc"][0]) if e["loc"] else None
        raise BadRequest(f"{field}: {e['msg']} (got {json.dumps(e.get('input'), default=str)[:80]})", top) from None
    if not isinstance(req, Sampling):
        return req
    unsupported = [("suffix", getattr(req, "suffix", None) is not None, "suffix is not supported"),
                   ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
                   ("best_of", (getattr(req, "best_of", None) or req.n) > req.n,
                    "best_of above n is not supported (n independent samples are)"),
                   ("tools", bool(getattr(req, "tools", None)), "tools are not supported"),
                   ("response_format", req.response_format is not None and req.response_format.type != "text",
                    "response_format: only {\"type\": \"text\"} is supported (JSON output is not yet)")]
    for name, bad, why in unsupported:
        if bad:
            raise BadRequest(why, name)
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        if req.top_logprobs > 0:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return req


def unknown_fields(req: BaseModel) -> list[str]:
    """The body's fields the server ignores (it logs them)."""
    return sorted(req.model_extra or {})


# ----------------------------------------------------------------------------- prompts

def completion_prompts(req: CompletionRequest, tokenizer) -> list[list[int]]:
    """The prompts of a completions request, each as token ids: a string, a list of strings,
    a list of token ids, or a list of token id lists."""
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    elif p and all(isinstance(t, int) for t in p):
        p = [p]
    if not p:
        raise BadRequest("prompt is empty", "prompt")
    out = []
    for i, one in enumerate(p):
        if isinstance(one, str):
            if not one:
                raise BadRequest(f"prompt{'' if len(p) == 1 else f'[{i}]'} is an empty string", "prompt")
            if tokenizer is None:
                raise BadRequest("this model has no tokenizer: send token ids", "prompt")
            one = list(tokenizer(one, add_special_tokens=req.add_special_tokens)["input_ids"])
        if not one:
            raise BadRequest(f"prompt{'' if len(p) == 1 else f'[{i}]'} is empty", "prompt")
        out.append(one)
    return out


def message_text(m: Message, i: int) -> str:
    """A message's content as text: a string, text parts joined by newlines, or "" for a
    message without content (an assistant's tool call)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise BadRequest(f"messages[{i}].content: only text parts are supported, got type {part.type!r}",
                             "messages")
        texts.append(part.text)
    return "\n".join(texts)


def chat_prompt(messages: list[Message], options: ChatTemplating, tokenizer, template: str | None,
                add_special_tokens: bool) -> list[int]:
    """The messages rendered with the chat template (the server's --chat-template, else the
    tokenizer's; `options` its settings) and encoded once: the template's own special
    tokens are not added again unless `add_special_tokens` (False for chat, as vLLM's)."""
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer: use /v1/completions with token ids", "messages")
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise BadRequest("this model has no chat template: start the server with --chat-template, or use "
                         "/v1/completions", "messages")
    rendered = []
    for i, m in enumerate(messages):
        extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
        rendered.append({"role": m.role, "content": message_text(m, i), **({"name": m.name} if m.name else {}),
                         **extra})
    try:
        text = tokenizer.apply_chat_template(rendered, chat_template=template, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt and
                                             not options.continue_final_message,
                                             continue_final_message=options.continue_final_message,
                                             **(options.chat_template_kwargs or {}))
    except Exception as err:  # noqa: BLE001  (a template that rejects these messages)
        raise BadRequest(f"the chat template rejected these messages: {err}", "messages") from None
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if not ids:
        raise BadRequest("the chat template rendered these messages as no tokens", "messages")
    return ids
