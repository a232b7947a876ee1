"""The ledger for people: usage tables (or CSV), and the economics per tier: what a million
output tokens cost in engine time, what they were billed, and the measured fast premium."""
from __future__ import annotations

import csv
import io

from tollway.config import TIERS
from tollway.meter.ledger import Ledger


def economics(ledger: Ledger, start: float | None = None, end: float | None = None) -> dict:
    """Per tier: requests, tokens, cost and price in total and per 1M output tokens, margin;
    and fast_premium: a fast output token's cost over a standard one's (None without both)."""
    tiers = {}
    for row in ledger.usage("tier", start, end):
        out = row["completion_tokens"] or 0
        per_m = (lambda dollars: dollars / out * 1e6) if out else (lambda _: None)
        tiers[row["tier"]] = {
            "requests": row["requests"], "prompt_tokens": row["prompt_tokens"], "completion_tokens": out,
            "engine_seconds": row["engine_seconds"], "cost": row["cost"], "price": row["price"],
            "margin": row["margin"], "cost_per_m_output": per_m(row["cost"]), "price_per_m_output": per_m(row["price"]),
        }
    fast, standard = (tiers.get(t, {}).get("cost_per_m_output") for t in ("fast", "standard"))
    return {"tiers": tiers, "fast_premium": fast / standard if fast and standard else None}


def format_report(report: dict) -> str:
    rows = [{"tier": t, **report["tiers"][t]} for t in TIERS if t in report["tiers"]]
    columns = ["tier", "requests", "completion_tokens", "cost", "price", "margin", "cost_per_m_output",
               "price_per_m_output"]
    premium = report["fast_premium"]
    tail = (f"fast premium (engine cost per output token, fast / standard): {premium:.2f}x" if premium is not None
            else "fast premium: needs fast and standard requests with output in the ledger")
    return format_table(rows, columns) + "\n" + tail


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or (list(rows[0]) if rows else [])
    if not rows:
        return "(no requests)"
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in cells]
    return "\n".join(lines)


def format_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buffer.getvalue()


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6f}" if abs(value) < 100 else f"{value:.2f}"
    return str(value)
