"""OpenAI's response shapes for a Generation's choices: the whole choice of a plain response,
a stream's chunk choice, and the logprobs of each (chat's entries, or completions' legacy
parallel lists)."""
from __future__ import annotations

import json

from tollway.outputs import RequestOutput
from tollway.server.generation import Choice, Generation
from tollway.server.tools import ToolCallReader, finish_reason
from tollway.text.tokenizer import Tokenizer

_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with options builds an encoder per call


def event(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {_JSON.encode(payload)}\n\n"


def final_choice(gen: Generation, c: Choice, echo: bool, tokenizer: Tokenizer) -> dict:
    if gen.kind == "chat":
        lp = {"content": [token_entry(tokenizer, e) for e in c.logprobs]} if c.logprobs else None
        message, reason = {"role": "assistant", "content": "".join(c.pieces)}, c.finish_reason
        if gen.tools is not None:
            reader = ToolCallReader(gen.tools)
            reader.push(message["content"], True)
            message, reason = reader.message(), finish_reason(reader, reason)
        return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason}
    prefix = tokenizer.decode(c.prompt_ids) if echo else ""
    lp = completion_logprobs(tokenizer, c.logprobs, len(prefix)) if c.logprobs else None
    return {"index": c.index, "text": prefix + "".join(c.pieces), "logprobs": lp, "finish_reason": c.finish_reason}


def chunk_choice(gen: Generation, choice: Choice, out: RequestOutput, first: bool, echo: bool,
                 tokenizer: Tokenizer) -> dict:
    """What `out` (already absorbed by `choice`) adds, as a stream chunk's choice; `first`: the
    choice's first chunk."""
    text = out.new_text
    if gen.kind == "chat":
        reason = choice.finish_reason
        if gen.tools is None:
            delta = {"content": text}
        else:
            choice.reader = choice.reader or ToolCallReader(gen.tools)
            delta = choice.reader.push(text, out.finished)
            reason = finish_reason(choice.reader, reason)
        if first:
            delta["role"] = "assistant"
        lp = {"content": [token_entry(tokenizer, e) for e in out.new_logprobs]} if out.new_logprobs else None
        return {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
    if echo and first:
        text = tokenizer.decode(choice.prompt_ids) + text
    offset = choice.text_len - len(out.new_text)
    lp = completion_logprobs(tokenizer, out.new_logprobs, offset) if out.new_logprobs else None
    return {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": choice.finish_reason}


def token_entry(tokenizer: Tokenizer, entry: dict) -> dict:
    """One generated token's logprobs in the chat shape (token, logprob, bytes, top_logprobs)."""
    def piece(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    text = piece(entry["token_id"])
    out = {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode())}
    top = entry.get("top_logprobs") or {}
    out["top_logprobs"] = [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode())} for t, lp in top.items()]
    return out


def completion_logprobs(tokenizer: Tokenizer, entries: list[dict], offset: int) -> dict:
    """The legacy completions shape: parallel lists, text offsets from `offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        e = token_entry(tokenizer, entry)
        tokens.append(e["token"])
        token_logprobs.append(e["logprob"])
        top_logprobs.append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
