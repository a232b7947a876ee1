"""The advisor's answer in three forms: a table for the terminal, JSON, and a self-contained
HTML page (the bench report's style) with a plot of cost per 1M output tokens against TPOT
p99 for each class in each lane."""
from __future__ import annotations

import html
import json
from pathlib import Path

from rich.table import Table

from tollway.sim.advisor import Advice
from tollway.traffic.console import fmt_ms, fmt_num
from tollway.traffic.plots import TIER_COLORS, finished_figure, plt
from tollway.traffic.report import STYLE

_MARKERS = "os^DvP*X"


def title(advice: Advice) -> str:
    return (f"tollway advise: {len(advice.classes)} classes on {advice.replicas} x {advice.hardware}"
            + (" (estimate from specs)" if advice.estimate else "")
            + f", ${advice.usd_per_hour:.2f}/hour")


def table(advice: Advice) -> Table:
    out = Table(title=title(advice), title_justify="left")
    for column in ("class", "req/s", "SLO", "lane", "TTFT p99", "TPOT p99", "$/1M out", "verdict"):
        out.add_column(column, justify="left" if column in ("class", "SLO", "lane", "verdict") else "right")
    for c in advice.classes:
        t = c.traffic
        slo = ", ".join(f"{m} {fmt_ms(s)} ms" for m, s in t.slo.items()) + f" at p{t.percentile * 100:g}"
        for k, (lane, o) in enumerate(c.lanes.items()):
            verdict = "recommended" if lane == c.lane else o.why_not
            out.add_row(t.name if k == 0 else "", f"{t.rate:g}" if k == 0 else "", slo if k == 0 else "",
                        ("» " if lane == c.lane else "  ") + lane, f"{fmt_ms(o.ttft_p99)} ms", f"{fmt_ms(o.tpot_p99)} ms",
                        fmt_num(o.cost_per_m_output, ".4f"), verdict)
        if c.lane is None:
            out.add_row("", "", "", "", "", "", "", "[bold]no lane meets its SLOs[/bold]")
        out.add_section()
    return out


def summary_line(advice: Advice) -> str:
    lanes = ", ".join(f"{c.traffic.name} → {c.lane or 'none meets its SLOs'}" for c in advice.classes)
    return (f"recommended: {lanes}; fleet ${advice.usd_per_hour:.2f}/hour, "
            f"${fmt_num(advice.cost_per_m_output, '.4f')} per 1M output tokens for the mix "
            f"({advice.simulations} simulations of {advice.requests} requests, {advice.search})")


def cost_against_tpot(advice: Advice) -> str | None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for k, c in enumerate(advice.classes):
        marker = _MARKERS[k % len(_MARKERS)]
        for lane, o in c.lanes.items():
            if o.tpot_p99 is None or o.cost_per_m_output is None:
                continue
            chosen = lane == c.lane
            ax.scatter(o.tpot_p99 * 1e3, o.cost_per_m_output, marker=marker, s=110 if chosen else 45,
                       color=TIER_COLORS[lane], edgecolors="black" if chosen else "none",
                       label=f"{c.traffic.name} in {lane}" + (" (recommended)" if chosen else ""))
            drawn = True
        if "tpot" in c.traffic.slo:
            ax.axvline(c.traffic.slo["tpot"] * 1e3, color="#888", linestyle=":", linewidth=1)
    return finished_figure(fig, ax, drawn, "TPOT p99 (ms); dotted: each class's TPOT SLO", "$ per 1M output tokens",
                           "Each class in each lane", loc="best")


def render(advice: Advice) -> str:
    svg = cost_against_tpot(advice)
    rows = []
    for c in advice.classes:
        for lane, o in c.lanes.items():
            rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
                c.traffic.name, lane + (" (recommended)" if lane == c.lane else ""), f"{fmt_ms(o.ttft_p99)} ms",
                f"{fmt_ms(o.tpot_p99)} ms", fmt_num(o.cost_per_m_output, ".4f"),
                "yes" if o.meets and not o.breaks else "no", o.why_not)) + "</tr>")
    return "\n".join([
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title(advice))}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title(advice))}</h1>",
        f"<p class='meta'>{html.escape(summary_line(advice))}</p>",
        "<h2>Cost per 1M output tokens against TPOT p99</h2>",
        f"<figure class='plot' id='plot-cost-tpot'>{svg or '<p class=missing>Nothing to plot</p>'}</figure>",
        "<h2>Each class in each lane</h2><table><tr><th>class</th><th>lane</th><th>TTFT p99</th><th>TPOT p99</th>"
        "<th>$/1M out</th><th>serves it</th><th>why not</th></tr>", *rows, "</table></body></html>"])


def write(advice: Advice, output: Path) -> tuple[Path, Path]:
    """advice.json and advice.html in the folder `output`."""
    output.mkdir(parents=True, exist_ok=True)
    json_path, html_path = output / "advice.json", output / "advice.html"
    json_path.write_text(json.dumps(advice.to_dict(), indent=1))
    html_path.write_text(render(advice))
    return json_path, html_path
