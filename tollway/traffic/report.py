"""The bench report: read bench JSON files, recompute their summaries (under new SLOs or a
new price, if asked), and write one self-contained HTML page: plots as inline SVG, tables,
no scripts and nothing fetched when it is viewed. Several files make one merged report."""
from __future__ import annotations

import datetime
import html
import json
from pathlib import Path

from tollway.traffic.console import fmt_ms, fmt_num
from tollway.traffic.plots import PLOTS
from tollway.traffic.records import RequestRecord
from tollway.traffic.results import FORMAT
from tollway.traffic.stats import SLO, summarize

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { padding: 3px 9px; border-bottom: 1px solid #eee; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure.plot { margin: 1em 0; } figure.plot svg { max-width: 100%; height: auto; }
.missing { color: #888; font-style: italic; } .meta { color: #555; }
"""


def load_result(path: Path) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not JSON") from None
    if not isinstance(result, dict) or result.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tollway bench result ({FORMAT})")
    return result


def resummarize(result: dict, slo: SLO | None = None, usd_per_hour: float | None = None) -> dict:
    """The same run under other SLOs or another price: every summary recomputed from the records."""
    slo = slo if slo is not None else SLO(result["slo"])
    price = usd_per_hour if usd_per_hour is not None else result["usd_per_hour"]
    stages = [{**s, "summary": summarize([RequestRecord(**r) for r in s["requests"]], slo, price)}
              for s in result["stages"]]
    return {**result, "slo": slo.limits, "usd_per_hour": price, "stages": stages}


def write_report(results: list[dict], output: Path) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    path = output / "report.html"
    path.write_text(render(results))
    return path


def render(results: list[dict]) -> str:
    labels = [r["label"] for r in results]
    if len(set(labels)) < len(labels):  # merged files of the same server: tell them apart by date
        for r in results:
            r["label"] = f"{r['label']} {r['date']}"
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>tollway bench: "
             f"{html.escape(', '.join(labels))}</title><style>{STYLE}</style></head><body>",
             "<h1>tollway bench</h1>"]
    for r in results:
        w = r["workload"]
        source = f"dataset {w['dataset']}" if w["dataset"] else f"prompts {_lengths(w['prompt'])} tokens"
        parts.append(
            f"<p class='meta'><b>{html.escape(r['label'])}</b>: model {html.escape(r['model'])} at "
            f"{html.escape(r['url'])} ({r['endpoint']}), {r['date']}. Workload: {source}, outputs "
            f"{_lengths(w['output'])} tokens{' (ignore_eos)' if w['ignore_eos'] else ''}, tiers "
            f"{html.escape(', '.join(f'{t} {s:.0%}' for t, s in w['mix'].items()))}, seed {w['seed']}. "
            f"SLOs: {html.escape(_slo_text(r['slo']))}. Cost: "
            f"{'$%.2f/hour' % r['usd_per_hour'] if r['usd_per_hour'] is not None else 'the server’s usage.cost, where given'}."
            "</p>")
        missing = r.get("simulation", {}).get("left_out")
        if missing:
            parts.append("<p class='meta left-out'>Not simulated: " + "; ".join(html.escape(m) for m in missing)
                         + ".</p>")
    for key, title, draw in PLOTS:
        svg = draw(results)
        body = svg if svg else f"<p class='missing'>Nothing to plot: {_why_missing(key)}</p>"
        parts.append(f"<h2>{title}</h2><figure class='plot' id='plot-{key}' data-drawn='{int(bool(svg))}'>{body}</figure>")
    parts.append("<h2>Per stage and tier</h2>")
    for r in results:
        for s in r["stages"]:
            parts.append(f"<h3>{html.escape(r['label'])}: {html.escape(s['profile']['name'])} "
                         f"({s['summary']['window']:.1f} s measured)</h3>")
            parts.append(_stage_table(s["summary"]))
    generated = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    parts.append(f"<p class='meta'>Generated {generated} by tollway. Definitions: TTFT from send to the first "
                 "text; TPOT = (end-to-end - TTFT) / (output tokens - 1); tok/s per user = 1 / TPOT; "
                 "throughput over the measured window.</p></body></html>")
    return "\n".join(parts)


def _stage_table(summary: dict) -> str:
    columns = ("tier", "requests", "errors", "TTFT p50 / p90 / p99 ms", "TPOT p50 / p90 / p99 ms",
               "E2E p50 / p99 s", "ITL p50 ms", "tok/s per user", "req/s", "output tok/s", "total tok/s",
               "goodput req/s", "$ per 1M output")
    rows = ["<table><tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>"]
    for name, m in [*summary["tiers"].items(), ("all", summary["all"])]:
        errors = ", ".join(f"{k} {v}" for k, v in m["errors"].items()) or "0"
        cells = [name, f"{m['completed']} / {m['requests']}", errors,
                 " / ".join(fmt_ms(m["ttft"][q]) for q in ("p50", "p90", "p99")),
                 " / ".join(fmt_ms(m["tpot"][q]) for q in ("p50", "p90", "p99")),
                 " / ".join(fmt_num(m["e2e"][q], ".2f") for q in ("p50", "p99")), fmt_ms(m["itl"]["p50"]),
                 fmt_num(m["tok_s_per_user"]["mean"]), fmt_num(m["requests_per_s"], ".2f"), fmt_num(m["output_tok_s"]),
                 fmt_num(m["total_tok_s"]), fmt_num(m["goodput_requests_per_s"], ".2f"), fmt_num(m["cost_per_m_output"], ".4f")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "".join(rows) + "</table>"


def _why_missing(key: str) -> str:
    return {"latency": "no request completed.",
            "pareto": "no stage has requests with more than one output token.",
            "cost": "no cost: pass --usd-per-hour, or bench a server that reports usage.cost (tollway).",
            "steps": "the server does not expose tollway's step metrics at /metrics."}[key]


def _lengths(spec: dict) -> str:
    if spec["low"] == spec["high"] == spec["mean"]:
        return str(spec["mean"])
    return f"mean {spec['mean']} (sd {spec['stdev']:g}, {spec['low']}–{spec['high'] or '∞'})"


def _slo_text(limits: dict) -> str:
    if not limits:
        return "none"
    return "; ".join(f"{'all tiers' if t == '*' else t}: " + ", ".join(f"{m} ≤ {v * 1e3:g} ms" for m, v in x.items())
                     for t, x in limits.items())

