"""`splitflash doctor --url URL`: measure a running deployment at several context lengths
and name every anomaly in plain words (rules: splitflash/diagnosis/rules.py).

Exit code: 0 healthy, 1 anomalies found, 2 could not run (gateway unreachable, not ready,
every request refused).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from splitflash.diagnosis.doctor import DoctorReport, run_doctor
from splitflash.diagnosis.probe import DoctorError
from splitflash.diagnosis.rules import ctx

COLUMNS = (  # (row key, header, format)
    ("context", "context", "{:.0f}"),
    ("tok_s", "tok/s", "{:.1f}"),
    ("step_ms", "step ms", "{:.1f}"),
    ("mean_commit_len", "commit_len", "{:.2f}"),
    ("drafted", "drafted", "{:.2f}"),
    ("accepted_drafts", "acc drafts", "{:.2f}"),
    ("accepted_depth", "acc depth", "{:.2f}"),
    ("draft_ms", "draft ms", "{:.2f}"),
    ("verify_ms", "verify ms", "{:.2f}"),
    ("queue_ms", "queue ms", "{:.2f}"),  # a worker busy with other work (a prefill chunk)
    ("transport_ms", "transport ms", "{:.2f}"),
    ("verify_eager_fraction", "verify eager", "{:.0%}"),  # with --verify-metrics
    ("draft_eager_fraction", "draft eager", "{:.0%}"),  # with --draft-metrics, DFlash
)


def _contexts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--contexts wants integers like 1400,8192: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("--contexts needs at least one length >= 1")
    return values


def register(sub) -> None:
    p = sub.add_parser("doctor", help="measure a running gateway and name its anomalies")
    add_arguments(p)
    p.set_defaults(run=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--contexts",
        type=_contexts,
        default=[1400, 8192, 32768],
        help="prompt lengths in tokens, comma-separated (default 1400,8192,32768)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=1, help="requests per context")
    p.add_argument(
        "--draft-metrics",
        default=None,
        help="draft service /metrics URL (default: found through the gateway's /ready): "
        "adds policy mismatch, keys read and whether draft steps ran as CUDA graphs",
    )
    p.add_argument(
        "--verify-metrics",
        default=None,
        help="verify service /metrics URL (default: found through the gateway's /ready): "
        "adds bytes read per step and whether verify steps ran as CUDA graphs",
    )
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="save JSON here")
    p.add_argument("--plot", type=Path, default=None, help="save a PNG plot here")


def print_report(report: DoctorReport, console: Console) -> None:
    table = Table(title=f"splitflash doctor: {report.url} ({report.model})")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for row in report.rows:
        table.add_row(*(fmt.format(row[key]) if key in row else "-" for key, _, fmt in COLUMNS))
    console.print(table)
    p = report.policy
    console.print(
        f"drafter: {p.drafter or 'unknown'}; policy: {p.policy or 'n/a'}"
        + ("" if p.mismatch is None else f"; policy mismatch gauge: {int(p.mismatch)}")
    )
    if report.verify_info:  # what the step times above ran on
        shown = ("device", "dtype", "attention_backend", "cuda_graphs", "kv_pool")
        console.print("verify: " + "; ".join(f"{k} {report.verify_info[k]}" for k in shown
                                             if k in report.verify_info))  # fmt: skip
    for note in report.notes:
        console.print(f"[dim]{note}[/dim]")
    for s in report.skipped:
        console.print(f"[yellow]context {s['context']} not measured: {s['reason']}[/yellow]")
    if not report.findings:
        console.print("[green]healthy: no anomaly found[/green]")
    for f in report.findings:
        color = "red" if f.severity == "critical" else "yellow"
        console.print(f"[{color}]{f.severity.upper()} {f.code}[/{color}]: {f.message}")


def save_plot(report: DoctorReport, path: Path) -> None:
    """Step, draft and verify ms vs context (log-log), and mean commit_len vs context."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    rows = sorted(report.rows, key=lambda r: r["context"])
    x = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("step_ms", "step"), ("draft_ms", "draft"), ("verify_ms", "verify")):
        left.plot(x, [max(r[key], 1e-3) for r in rows], marker="o", label=label)
    left.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="ms per step",
        title="time per decode step",
    )
    right.plot(x, [r["mean_commit_len"] for r in rows], marker="o", color="tab:purple")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)  # 1.0 = no speedup
    right.set(
        xscale="log",
        xlabel="context (tokens)",
        ylabel="tokens per step",
        title="mean commit_len",
        ylim=(0, None),
    )
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(x, [ctx(v) for v in x], minor=False)
    left.legend()
    fig.suptitle(f"splitflash doctor: {len(report.findings)} finding(s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    # Piped or logged, rich would wrap the table at 80 columns and cut every header: the
    # full table is one line per context at this width.
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
    steps = len(args.contexts) + 1  # calibration, then one per context
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as bar:  # fmt: skip
            task = bar.add_task("doctor", total=steps)

            def advance(what: str) -> None:  # called as each part starts
                bar.update(task, description=what, advance=1)

            report = run_doctor(args.url, args.contexts, args.max_tokens, args.repeats,
                                args.draft_metrics, args.verify_metrics, advance)  # fmt: skip
    except DoctorError as e:
        print(f"doctor could not run: {e}", file=sys.stderr)
        return 2
    print_report(report, console)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if args.plot:
        save_plot(report, args.plot)
    return 1 if report.findings else 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m splitflash.cli.doctor_cmd`) until main.py lists doctor."""
    parser = argparse.ArgumentParser(prog="splitflash doctor", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
