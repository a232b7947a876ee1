"""Structured output's cost: the grammar's work per token, and a constrained decode step against a
free one, on the embedded Gemma 3 270M.

    python benchmarks/grammar.py           # about 2 min
    python benchmarks/grammar.py --quick   # seconds, for development; writes benchmarks/out/ only

Each batch size runs the same prompts four ways: free, response_format json_object, a
json_schema, and the json_schema with every step within model/grammar.py's CLOSING_ZONE of
max_tokens (where each sampled token is also checked to leave room to close the reply; far from
max_tokens only the mask is computed). A step's time includes the grammar's work (llguidance, per
constrained row), and a constrained step needs the LM head's full logits where a free greedy step
takes only its argmax: both costs are in the ratio. The grammar's time is what the meter charges
the request alone (StepResult.own_seconds)."""
from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from llguidance import LLMatcher  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import machine_info, run_benchmark  # noqa: E402
from tollway.config import EngineConfig  # noqa: E402
from tollway.model import grammar  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.request import SamplingParams  # noqa: E402

FULL = dict(batches=(1, 16), max_tokens=64, repeats=3)  # max_tokens within CLOSING_ZONE: every step in it
QUICK = dict(batches=(1, 4), max_tokens=16, repeats=1)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "address", "tags"]}
OPTIONS = {"whitespace_flexible": False}
OBJECT = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=OPTIONS)
SCHEMA_GRAMMAR = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=OPTIONS)
CONSTRAINED = ("json_object", "json_schema", "json_schema near max_tokens")
# mode -> (grammar, CLOSING_ZONE): 0 keeps every step out of the zone, where only masks are computed
MODES = {"free": (None, 0), "json_object": (OBJECT, 0), "json_schema": (SCHEMA_GRAMMAR, 0),
         "json_schema near max_tokens": (SCHEMA_GRAMMAR, grammar.CLOSING_ZONE)}
TOPICS = ["a person", "a city", "a book", "a car", "a river", "a song", "a dog", "a planet"]


def prompt(i: int) -> str:
    return (f"<start_of_turn>user\nDescribe {TOPICS[i % len(TOPICS)]} (number {i}) as a JSON object."
            "<end_of_turn>\n<start_of_turn>model\n")


def decode(engine: Engine, batch: int, grammar: str | None, max_tokens: int) -> dict:
    """`batch` requests decoded together: every step's seconds, and the masks' seconds per row."""
    for i in range(batch):
        engine.add_request(prompt(i), SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar,
                                                     ignore_eos=grammar is None), request_id=f"r{i}")
    steps, masks, tokens = [], [], 0
    while engine.has_unfinished():
        report = engine.step()
        plan, result, outs = report.plan, report.result, report.outputs
        if all(s.is_decode for s in plan.seqs):  # decode steps only: prefill is the same either way
            steps.append(result.seconds)
            masks += list(result.own_seconds.values())
        tokens += sum(len(o.new_token_ids) for o in outs)
    return {"steps": steps, "masks": masks, "tokens": tokens}


def run(settings: dict, quick: bool) -> dict:
    started = time.perf_counter()
    engine = Engine(EngineConfig(profile_steps=False), progress=True)
    engine.add_request("warm up", SamplingParams(max_tokens=4, grammar=OBJECT))  # builds llguidance's tokenizer
    while engine.has_unfinished():
        engine.step()
    runs: dict = {}
    jobs = [(b, name) for b in settings["batches"] for name in MODES] * settings["repeats"]
    zone = grammar.CLOSING_ZONE
    for b, name in tqdm(jobs, desc="grammar", unit="run"):
        grammar.CLOSING_ZONE = MODES[name][1]
        out = decode(engine, b, MODES[name][0], settings["max_tokens"])
        run_ = runs.setdefault(str(b), {}).setdefault(name, {"steps": [], "masks": [], "tokens": 0})
        run_["steps"] += out["steps"]
        run_["masks"] += out["masks"]
        run_["tokens"] += out["tokens"]
    grammar.CLOSING_ZONE = zone
    summary = {}
    for b, by_mode in runs.items():
        free = statistics.median(by_mode["free"]["steps"])
        row = {"free_step_seconds": free}
        for name in CONSTRAINED:
            r = by_mode[name]
            step, mask = statistics.median(r["steps"]), statistics.median(r["masks"])
            row[name] = {"step_seconds": step, "step_over_free": step / free, "grammar_seconds": mask,
                         "grammar_p99_seconds": sorted(r["masks"])[int(0.99 * (len(r["masks"]) - 1))],
                         "grammar_over_free_step": mask * int(b) / free}
        summary[b] = row
    return {
        "command": "python benchmarks/grammar.py" + (" --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "settings": settings, "schema": SCHEMA,
        "runs": {b: {m: {"steps": len(r["steps"]), "masks": len(r["masks"]), "tokens": r["tokens"]}
                     for m, r in by_mode.items()} for b, by_mode in runs.items()},
        "summary": summary, "total_seconds": time.perf_counter() - started,
    }


def markdown(r: dict, json_path: str) -> str:
    m = r["machine"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m['cpu']} ({m['cores']} cores; "
        f"{', '.join(m['isa_flags'])}), raw figures in "
        f"`benchmarks/{json_path}`. Greedy decode steps of the same prompts, free and constrained; the grammar's "
        "time is one row's (llguidance's mask; near max_tokens also the check that the reply can still close); "
        "each figure is a median over the run's steps.",
        "",
        "| batch | free step ms | mode | step ms | step / free | grammar ms per row (p99) | all rows' grammar / free step |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, row in r["summary"].items():
        for name in CONSTRAINED:
            x = row[name]
            lines.append(f"| {b} | {row['free_step_seconds'] * 1e3:.1f} | {name} | {x['step_seconds'] * 1e3:.1f} | "
                         f"{x['step_over_free']:.2f} | {x['grammar_seconds'] * 1e3:.3f} ({x['grammar_p99_seconds'] * 1e3:.3f}) | "
                         f"{x['grammar_over_free_step']:.1%} |")
    lines += ["", "A constrained step also takes the LM head's full logits (a free greedy step takes only its "
              "argmax in the head's epilogue): that costs a constrained step as much as the grammar does. The meter "
              "charges the grammar's time to its own request alone."]
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("grammar", __doc__, run, markdown, FULL, QUICK)
