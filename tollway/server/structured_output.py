"""OpenAI's response_format as a grammar the engine follows (SamplingParams.grammar, llguidance's
format): "json_object" is any JSON object, "json_schema" the given schema. Output is compact
JSON (no whitespace between tokens), so a small model cannot spend its tokens on spaces.

`strict` true refuses a schema that uses a keyword llguidance cannot enforce (OpenAI's strict
mode refuses those too); false ignores such keywords and enforces the rest."""
from __future__ import annotations

from typing import Any

from llguidance import LLMatcher

from tollway.server.errors import APIError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def response_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar `response_format` asks for (None for text); a 400 naming response_format
    for one that is malformed or cannot be enforced."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, strict=True, param="response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise APIError(400, "response_format.json_schema must be an object with a name", param="response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object",
                       param="response_format")
    return json_grammar(schema, strict=bool(spec.get("strict")), param="response_format")


def json_grammar(schema: dict[str, Any], strict: bool, param: str) -> str:
    """The grammar of compact JSON that validates against `schema`; a 400 naming `param` if it
    cannot be enforced."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "lenient": not strict})
    except ValueError as e:
        raise APIError(400, f"the JSON schema is not valid: {e}", param=param) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"the JSON schema cannot be enforced: {error}", param=param)
    return grammar
