"""The OpenAI API's request bodies as typed models (pydantic), with vLLM's extras, and
what turns them into engine requests: prompts in every form the completions API takes,
chat messages rendered with the model's chat template and encoded once.

A body that does not validate is a `BadRequest` naming the field (a 400 over HTTP); a
field the server does not know is ignored (`unknown_fields` lists them, the server logs
one warning line), as vLLM does. Values OpenAI allows and jspec cannot honour (tools,
suffix, logit_bias, best_of above n, an EBNF grammar) are refused with a 400 naming the
field. Structured output (`constraint`): `response_format` {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, and vLLM's
`structured_outputs` {"json" | "regex" | "choice": ...} (and its older `guided_json`,
`guided_regex`, `guided_choice`).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jspec import constraints
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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured-output extras: one of them."""

    model_config = ConfigDict(extra="allow")
    json_: Union[dict, str, None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


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
                   ("tools", bool(getattr(req, "tools", None)), "tools are not supported")]
    for name, bad, why in unsupported:
        if bad:
            raise BadRequest(why, name)
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        if req.top_logprobs > 0:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return req


def constraint_of(req: Sampling) -> tuple[constraints.Constraint | None, str | None]:
    """The request's structured-output constraint and the field that asked for it ->
    (constraint or None, field); BadRequest naming the field for a bad one (two at once, a
    json_schema without its schema, an invalid schema or regex, an EBNF grammar)."""
    asked = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", lambda: constraints.Json()))
        elif rf.json_schema is None:
            raise BadRequest("response_format: type json_schema needs a json_schema object with a schema",
                             "response_format")
        else:
            asked.append(("response_format", lambda: constraints.JsonSchema(rf.json_schema.schema_)))
    so = req.structured_outputs
    if so is not None:
        if so.grammar is not None:
            raise BadRequest("structured_outputs.grammar is not supported (EBNF and Lark grammars: use json, regex "
                             "or choice)", "structured_outputs")
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("json_object", so.json_object or None)) if v is not None]
        if len(given) != 1:
            raise BadRequest("structured_outputs takes exactly one of json, regex, choice and json_object",
                             "structured_outputs")
        asked.append(("structured_outputs", lambda: kind_of(*given[0])))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = getattr(req, name)
        if value is not None:
            asked.append((name, lambda kind=kind, value=value: kind_of(kind, value)))
    if len(asked) > 1:
        raise BadRequest(f"{asked[0][0]} and {asked[1][0]} both ask for structured output: give one", asked[1][0])
    if not asked:
        return None, None
    name, make = asked[0]
    try:
        c = make()
        c.regex()  # an unsupported or invalid schema fails here
    except ValueError as err:
        raise BadRequest(f"{name}: {err}", name) from None
    return c, name


def asks_structure(req: Sampling) -> bool:
    """Whether the request asks for structured output (see `constraint_of`)."""
    return ((req.response_format is not None and req.response_format.type != "text")
            or any(v is not None for v in (req.structured_outputs, req.guided_json, req.guided_regex,
                                           req.guided_choice)))


def kind_of(kind: str, value) -> constraints.Constraint:
    """A vLLM structured-output value as a constraint."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
        return constraints.JsonSchema(value)
    if kind == "regex":
        return constraints.Regex(value)
    if kind == "choice":
        return constraints.Choice(value)
    return constraints.Json()


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
