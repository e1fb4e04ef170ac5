"""Which measured rows a rule may judge, and how their numbers print. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Row = Mapping[str, object]
MIN_STEPS = 3  # fewer steps than this at a context: too noisy to judge that row
STUCK_COMMIT = 1.05  # the SpecCommitLenStuckAtOne alert's threshold, same meaning
EPS = 0.01  # rounding of per-step means printed with 2 decimals
GROWTH = 3.0  # "grows faster" = by more than this factor (fixed overheads blur smaller ones)


def ctx(n: object) -> str:
    """1400 -> '1.4k', 185000 -> '185k', 512 -> '512'."""
    n = float(n)
    if n < 1000:
        return f"{n:.0f}"
    return f"{n / 1000:.1f}k".replace(".0k", "k") if n < 10_000 else f"{n / 1000:.0f}k"


def num(row: Row, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) else None


def judged(rows: Sequence[Row]) -> list[Row]:
    """Rows with enough steps, shortest context first."""
    ok = [r for r in rows if (num(r, "steps") or 0) >= MIN_STEPS and num(r, "context")]
    return sorted(ok, key=lambda r: float(r["context"]))


def ends(rows: Sequence[Row], key: str) -> tuple[Row, Row] | None:
    """(shortest, longest) context rows that both measured `key` > 0 at distinct contexts."""
    have = [r for r in judged(rows) if (num(r, key) or 0) > 0]
    if len(have) < 2 or have[0]["context"] == have[-1]["context"]:
        return None
    return have[0], have[-1]
