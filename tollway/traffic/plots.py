"""The bench report's plots, drawn with matplotlib as inline SVG (no network when viewed).
Each takes the runs being reported (one per bench JSON) and returns SVG text, or None where
the runs hold nothing to plot."""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams["svg.fonttype"] = "none"  # text as text, not glyph paths: a fraction of the size

from tollway.traffic.records import RequestRecord  # noqa: E402
from tollway.traffic.stats import request_latencies  # noqa: E402

TIER_COLORS = {"fast": "#d62728", "standard": "#1f77b4", "batch": "#2ca02c", "all": "#444444"}
RUN_STYLES = ("-", "--", ":", "-.")


def _svg(fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def finished_figure(fig, ax, drawn: bool, xlabel: str, ylabel: str, title: str, **legend) -> str | None:
    """The figure as SVG with its labels, grid and legend; None (and closed) if nothing was drawn."""
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, **legend)
    return _svg(fig)


def _label(runs: list[dict], run: dict, what: str) -> str:
    return f"{what} ({run['label']})" if len(runs) > 1 else what


def latency_cdfs(runs: list[dict]) -> str | None:
    panels = (("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2e", "end-to-end (s)"))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    drawn = False
    for i, run in enumerate(runs):
        stages = run["stages"]
        for j, stage in enumerate(stages):
            records = [RequestRecord(**r) for r in stage["requests"] if not r["warmup"]]
            for tier in sorted({r.tier for r in records}):
                values = [request_latencies(r) for r in records if r.tier == tier]
                for ax, (metric, _) in zip(axes, panels):
                    xs = sorted(v[metric] for v in values if v[metric] is not None)
                    if not xs:
                        continue
                    ys = [(k + 1) / len(xs) for k in range(len(xs))]
                    label = _label(runs, run, tier) if j == len(stages) - 1 else None
                    ax.step(xs, ys, where="post", color=TIER_COLORS.get(tier), ls=RUN_STYLES[i % len(RUN_STYLES)],
                            alpha=0.35 + 0.65 * (j + 1) / len(stages), label=label)
                    drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, (_, title) in zip(axes, panels):
        ax.set_xlabel(title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests")
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency CDFs per tier (darker: heavier load)")
    return _svg(fig)


def pareto(runs: list[dict]) -> str | None:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drawn = False
    for i, run in enumerate(runs):
        tiers = sorted({t for s in run["stages"] for t in s["summary"]["tiers"]})
        for tier in tiers:
            points = sorted((s["summary"]["tiers"][tier]["tok_s_per_user"]["mean"], s["summary"]["all"]["output_tok_s"],
                             s["profile"]["name"]) for s in run["stages"]
                            if tier in s["summary"]["tiers"] and s["summary"]["tiers"][tier]["tok_s_per_user"]["mean"])
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], "o", ls=RUN_STYLES[i % len(RUN_STYLES)],
                    color=TIER_COLORS.get(tier), label=_label(runs, run, tier))
            for x, y, name in points:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
            drawn = True
    return finished_figure(fig, ax, drawn, "tokens/s per user (1 / TPOT)", "total output tokens/s",
                           "Throughput against speed per user, by stage")


def cost_curve(runs: list[dict]) -> str | None:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drawn = False
    for i, run in enumerate(runs):
        for tier in ["all", *sorted({t for s in run["stages"] for t in s["summary"]["tiers"]})]:
            points = sorted((s["summary"]["all"]["concurrency"], m["cost_per_m_output"]) for s in run["stages"]
                            for m in [s["summary"]["all"] if tier == "all" else s["summary"]["tiers"].get(tier)]
                            if m and m["cost_per_m_output"] is not None and s["summary"]["all"]["concurrency"])
            if not points:
                continue
            ax.plot([p[0] for p in points], [p[1] for p in points], "o", ls=RUN_STYLES[i % len(RUN_STYLES)],
                    color=TIER_COLORS.get(tier), label=_label(runs, run, tier))
            drawn = True
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    return finished_figure(fig, ax, drawn, "requests in flight (mean)", "$ per 1M output tokens",
                           "Cost per 1M output tokens against concurrency")


def step_sizes(runs: list[dict]) -> str | None:
    fig, ax = plt.subplots(figsize=(12, 3.4))
    drawn = False
    for i, run in enumerate(runs):
        for j, stage in enumerate(run["stages"]):
            points = stage["steps"]
            if not points:
                continue
            ax.plot([p["t"] for p in points], [p["seqs_per_step"] for p in points], ls=RUN_STYLES[i % len(RUN_STYLES)],
                    color="#444444", label=_label(runs, run, "sequences per step") if j == 0 else None)
            if len(runs) == 1:
                ax.axvspan(stage["start"], stage["end"], color="#1f77b4" if j % 2 else "#ff7f0e", alpha=0.07)
                ax.text(stage["start"], 1.0, stage["profile"]["name"], fontsize=7, va="top",
                        transform=ax.get_xaxis_transform())
            drawn = True
    return finished_figure(fig, ax, drawn, "seconds since the bench started", "sequences per step (mean)",
                           "The server's step size over time (from /metrics)", loc="upper right")


PLOTS = (("latency", "Latency distributions", latency_cdfs),
         ("pareto", "Throughput against speed per user", pareto),
         ("cost", "Cost against concurrency", cost_curve),
         ("steps", "Step size over time", step_sizes))
