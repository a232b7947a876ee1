"""What `tollway bench` sends: prompts of exact token lengths (or a JSONL dataset), output
lengths, and each request's tier, all drawn from one seed so that a run can be repeated."""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tollway.config import TIERS


@dataclass
class Lengths:
    """Token counts drawn from a normal distribution, clipped to [low, high]."""

    mean: int
    stdev: float = 0.0
    low: int = 1
    high: int | None = None

    @classmethod
    def parse(cls, text: str, what: str) -> Lengths:
        """'256' (exactly), or 'mean=256,stdev=32,min=64,max=512'."""
        try:
            if "=" not in text:
                n = int(text)
                return cls(n, 0.0, n, n).checked(what)
            fields = dict(item.split("=", 1) for item in text.split(","))
            unknown = set(fields) - {"mean", "stdev", "min", "max"}
            if unknown or "mean" not in fields:
                raise ValueError
            high = fields.get("max")
            return cls(int(fields["mean"]), float(fields.get("stdev", 0)), int(fields.get("min", 1)),
                       int(high) if high is not None else None).checked(what)
        except ValueError:
            raise ValueError(f"{what}: expected a token count or 'mean=N,stdev=S,min=A,max=B', got {text!r}") from None

    def checked(self, what: str) -> Lengths:
        if self.low < 1 or self.mean < 1 or self.stdev < 0 or (self.high is not None and self.high < self.low):
            raise ValueError(f"{what}: lengths must be >= 1 with min <= max, got {self}")
        return self

    def draw(self, rng: random.Random) -> int:
        n = round(rng.gauss(self.mean, self.stdev)) if self.stdev else self.mean
        return max(self.low, min(n, self.high if self.high is not None else n))


def parse_mix(text: str) -> dict[str, float]:
    """'fast=0.1,standard=0.9' -> normalised shares by tier."""
    mix = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        tier, _, share = item.partition("=")
        if tier not in TIERS:
            raise ValueError(f"--mix: unknown tier {tier!r}; use {', '.join(TIERS)}")
        try:
            mix[tier] = float(share)
        except ValueError:
            raise ValueError(f"--mix: expected tier=share, got {item!r}") from None
        if mix[tier] < 0:
            raise ValueError(f"--mix: shares must be >= 0, got {item!r}")
    total = sum(mix.values())
    if not total > 0:
        raise ValueError(f"--mix: needs a tier with a share above 0, got {text!r}")
    return {t: s / total for t, s in mix.items() if s > 0}


@dataclass
class Workload:
    prompt: Lengths = field(default_factory=lambda: Lengths(256, 0, 256, 256))
    output: Lengths = field(default_factory=lambda: Lengths(128, 0, 128, 128))
    ignore_eos: bool = True  # fixed output lengths; False leaves them natural, up to the drawn max
    mix: dict[str, float] = field(default_factory=lambda: {"standard": 1.0})
    dataset: str | None = None  # JSONL: {"prompt": ..., "output_tokens": N (optional)} per line
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def draw(self, rng: random.Random) -> tuple[str, int, int]:
        """The next request's (tier, prompt tokens, max tokens): the same sequence for a seed
        whether a bench sends it or the simulator plays it."""
        tier = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        return tier, self.prompt.draw(rng), self.output.draw(rng)


@dataclass
class RequestSpec:
    index: int
    tier: str
    prompt: str
    prompt_tokens: int | None  # as the tokenizer counts them (BOS included); None: unknown
    max_tokens: int


class Requests:
    """An endless, seeded stream of RequestSpecs for a workload."""

    def __init__(self, workload: Workload, tokenizer=None):
        self.workload, self.tokenizer = workload, tokenizer
        self._rng = random.Random(workload.seed)
        self._words_rng = random.Random(workload.seed + 7919)  # apart, so the draws match the simulator's
        self._dataset = _read_dataset(Path(workload.dataset)) if workload.dataset else None
        if self._dataset is None:
            if tokenizer is None:
                raise ValueError("prompts of exact token lengths need a tokenizer (--tokenizer), or give --dataset")
            self._words = plain_words(tokenizer)
        self._index = 0

    def next(self) -> RequestSpec:
        tier, n, max_tokens = self.workload.draw(self._rng)
        if self._dataset is not None:
            row = self._dataset[self._index % len(self._dataset)]
            prompt = row["prompt"]
            n = len(self.tokenizer.encode(prompt)) if self.tokenizer is not None else None
            max_tokens = int(row.get("output_tokens") or max_tokens)
        else:
            prompt = exact_prompt(self.tokenizer, self._words, n, self._words_rng)
        spec = RequestSpec(self._index, tier, prompt, n, max_tokens)
        self._index += 1
        return spec


def exact_prompt(tokenizer, words: list[str], n: int, rng: random.Random) -> str:
    """Text that the tokenizer encodes (special tokens included) to exactly n tokens.
    Random common words, so a prefix cache sees no shared prefix beyond the BOS."""
    chosen = [rng.choice(words) for _ in range(n + 8)]
    m = n - len(tokenizer.encode(""))
    for _ in range(8):  # each word is one token after a space; the first, or a merge, may differ
        if m < 1:
            break
        text = " ".join(chosen[:m])
        got = len(tokenizer.encode(text))
        if got == n:
            return text
        m += n - got
    raise ValueError(f"cannot build a prompt of exactly {n} tokens with this tokenizer")


def plain_words(tokenizer) -> list[str]:
    """Lower-case ASCII words that are one token each after a space: the prompt vocabulary."""
    words = []
    for word in ("the of and to in is was for that on with as by at from his it an were are which this be or "
                 "has had not but first one their its new after who they have her she two been other when there "
                 "all during into school time may years more most only over city some world would where later up "
                 "such used many can state about national out known university united then made season high "
                 "between both called part team three under well while film year second being several "
                 "american early before back found river around group later since main each through house").split():
        if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1:
            words.append(word)
    if len(words) < 20:
        raise ValueError("the tokenizer splits common English words; give prompts with --dataset")
    return words


def read_jsonl(path: str | Path, flag: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-empty line; a clear error naming `flag` otherwise."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{flag}: line {number} of {path} is not JSON") from None
            if not isinstance(row, dict):
                raise ValueError(f"{flag}: line {number} of {path} is not a JSON object")
            rows.append((number, row))
    if not rows:
        raise ValueError(f"{flag}: {path} is empty")
    return rows


def _read_dataset(path: Path) -> list[dict]:
    rows = read_jsonl(path, "--dataset")
    for number, row in rows:
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"--dataset: line {number} of {path} needs a string 'prompt'")
    return [row for _, row in rows]
