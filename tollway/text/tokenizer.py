"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

At run time only the `tokenizers` library is used. A GGUF file carries its tokenizer as
metadata, which gguf_tokenizer.py turns into tokenizer files once (checkpoint.tokenizer_path).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import tokenizers

from tollway.text.chat_template import ChatTemplate

if TYPE_CHECKING:
    import llguidance

_REPLACEMENT = "\ufffd"
# Gemma's turn markers; a vocabulary that has them gets Gemma's chat format when it has no template.
_START_OF_TURN, _END_OF_TURN = "<start_of_turn>", "<end_of_turn>"


class Tokenizer:
    def __init__(self, backend: TokenizerBackend | tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None):
        """`backend`: what encodes and decodes (a `tokenizers` one is wrapped as HFBackend)."""
        if isinstance(backend, tokenizers.Tokenizer):
            backend = HFBackend(backend)
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos = list(eos_token_ids)
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos.append(backend.token_to_id(eos_token))
        # Chat replies of Gemma models end with <end_of_turn>, not <eos>.
        self._gemma_turns = backend.token_to_id(_START_OF_TURN) is not None and backend.token_to_id(_END_OF_TURN) is not None
        if self._gemma_turns:
            eos.append(backend.token_to_id(_END_OF_TURN))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.chat_template = ChatTemplate(chat_template) if chat_template else None
        self.renders_tools = self.chat_template is not None and self.chat_template.renders_tools
        self._byte_token_ids = backend.byte_token_ids
        self._special_token_ids = backend.special_token_ids
        self._kept_special_ids: frozenset[int] = frozenset()  # special, yet in decoded text (keep_special_tokens)

    @classmethod
    def load(cls, path: str | Path, chat_template: str | None = None,
             backend: tokenizers.Tokenizer | None = None) -> Tokenizer:
        """From a folder with tokenizer.json, and optionally tokenizer_config.json,
        generation_config.json and chat_template.jinja (an HF folder or a converted-weights cache).
        `chat_template` (Jinja text) replaces the model's own; `backend`: the folder's
        tokenizer.json already parsed (checkpoint.tokenizer_source)."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = backend or tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        template = config.get("chat_template")
        if isinstance(template, list):  # older multi-template form: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it beside the config
            template = (folder / "chat_template.jinja").read_text()
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            eos_token_ids=[eos] if isinstance(eos, int) else eos or (),
            chat_template=chat_template or template,
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    def lltokenizer(self, n_vocab: int) -> llguidance.LLTokenizer:
        """llguidance's tokenizer of this one, for a vocabulary of `n_vocab` (the model's rows)."""
        return self._backend.lltokenizer(n_vocab, list(self.eos_token_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended when the model wants it.
        Encode a rendered chat template with add_special_tokens=False: the template writes BOS itself.
        UnicodeEncodeError for text that no UTF-8 holds (a lone surrogate)."""
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._kept_special_ids:
            skipped = self._special_token_ids - self._kept_special_ids
            return self._backend.decode([i for i in ids if i not in skipped], False)
        return self._backend.decode(ids, skip_special_tokens)

    def keep_special_tokens(self, tokens: Iterable[str]) -> None:
        """Decode these special tokens as text, as the others are not: the markers of the model's
        tool-call syntax (Mistral's [TOOL_CALLS]), which the server reads calls by."""
        ids = (self._backend.token_to_id(t) for t in tokens)
        self._kept_special_ids = frozenset(i for i in ids if i in self._special_token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None) -> str:
        """The prompt text for an OpenAI-style message list, in the model's own chat format.
        `template_kwargs`: further variables for the template (a request's chat_template_kwargs);
        `tools`: OpenAI's tool definitions, for a template that renders them (renders_tools)."""
        if self.chat_template is not None:
            return self.chat_template.render(messages, add_generation_prompt, tools, {
                **(template_kwargs or {}), "bos_token": self._bos_token or "", "eos_token": self._eos_token or ""})
        if self._gemma_turns:
            return _gemma_prompt(messages, add_generation_prompt, self._bos_token or "")
        raise ValueError("this model has no chat template; send a plain prompt instead of chat messages")


class TokenizerBackend(Protocol):
    """What a Tokenizer encodes and decodes with: HFBackend, or model/sentencepiece_bpe.py's native one."""
    vocab_size: int  # tokens, added ones included
    byte_token_ids: frozenset[int]  # byte-fallback tokens (<0x00>..<0xFF>), where it has them
    special_token_ids: frozenset[int]

    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool) -> str: ...

    def lltokenizer(self, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer: ...


class HFBackend:
    """A `tokenizers` tokenizer (a tokenizer.json) as a TokenizerBackend."""

    def __init__(self, hf: tokenizers.Tokenizer):
        self.hf = hf
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.byte_token_ids = byte_fallback_ids(hf.token_to_id) if getattr(hf.model, "byte_fallback", False) else frozenset()
        self.special_token_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the binding's word for a lone surrogate: said as the native backend says it
            text.encode()
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def lltokenizer(self, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        import llguidance  # a server's grammars use it; the bench clients that load tokenizers do not

        return llguidance.LLTokenizer(self.hf.to_str(), n_vocab=n_vocab, eos_token=eos_token_ids)


def byte_fallback_ids(token_to_id: Callable[[str], int | None]) -> frozenset[int]:
    """The ids of the byte-fallback tokens (<0x00>..<0xFF>) a vocabulary has."""
    return frozenset(i for i in map(token_to_id, (f"<0x{b:02X}>" for b in range(256))) if i is not None)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive.

    The deltas, joined (with `flush()` last), equal decode(prompt_ids + ids) minus decode(prompt_ids):
    plain decode(ids) without a prompt. Text is held back while it could still change: while it ends
    in U+FFFD (a multi-byte character not complete yet) and while it ends in byte-fallback tokens,
    whose run `tokenizers` decodes as a whole (a later byte can turn the run into U+FFFDs; skipped
    special tokens do not end a run).
    """

    # Prompt tokens decoded ahead of the first output token, so that its leading space survives
    # decoders that strip the first token's space.
    _PROMPT_CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)[-self._PROMPT_CONTEXT:]
        self._window_start = 0  # decoding starts here: the tokens before the emitted ones serve as context
        self._emitted = len(self._ids)  # ids before this index are accounted for in the text returned so far
        # Tokens that may continue a run of byte-fallback tokens, so text is not final while they trail.
        self._run_ids = tokenizer._byte_token_ids
        if tokenizer._byte_token_ids and skip_special_tokens:
            self._run_ids = tokenizer._byte_token_ids | tokenizer._special_token_ids

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (often "", sometimes several characters)."""
        self._ids.append(token_id)
        end = len(self._ids)
        while end > self._emitted and self._ids[end - 1] in self._run_ids:
            end -= 1
        return self._advance(end, final=False)

    def flush(self) -> str:
        """Return whatever is held back; call once the sequence has finished."""
        return self._advance(len(self._ids), final=True)

    def _advance(self, end: int, final: bool) -> str:
        if end <= self._emitted:
            return ""
        text = self._decode(self._ids[self._window_start:end])
        if text.endswith(_REPLACEMENT) and not final:
            return ""
        seen = self._decode(self._ids[self._window_start:self._emitted])
        self._window_start, self._emitted = self._emitted, end
        return text[len(seen):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    """HF configs spell a special token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _gemma_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool, bos: str) -> str:
    """Gemma's chat format. Gemma has no system role: a system message prefixes the first user turn."""
    system = ""
    if messages and messages[0].get("role") == "system":
        system = _content_text(messages[0], trim=False) + "\n\n"
        messages = messages[1:]
    if not messages:
        raise ValueError("chat messages must include at least one user message")
    parts = [bos]
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.get("role") != expected:
            raise ValueError(
                f"chat message {i}: expected role {expected!r}, got {message.get('role')!r} "
                "(after an optional system message, roles alternate user/assistant)"
            )
        role = "user" if expected == "user" else "model"
        prefix = system if i == 0 else ""
        parts.append(f"{_START_OF_TURN}{role}\n{prefix}{_content_text(message, trim=True)}{_END_OF_TURN}\n")
    if add_generation_prompt:
        parts.append(f"{_START_OF_TURN}model\n")
    return "".join(parts)


def _content_text(message: dict[str, Any], trim: bool) -> str:
    """A message's text: a string, or OpenAI-style parts of which only text is supported."""
    content = message.get("content") or ""
    pieces = [content] if isinstance(content, str) else []
    for part in content if isinstance(content, list) else ():
        if part.get("type") != "text":
            raise ValueError(f"chat content of type {part.get('type')!r} is not supported; only text")
        pieces.append(part.get("text", ""))
    return "".join(p.strip() for p in pieces) if trim else "".join(pieces)
