"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages through the chat template),
POST /detokenize, GET /tokenizer_info (lm-evaluation-harness's remote tokenizer reads it), and
GET /version. The tokenizer routes take the same API keys as /v1: they run the server's tokenizer,
work that an open route would let anyone queue; /version, as /health, is open."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tollway import __version__
from tollway.config import KeySpec
from tollway.server.errors import APIError
from tollway.server.protocol import MAX_MESSAGES, MAX_TEXT_CHARS, ChatMessage, Name
from tollway.server.service import Service, caller, service
from tollway.server.tools import tool_functions
from tollway.server.validation import chat_text, check_model

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's: a `prompt`, or `messages` rendered by the chat template first."""

    model_config = ConfigDict(extra="forbid")

    model: Name | None = None
    prompt: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    # vLLM's defaults: BOS for a plain prompt; none for messages, whose template writes it
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Name | None = None
    tokens: list[int] = Field(max_length=MAX_TEXT_CHARS)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, _: KeySpec | None = Depends(caller), svc: Service = Depends(service)) -> dict:
    check_model(req.model, svc.model_name)
    tokenizer = svc.tokenizer
    try:
        if req.messages is not None:
            if req.tools:
                tool_functions(req.tools)  # a 400 naming tools for a malformed one, as a chat's
            text = chat_text(req.messages, req.tools, req.chat_template_kwargs, tokenizer, req.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    except UnicodeEncodeError:  # a lone surrogate, as a completion's prompt is refused (validation.py)
        field = "messages" if req.messages is not None else "prompt"
        raise APIError(400, f"the {field} is not valid Unicode text", param=field) from None
    body = {"count": len(tokens), "max_model_len": svc.max_model_len, "tokens": tokens}
    if req.return_token_strs:
        body["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    return body


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, _: KeySpec | None = Depends(caller),
                     svc: Service = Depends(service)) -> dict:
    check_model(req.model, svc.model_name)
    bad = next((t for t in req.tokens if not 0 <= t < svc.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in this model's vocabulary [0, {svc.vocab_size})", param="tokens")
    return {"prompt": svc.tokenizer.decode(req.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(_: KeySpec | None = Depends(caller), svc: Service = Depends(service)) -> dict:
    """vLLM's: the special tokens a client needs to tokenize as the server does."""
    t = svc.tokenizer
    return {"tokenizer_class": "tollway", "bos_token": t.bos_token, "eos_token": t.eos_token, "pad_token": None,
            "model_max_length": svc.max_model_len}


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}
