"""Gemma's tokenizer read natively from its GGUF file (sentencepiece_bpe.c): the same ids and
text as the `tokenizers` tokenizer gguf_tokenizer.gemma_sentencepiece builds from the same
tokens (tests compare the two), without that one's costs at every start: a 33 MB tokenizer.json
parsed for a second, holding the GIL, into about 100 MB of tables. This one reads the file's
262144 strings into 7 MB in 0.03 s."""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np

from tollway.checkpoint import cache_root
from tollway.gguf_file import GGUFFile
from tollway.model.native.build import native_code_enabled, start_build
from tollway.text.gguf_tokenizer import adds_bos_eos, eos_token_ids, is_gemma_sentencepiece, tokenizer_config
from tollway.text.tokenizer import Tokenizer, byte_fallback_ids

if TYPE_CHECKING:
    import llguidance

_SOURCE = Path(__file__).with_name("sentencepiece_bpe.c")
_STRING, _INT32 = 8, 5  # GGUF value types
_ADDED, _SPECIAL, _SHADOWED = 1, 2, 4  # sentencepiece_bpe.c's flags


def sentencepiece_build(cache_dir: str | os.PathLike | None = None) -> Future:
    """The build of sentencepiece_bpe.c (build.start_build): the path of the library to come, or None."""
    return start_build(_SOURCE, cache_root(cache_dir) / "native", ["-O2", "-std=gnu11", "-shared", "-fPIC"],
                       fallback="the tokenizers library for Gemma's tokenizer")


class SentencePieceBPE:
    """A GGUF file's SentencePiece BPE vocabulary, as a tokenizer (Tokenizer's backend)."""

    def __init__(self, library: Path, reader: GGUFFile):
        fields = reader.metadata
        item, n, strings = reader.array_bytes("tokenizer.ggml.tokens")
        if item != _STRING:
            raise ValueError(f"{reader.path}: tokenizer.ggml.tokens is not an array of strings")
        types = None
        if "tokenizer.ggml.token_type" in fields:
            kind, count, raw = reader.array_bytes("tokenizer.ggml.token_type")
            if kind != _INT32 or count != n or len(raw) < 4 * n:
                raise ValueError(f"{reader.path}: tokenizer.ggml.token_type is not {n} int32s")
            types = np.frombuffer(raw, dtype="<i4", count=n)
        lib = self._lib = _bind(ctypes.CDLL(str(library)))
        bos, eos = fields.get("tokenizer.ggml.bos_token_id", -1), fields.get("tokenizer.ggml.eos_token_id", -1)
        add_bos, add_eos = adds_bos_eos(fields)  # as tokenizer_config.json has them
        self._handle = lib.spbpe_new(strings.ctypes.data, len(strings), n,
                                     types.ctypes.data if types is not None else None, bos, eos,
                                     bool(add_bos), bool(add_eos))
        if not self._handle:
            raise ValueError(f"{reader.path}: its tokenizer.ggml.tokens are cut short")
        self.size = n
        self._flags = np.frombuffer(ctypes.string_at(lib.spbpe_flags(self._handle), n), dtype=np.uint8)
        self.special_token_ids = frozenset(np.flatnonzero(self._flags & _SPECIAL).tolist())
        self.byte_token_ids = byte_fallback_ids(self.token_to_id)
        # Every string once (a repeated one counts once), as `tokenizers` counts its vocabulary.
        self.vocab_size = n - int(np.count_nonzero(self._flags & _SHADOWED))

    @classmethod
    def from_gguf(cls, reader: GGUFFile, cache_dir: str | os.PathLike | None = None) -> SentencePieceBPE | None:
        """The file's tokenizer, where it is Gemma's SentencePiece kind and the native code builds
        (not with TOLLWAY_NATIVE=0); None otherwise (the `tokenizers` one serves)."""
        if not native_code_enabled() or not is_gemma_sentencepiece(reader.metadata):
            return None
        library = sentencepiece_build(cache_dir).result()
        return cls(library, reader) if library else None

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.spbpe_free(self._handle)

    def token_to_id(self, token: str) -> int | None:
        data = token.encode()
        found = self._lib.spbpe_token_to_id(self._handle, data, len(data))
        return found if found >= 0 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids; with add_special_tokens, BOS (and EOS) where the file's tokenizer adds them.
        UnicodeEncodeError for text that is not Unicode (a lone surrogate)."""
        data = text.encode()
        out = np.empty(len(data) + 2, dtype=np.int32)  # at most a token a byte, and BOS and EOS
        n = self._lib.spbpe_encode(self._handle, data, len(data), out.ctypes.data, add_special_tokens)
        if n < 0:
            raise MemoryError("sentencepiece_bpe: out of memory encoding a text")
        return out[:n].tolist()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (those past the vocabulary give none)."""
        ids = np.fromiter(ids, dtype=np.int64)
        cap = 16 * len(ids) + 64
        while True:
            out = ctypes.create_string_buffer(cap)
            n = self._lib.spbpe_decode(self._handle, ids.ctypes.data, len(ids), skip_special_tokens, out, cap)
            if n < 0:
                raise MemoryError("sentencepiece_bpe: out of memory decoding ids")
            if n <= cap:
                return out.raw[:n].decode()
            cap = n

    def id_to_token(self, id: int) -> str:
        """Token `id`'s string, as the vocabulary has it (U+2581 for a space)."""
        if not 0 <= id < self.size:
            raise IndexError(f"token id {id} is not in this {self.size}-token vocabulary")
        start, end = np.frombuffer(ctypes.string_at(self._lib.spbpe_offsets(self._handle) + 4 * id, 8), dtype=np.uint32)
        return ctypes.string_at(self._lib.spbpe_strings(self._handle) + int(start), int(end - start)).decode()

    def lltokenizer(self, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        import llguidance

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(self, eos_token_ids)), n_vocab=n_vocab,
                                      eos_token=eos_token_ids)

    def token_bytes(self) -> list[bytes]:
        """Each token as the bytes it stands for, a special one as 0xFF and its text: what
        llguidance's tokenizer is built from (a test compares it with the one llguidance builds
        from the `tokenizers` tokenizer's JSON)."""
        offsets = np.frombuffer(ctypes.string_at(self._lib.spbpe_offsets(self._handle), 4 * (self.size + 1)),
                                dtype=np.uint32)
        strings = ctypes.string_at(self._lib.spbpe_strings(self._handle), int(offsets[-1]))
        ends = offsets.tolist()
        out = []
        for i, flags in enumerate(self._flags.tolist()):
            piece = strings[ends[i]:ends[i + 1]]
            if flags & _SHADOWED:
                piece = b""
            elif flags & _SPECIAL or (flags & _ADDED and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece  # an added "<tag>" too, as llguidance reads tokenizer.json
            elif len(piece) == 6 and piece.startswith(b"<0x") and i in self.byte_token_ids:
                piece = bytes([int(piece[3:5], 16)])
            else:
                piece = piece.replace("\u2581".encode(), b" ")
            out.append(piece)
        return out


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads of a tokenizer: its tokens' bytes, and text to ids."""

    def __init__(self, tokenizer: SentencePieceBPE, eos_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = None  # llguidance's own encodings never start a prompt
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper tries bytes first: text is what this one reads
            raise TypeError("a text, not bytes")
        return self._tokenizer.encode(text, add_special_tokens=False)


def native_tokenizer(reader: GGUFFile, chat_template: str | None = None,
                     cache_dir: str | os.PathLike | None = None) -> Tokenizer | None:
    """The GGUF file's tokenizer on SentencePieceBPE (its settings from the file, as
    gguf_tokenizer writes them), where that serves it; None otherwise."""
    backend = SentencePieceBPE.from_gguf(reader, cache_dir)
    if backend is None:
        return None
    config = tokenizer_config(reader.metadata, backend.id_to_token)
    return Tokenizer(backend, bos_token=config["bos_token"], eos_token=config["eos_token"],
                     eos_token_ids=eos_token_ids(reader.metadata), chat_template=chat_template or config["chat_template"])


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    for name, restype, argtypes in (
            ("spbpe_new", p, [p, i64, i64, p, i32, i32, i32, i32]),
            ("spbpe_free", None, [p]),
            ("spbpe_flags", p, [p]),
            ("spbpe_offsets", p, [p]),
            ("spbpe_strings", p, [p]),
            ("spbpe_token_to_id", i32, [p, ctypes.c_char_p, i64]),
            ("spbpe_encode", i64, [p, ctypes.c_char_p, i64, p, i32]),
            ("spbpe_decode", i64, [p, p, i64, i32, p, i64])):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib
