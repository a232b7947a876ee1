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
    if echo and gen.logprobs is not None and c.prompt_logprobs:
        lp = _joined(echoed_logprobs(tokenizer, c.prompt_ids, c.prompt_logprobs, gen.logprobs), lp)
    body = {"index": c.index, "text": prefix + "".join(c.pieces), "logprobs": lp, "finish_reason": c.finish_reason}
    if gen.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, c.prompt_logprobs, gen.prompt_logprobs)
    return body


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
    body = {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": choice.finish_reason}
    if echo and first and gen.logprobs is not None and out.prompt_logprobs is not None:
        # the engine's first output with a token carries them
        body["logprobs"] = _joined(echoed_logprobs(tokenizer, choice.prompt_ids, out.prompt_logprobs, gen.logprobs), lp)
    return body


def token_entry(tokenizer: Tokenizer, entry: dict) -> dict:
    """One generated token's logprobs in the chat shape (token, logprob, bytes, top_logprobs)."""
    text = _piece(tokenizer, entry["token_id"])
    out = {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode())}
    top = entry.get("top_logprobs") or {}
    out["top_logprobs"] = [{"token": piece, "logprob": lp, "bytes": list(piece.encode())}
                           for piece, lp in ((_piece(tokenizer, t), lp) for t, lp in top.items())]
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


def echoed_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], scored: list[dict | None], top_n: int) -> dict:
    """The prompt's part of an echo's legacy logprobs: every prompt token, None for the first
    (nothing precedes it), and at each later position its own logprob among the top `top_n`;
    offsets into the echoed text (a special token such as BOS takes none of it)."""
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(prompt_ids, scored):
        tokens.append(_piece(tokenizer, token_id))
        offsets.append(offset)
        offset += len(tokenizer.decode([token_id]))
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry["logprob"])
        top = {_piece(tokenizer, t): lp for t, lp in _top(entry, top_n)}
        top_logprobs.append(top | {tokens[-1]: entry["logprob"]})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Tokenizer, scored: list[dict | None] | None, top_n: int) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token id (a string, as
    JSON keys are) its logprob, rank and text: the prompt token's own, and the top `top_n`."""
    if scored is None:
        return None
    out: list[dict | None] = []
    for entry in scored:
        if entry is None:
            out.append(None)
            continue
        position = {entry["token_id"]: (entry["logprob"], entry["rank"])}
        for rank, (t, lp) in enumerate(_top(entry, top_n), 1):
            position.setdefault(t, (lp, rank))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": _piece(tokenizer, t)}
                    for t, (lp, rank) in position.items()})
    return out


def _top(entry: dict, n: int) -> list[tuple[int, float]]:
    """The `n` most likely tokens at a scored prompt position (its top_logprobs hold at least
    these, and the prompt token's own)."""
    return sorted(entry["top_logprobs"].items(), key=lambda item: -item[1])[:n]


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _joined(prompt: dict, completion: dict | None) -> dict:
    """An echo's legacy logprobs: the prompt's lists, then the completion's."""
    return {k: v + completion[k] for k, v in prompt.items()} if completion else prompt
