"""The constraint kinds a request may carry, each a regular expression over the output's
text (JSON schemas through outlines-core's translation, with nesting bounded by
`max_depth`: a finite automaton holds no stack, so a schema's recursion is unrolled that
many levels deep)."""
from __future__ import annotations

import dataclasses
import json
import re

DEFAULT_MAX_DEPTH = 3  # nested objects and arrays a schema's recursion (or `Json()`) may reach
WHITESPACE = r"[ ]?"  # between JSON tokens: at most one space (no newlines: bounded, as outlines-core's default)


class Constraint:
    """A constraint on a request's generated text (see the kinds below)."""

    def regex(self) -> str:
        raise NotImplementedError

    @property
    def key(self) -> str:
        """What identifies the compiled automaton (with the tokenizer)."""
        return f"{type(self).__name__}:{self.regex()}"


def json_regex(schema: dict, max_depth: int, what: str) -> str:
    try:
        from outlines_core import json_schema
    except ImportError as err:  # pragma: no cover - the extra is installed with the tests
        raise ImportError("JSON constraints need outlines-core: pip install 'jspec[structured]'") from err
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: the schema is not JSON: {err}") from err
    try:
        return json_schema.build_regex_from_schema(text, WHITESPACE, max_depth)
    except Exception as err:  # outlines-core raises its own types for unsupported or invalid schemas
        raise ValueError(f"{what}: {err}") from err


@dataclasses.dataclass(frozen=True)
class JsonSchema(Constraint):
    """Output that is a JSON value valid under `schema` (a dict, as OpenAI's
    `response_format` json_schema; features outlines-core does not support raise a
    ValueError naming them)."""

    schema: dict
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self):
        if not isinstance(self.schema, dict):
            raise ValueError(f"JsonSchema: the schema must be a dict, got {type(self.schema).__name__}")

    def __hash__(self):
        return hash(self.key)

    def regex(self) -> str:
        return json_regex(self.schema, self.max_depth, "JsonSchema")


@dataclasses.dataclass(frozen=True)
class Json(Constraint):
    """Output that is any JSON object (`response_format` {"type": "json_object"}), nested
    at most `max_depth` levels."""

    max_depth: int = DEFAULT_MAX_DEPTH

    def regex(self) -> str:
        return json_regex({"type": "object"}, self.max_depth, "Json")


@dataclasses.dataclass(frozen=True)
class Regex(Constraint):
    """Output that matches `pattern` whole (Python/Rust regex syntax without lookaround or
    backreferences)."""

    pattern: str

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError("Regex: the pattern must be a non-empty string")
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"Regex: invalid pattern {self.pattern!r}: {err}") from err

    def regex(self) -> str:
        return self.pattern


@dataclasses.dataclass(frozen=True)
class Choice(Constraint):
    """Output that is exactly one of `options` (strings)."""

    options: tuple

    def __post_init__(self):
        options = tuple(self.options) if isinstance(self.options, (list, tuple)) else None
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("Choice: options must be a non-empty list of non-empty strings")
        object.__setattr__(self, "options", options)

    def regex(self) -> str:
        return "(" + "|".join(re.escape(o) for o in self.options) + ")"
