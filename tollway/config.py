"""Engine, scheduler and tier settings (plain dataclasses; no torch here), from TOML or code."""
from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

KERNELS = ("q8", "int8", "bf16", "fp32")
KV_CACHE_DTYPES = ("auto", "float32", "float16")
POLICIES = ("lanes", "priority", "fcfs")
TIERS = ("fast", "standard", "batch")  # in priority order


@dataclass
class TierSpec:
    """One lane. Times are seconds; prices are per million tokens."""

    name: str
    priority: int  # admission order, lower first
    # fast: every step that carries a fast request is shaped to this. standard: the p99 TPOT
    # SLO that bounds the batch size. None: no target.
    tpot_target: float | None = None
    # fast: a newcomer should wait at most half of this for the step in flight. Where steps can
    # stop between layers (SchedulerConfig.pause_layers), every step is kept so that one layer
    # of it takes at most that; else, with `warm_for` set, for that many seconds after fast
    # traffic every step is kept within it whole, and the meter charges the capacity this holds
    # idle to the next fast requests. Otherwise (and for the other lanes) reported against,
    # not scheduled for.
    ttft_target: float | None = None
    warm_for: float | None = None
    reserved_kv_share: float = 0.0  # of the KV blocks, held back from the other tiers
    reserved_seq_share: float = 0.0  # of max_num_seqs, held back from the other tiers
    preemptible: bool = True
    max_queue: int = 1024  # waiting requests; past this, new ones are refused
    window: float | None = None  # finish within this long of arrival (the batch lane ages into it)
    price_input_per_m: float = 0.0
    price_output_per_m: float = 0.0

    def validate(self) -> None:
        for name in ("reserved_kv_share", "reserved_seq_share"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"tiers.{self.name}.{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("tpot_target", "ttft_target", "warm_for", "window"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"tiers.{self.name}.{name} must be > 0 seconds, got {value!r}")
        if self.max_queue < 1:
            raise ValueError(f"tiers.{self.name}.max_queue must be >= 1, got {self.max_queue!r}")
        if self.price_input_per_m < 0 or self.price_output_per_m < 0:
            raise ValueError(f"tiers.{self.name} prices must be >= 0")


def default_tiers() -> dict[str, TierSpec]:
    """Targets sized for Gemma 3 270M on a 2-core CPU with the native q8 engine (the figures
    behind them: benchmarks/README.md, lanes.py and fast_lane.py): fast's step target is a few
    lone decode steps, so fast (with its speculative drafts) runs several times standard's
    per-user speed, and lanes.py's sweep found it as cheap for the other lanes as a looser one.
    Fast's TTFT target is about twice a lone fast prompt's: half of it bounds what a newcomer
    waits for the step in flight, and it leaves no time to cut a prompt in chunks that each pay
    a step's fixed cost. Prices follow the hosted APIs: priority ~2x (here 3x), batch -50%."""
    return {
        "fast": TierSpec("fast", 0, tpot_target=0.02, ttft_target=0.06, warm_for=60.0, reserved_kv_share=0.1,
                         reserved_seq_share=0.125, preemptible=False, max_queue=64,
                         price_input_per_m=0.30, price_output_per_m=1.20),
        "standard": TierSpec("standard", 1, tpot_target=2.0, ttft_target=10.0, max_queue=1024,
                             price_input_per_m=0.10, price_output_per_m=0.40),
        "batch": TierSpec("batch", 2, window=24 * 3600.0, max_queue=100_000,
                          price_input_per_m=0.05, price_output_per_m=0.20),
    }


@dataclass
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 2048  # KV blocks in the pool
    # Cap on sequences per step. Under lanes the standard SLO, not this cap, sets the batch
    # size, so the cap sits well above it: fast's reserved seats then cost nothing while idle.
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    # Prompt + output, per request. None: as long as the model allows and the KV pool holds
    # (context_limit; the engine settles it with fit_context).
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Linear-layer kernel: a fixed name from KERNELS, or "auto" to pick per step by its token count.
    # q8 is the native integer matmul (weights in blocks of 32, each tensor packed as exactly as its
    # values allow; the fp32 matmul where it does not compile). "auto" never mixes kernels with
    # different numerics by step size beside it: greedy results would then depend on the batch.
    kernel: str = "auto"
    # With kernel="auto": steps of at most this many tokens use int8 weight-only matmuls,
    # larger steps use `dense_kernel`. None: measured on this machine at the first start, then cached.
    # Beside dense_kernel q8, None means 0: q8 reads the weights once per step whatever its
    # size, and beat int8 at every step size measured (native/qmatmul.py).
    int8_max_tokens: int | None = None
    dense_kernel: str = "q8"
    # lanes: tiers with reservations and step shaping; priority: vLLM's priority scheduling
    # (reorder only); fcfs: one queue in arrival order, vLLM's default.
    policy: str = "lanes"
    tiers: dict[str, TierSpec] = field(default_factory=default_tiers)
    # Speculative decoding for the fast lane (lanes policy): up to this many n-gram drafts per
    # step, 0 to turn it off; a request whose drafts are accepted less often than
    # speculation_min_rate stops getting them.
    speculative_tokens: int = 4
    speculation_min_rate: float = 0.25
    # Whether a step without fast requests stops between two layers for a fast arrival, where
    # steps run in the native layer loop (the CPU's). Off, a fast arrival waits for the step in
    # flight, and the lanes policy keeps steps short for a while after fast traffic instead
    # (TierSpec.warm_for).
    pause_for_fast: bool = True
    # The layers a step can stop between: the engine sets it (the model's layer count) where
    # pause_for_fast is on and its steps can stop; 0: steps run whole.
    pause_layers: int = 0

    def validate(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if sorted(self.tiers) != sorted(TIERS):
            raise ValueError(f"tiers must be exactly {', '.join(TIERS)}, got {', '.join(self.tiers)}")
        for tier in self.tiers.values():
            tier.validate()
        for what, total in (("kv", self.num_blocks), ("seq", self.max_num_seqs)):
            held_back = sum(self.reserved(what, t) for t in self.tiers)
            for t in self.tiers:
                if total - held_back + self.reserved(what, t) < 1:
                    raise ValueError(f"reserved_{what}_share leaves tier {t} nothing of {total}")
        if self.kernel not in KERNELS + ("auto",):
            raise ValueError(f"kernel must be one of {', '.join(KERNELS + ('auto',))}, got {self.kernel!r}")
        if self.dense_kernel not in KERNELS:
            raise ValueError(f"dense_kernel must be one of {', '.join(KERNELS)}, got {self.dense_kernel!r}")
        if self.speculative_tokens < 0 or not 0 <= self.speculation_min_rate <= 1:
            raise ValueError("speculative_tokens must be >= 0 and speculation_min_rate in [0, 1]")

    def context_limit(self) -> int:
        """max_model_len, or (unset) all that the KV pool holds."""
        return self.num_blocks * self.block_size if self.max_model_len is None else self.max_model_len

    def fit_context(self, model_limit: int) -> None:
        """Settle max_model_len (the engine does, once the model is known): never past the
        model's context length; unset, as much of it as the KV pool holds."""
        self.max_model_len = min(self.context_limit(), model_limit)

    def reserved(self, what: str, tier: str) -> int:
        """Blocks ("kv") or sequence slots ("seq") only `tier` may use; none outside lanes."""
        if self.policy != "lanes":
            return 0
        share = getattr(self.tiers[tier], f"reserved_{what}_share")
        # The epsilon keeps 0.29 * 100 (28.999...) at 29.
        return math.floor(share * (self.num_blocks if what == "kv" else self.max_num_seqs) + 1e-9)

    def kernels_to_load(self) -> set[str]:
        if self.kernel != "auto":
            return {self.kernel}
        # Beside q8 int8 is measured only when asked for: int8_max_tokens None then means 0.
        measured = self.int8_max_tokens is None and self.dense_kernel != "q8"
        return {self.dense_kernel} | ({"int8"} if self.int8_max_tokens or measured else set())

    def kernel_for(self, num_tokens: int) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "int8" if self.int8_max_tokens and num_tokens <= self.int8_max_tokens else self.dense_kernel


@dataclass
class EngineConfig:
    model: str = "gemma3-270m"  # a GGUF file, an HF folder, or the embedded default's name
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "cpu", "cuda", or "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU; None = all cores
    cache_dir: str | None = None  # converted-weights cache; None = the user's cache directory
    # auto: float16 on the CPU (half the bytes attention reads, and half the KV memory, of
    # float32), float32 under the pinned fp32 kernel (which then matches transformers exactly),
    # bfloat16 on a GPU.
    kv_cache_dtype: str = "auto"
    # The KV pool's size: bytes ("2GiB", "500MB", or a number) or a share of the device's memory
    # (0.2). None: scheduler.num_blocks blocks.
    kv_cache_memory: str | float | None = None
    # A Jinja chat template (the text) in place of the model's own.
    chat_template: str | None = None
    # The syntax the server reads the model's tool calls in (server/tool_parsers.py: hermes,
    # llama3_json, mistral, or constrained: a grammar writes them). None: the one its chat
    # template teaches, else constrained.
    tool_call_parser: str | None = None
    # Time synthetic steps at the first start (then remembered) to seed the step-time model
    # that shapes steps under the lanes policy. Off: no time-based shaping.
    profile_steps: bool = True


_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_budget(value: str | float, total: int) -> int:
    """Bytes meant by a kv_cache_memory value: "2GiB", "500MB", 1e9, or a share (0, 1) of `total`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", str(value), re.IGNORECASE)
    if isinstance(value, bool) or match is None:
        raise ValueError(f"kv_cache_memory must be bytes (like 2GiB or 500MB) or a share of memory in (0, 1), "
                         f"got {value!r}")
    number, unit = float(match[1]), (match[2] or "").lower()
    if not unit and 0 < number < 1:
        return int(number * total)
    if number < 1:
        raise ValueError(f"kv_cache_memory must be more than 0, got {value!r}")
    return int(number * _MEMORY_UNITS[unit])


def kv_pool_blocks(value: str | float, total_memory: int, kv_bytes_per_token: int, block_size: int) -> int:
    """KV blocks that fit in the kv_cache_memory budget `value`."""
    budget = memory_budget(value, total_memory)
    blocks = budget // (kv_bytes_per_token * block_size)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {value!r} ({budget} bytes) holds no KV block of "
                         f"{kv_bytes_per_token * block_size} bytes")
    return blocks


@dataclass
class KeySpec:
    """An API key: which tiers it may use and its per-minute limits (None: unlimited)."""

    key: str
    name: str = ""
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (prompt + max_tokens, counted when a request arrives)
    admin: bool = False  # may open /dashboard (operators' view: every lane, every key's budget)

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def validate(self) -> None:
        if not self.key:
            raise ValueError("an API key cannot be empty")
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown or not self.tiers:
            raise ValueError(f"key {self.name or '?'}: tiers must be some of {', '.join(TIERS)}, got {self.tiers!r}")
        for limit in (self.rpm, self.tpm):
            if limit is not None and limit < 1:
                raise ValueError(f"key {self.name or '?'}: rpm and tpm must be >= 1")


PERIODS = ("daily", "monthly")
ALERT_THRESHOLDS = (0.5, 0.8, 1.0)


@dataclass
class BudgetSpec:
    """A spending limit, in billed dollars, for one API key (by name) or one tag, per UTC day
    or calendar month. Alerts fire at 50%, 80% and 100%; with hard_cap, new requests are then
    refused until the period resets (running ones always finish)."""

    limit: float
    key: str | None = None
    tag: str | None = None
    period: str = "monthly"
    hard_cap: bool = True

    @property
    def scope(self) -> tuple[str, str]:
        return ("key", self.key) if self.key is not None else ("tag", self.tag)

    def validate(self) -> None:
        if (self.key is None) == (self.tag is None):
            raise ValueError("a budget names exactly one of key or tag")
        if self.period not in PERIODS:
            raise ValueError(f"budget period must be one of {', '.join(PERIODS)}, got {self.period!r}")
        if not self.limit > 0:
            raise ValueError(f"budget limit must be > 0, got {self.limit!r}")


@dataclass
class MeterConfig:
    """The machine's price, which turns engine seconds into cost, and where the ledger lives.
    Billed prices per token are the tiers' (TierSpec)."""

    price_per_hour: float = 2.50  # dollars per hour of engine time
    ledger: str | None = None  # SQLite file; None: ledger.sqlite in the server's data directory
    webhook: str | None = None  # budget alerts are POSTed here as JSON
    budgets: list[BudgetSpec] = field(default_factory=list)

    def validate(self) -> None:
        if self.price_per_hour < 0:
            raise ValueError(f"meter price_per_hour must be >= 0, got {self.price_per_hour!r}")
        for budget in self.budgets:
            budget.validate()


@dataclass
class CanaryConfig:
    """A share of eligible requests promoted to the fast lane, to measure what fast mode buys.
    Eligible: service_tier "auto" or none, from a key entitled to fast, narrowed to `keys`
    (names) and `tags` where given. Which requests is a seeded hash of the request id
    (tollway/server/canary.py), so anyone with the seed can audit the split from the ledger."""

    share: float = 0.0  # of eligible requests; 0: off
    seed: int = 0
    keys: list[str] = field(default_factory=list)  # only these keys' requests (empty: every key's)
    tags: list[str] = field(default_factory=list)  # only requests with one of these tags (empty: any)
    # False: a promoted request is billed at the standard price and the fast premium it was
    # not billed is recorded as the canary's cost. True: billed at the fast price.
    bill_promoted: bool = False

    def validate(self) -> None:
        if not 0 <= self.share <= 1:
            raise ValueError(f"canary share must be in [0, 1], got {self.share!r}")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    keys: list[KeySpec] = field(default_factory=list)
    keys_db: str | None = None  # a SQLite file of further keys (`tollway keys add`)
    data_dir: str | None = None  # Batch API files, jobs and the ledger; None: under the user's data directory
    # postgresql://...: keys, the ledger, budgets and Batch API jobs in one database a fleet shares
    database_url: str | None = None
    # Seconds a stream may go silent (queued, or between tokens) before it sends an SSE
    # keep-alive comment: under the 60 s idle timeout of most proxies.
    sse_keep_alive: float = 15.0
    # An OTLP/HTTP collector's traces URL (http://host:4318/v1/traces): a span per API call
    # (server/tracing.py). None: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing.
    otlp_traces_endpoint: str | None = None
    meter: MeterConfig = field(default_factory=MeterConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)


def load_config(path: str | Path) -> EngineConfig:
    """An EngineConfig from TOML: top-level engine fields, a [scheduler] table, and
    [tiers.<name>] tables that override the defaults field by field. ([server], [[keys]],
    [meter], [[budgets]] and [canary] are the server's: load_server_config.)"""
    data = _read_toml(path)
    for server_only in ("server", "keys", "meter", "budgets", "canary"):
        data.pop(server_only, None)
    sched = _table(data.pop("scheduler", {}), "[scheduler]", path)
    tiers = default_tiers()
    for name, fields in _table(data.pop("tiers", {}), "[tiers]", path).items():
        if name not in tiers:
            raise ValueError(f"config {path}: unknown tier {name!r} (tiers are {', '.join(TIERS)})")
        tiers[name] = _replace(tiers[name], _table(fields, f"[tiers.{name}]", path), f"tiers.{name}", path)
    config = _replace(EngineConfig(), data, "", path)
    config.scheduler = _replace(SchedulerConfig(tiers=tiers), sched, "scheduler", path)
    config.scheduler.validate()
    return config


def load_server_config(path: str | Path) -> ServerConfig:
    """The [server] table, [[keys]] entries, [meter] table, [[budgets]] entries and [canary]
    table of the same TOML file."""
    data = _read_toml(path)
    config = _replace(ServerConfig(), _table(data.get("server", {}), "[server]", path), "server", path)
    config.keys = [_replace(KeySpec(key=""), k, "keys", path) for k in _array(data, "keys", path)]
    for key in config.keys:
        key.validate()
    config.meter = _replace(MeterConfig(), _table(data.get("meter", {}), "[meter]", path), "meter", path)
    config.meter.budgets = [_replace(BudgetSpec(limit=0.0), b, "budgets", path) for b in _array(data, "budgets", path)]
    config.canary = _replace(CanaryConfig(), _table(data.get("canary", {}), "[canary]", path), "canary", path)
    try:
        config.meter.validate()
        config.canary.validate()
    except ValueError as e:
        raise ValueError(f"config {path}: {e}") from None
    return config


def _read_toml(path: str | Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path} is not valid TOML: {e}") from None


def _array(data: dict, name: str, path) -> list[dict]:
    items = data.get(name, [])
    if not isinstance(items, list):
        raise ValueError(f"config {path}: {name} must be an array of tables ([[{name}]])")
    return [_table(item, f"[[{name}]]", path) for item in items]


def _table(value, where: str, path) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"config {path}: {where} must be a table")
    return value


# TOML value types each annotation accepts (an int is fine where a float is wanted, a bool is not).
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list[str]": (list,)}


def _replace(obj, fields: dict, section: str, path):
    where = f"[{section}]" if section else "top level"
    known = {f.name: f.type for f in dataclasses.fields(obj)}
    # Fields a table cannot set: tables of their own, or a tier's identity.
    fixed = {EngineConfig: {"scheduler"}, SchedulerConfig: {"tiers"}, TierSpec: {"name"},
             ServerConfig: {"keys", "meter", "canary"}, MeterConfig: {"budgets"}}
    unknown = set(fields) - (set(known) - fixed.get(type(obj), set()))
    if unknown:
        raise ValueError(f"config {path}: unknown key(s) {', '.join(sorted(unknown))} in {where}")
    for key, value in fields.items():
        kinds = [k.strip() for k in known[key].split("|") if k.strip() != "None"]
        allowed = tuple(t for k in kinds for t in _TYPES.get(k, ()))
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise ValueError(f"config {path}: {key} in {where} must be {' or '.join(kinds)}, got {value!r}")
    return dataclasses.replace(obj, **fields)
