"""A request's output constraint as a grammar the engine follows (SamplingParams.grammar,
llguidance's format): OpenAI's response_format ("json_object" is any JSON object, "json_schema"
the given schema), or vLLM's guided_json, guided_regex, guided_choice, guided_grammar (Lark
syntax, as llguidance reads it) and structured_outputs ({"json"|"regex"|"choice"|"grammar"|
"json_object": ...}). At most one constraint a request. JSON output is compact (no whitespace
between tokens), so a small model cannot spend its tokens on spaces.

`strict` true refuses a schema that uses a keyword llguidance cannot enforce (OpenAI's strict
mode refuses those too); false ignores such keywords and enforces the rest."""
from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher
from pydantic import BaseModel

from tollway.server.errors import APIError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar", "json_object": None}
# structured_outputs' switches for other backends' whitespace and fallbacks: accepted at the
# value that asks for nothing
STRUCTURED_OUTPUTS_DEFAULTS = {"disable_fallback": False, "disable_any_whitespace": False,
                               "disable_additional_properties": False, "whitespace_pattern": None,
                               "structural_tag": None}


def request_grammar(req: BaseModel) -> tuple[str | None, str | None]:
    """The grammar a request's output follows and the field that asked for it, or (None, None);
    a 400 naming the field where one is malformed, or where two fields constrain it."""
    asked = [(name, grammar) for name, grammar in (
        ("response_format", response_grammar(req.response_format)),
        *((name, guided_grammar(name, getattr(req, name))) for name in GUIDED),
        ("structured_outputs", structured_outputs_grammar(req.structured_outputs))) if grammar is not None]
    if len(asked) > 1:
        raise APIError(400, f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one of them",
                       param=asked[1][0])
    return asked[0][::-1] if asked else (None, None)


def guided_grammar(name: str, value: Any, param: str | None = None) -> str | None:
    """vLLM's guided_* field `name` as a grammar (None when not given)."""
    if value is None:
        return None
    param = param or name
    if name == "guided_json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as e:
            raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, dict):
            raise APIError(400, f"{param} must be a JSON Schema object", param=param)
        return json_grammar(schema, strict=False, param=param)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param} must be a list of non-empty strings", param=param)
        # Lark string literals read JSON's escapes
        return _checked(LLMatcher.grammar_from_lark, "start: " + " | ".join(json.dumps(c) for c in value), param)
    if not isinstance(value, str):
        raise APIError(400, f"{param} must be a string", param=param)
    make = LLMatcher.grammar_from_regex if name == "guided_regex" else LLMatcher.grammar_from_lark
    return _checked(make, value, param)


def structured_outputs_grammar(spec: dict[str, Any] | None) -> str | None:
    """vLLM's structured_outputs object as a grammar: exactly one constraint in it."""
    if spec is None:
        return None
    param = "structured_outputs"
    unknown = [k for k, v in spec.items() if k not in STRUCTURED_OUTPUTS
               and (k not in STRUCTURED_OUTPUTS_DEFAULTS or v != STRUCTURED_OUTPUTS_DEFAULTS[k])]
    if unknown:
        raise APIError(400, f"structured_outputs.{unknown[0]} is not supported (tollway reads "
                            f"{', '.join(STRUCTURED_OUTPUTS)})", param=param)
    given = [k for k in STRUCTURED_OUTPUTS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, f"structured_outputs must hold exactly one of {', '.join(STRUCTURED_OUTPUTS)}, "
                            f"got {', '.join(given) or 'none'}", param=param)
    [kind] = given
    if kind == "json_object":
        return json_grammar({"type": "object"}, strict=True, param=param)
    return guided_grammar(STRUCTURED_OUTPUTS[kind], spec[kind], param=param)


def _checked(make, source, param: str, what: str | None = None) -> str:
    """A grammar made by `make` from `source`, which llguidance has checked; else a 400 naming
    `param` that says `what` went wrong."""
    what = what or f"{param} is not a grammar llguidance can follow"
    try:
        grammar = make(source)
    except ValueError as e:
        raise APIError(400, f"{what}: {e}", param=param) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"{what}: {error}", param=param)
    return grammar


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
    defaults = {"whitespace_flexible": False, "lenient": not strict}
    return _checked(lambda s: LLMatcher.grammar_from_json_schema(s, defaults=defaults), schema, param,
                    "the JSON schema cannot be enforced")
