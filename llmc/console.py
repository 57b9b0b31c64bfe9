"""Terminal output for the CLI: stage progress with timings and the build summary table."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

console = Console(stderr=True, highlight=False)
out = Console(highlight=False)

_STATUS_STYLE = {"ran": "green", "cached": "cyan", "skipped": "yellow"}


class RichReporter:
    """The pipeline's Reporter: one progress line per running stage, one result line per finished one."""

    def __init__(self) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[stage]:<8}"),
                                 TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = None
        self.description = ""

    def __enter__(self) -> "RichReporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def stage_started(self, name: str, description: str) -> None:
        self.description = description
        self.task = self.progress.add_task(description, stage=name, total=None)

    def stage_progress(self, done: int, total: int, what: str = "") -> None:
        """The stage's bar at `done` of `total`; `what` (what is counted, how fast) beside its description."""
        description = f"{self.description}: {what}" if what else self.description
        self.progress.update(self.task, completed=done, total=total, description=description)

    def stage_finished(self, result) -> None:
        self.progress.remove_task(self.task)
        style = _STATUS_STYLE.get(result.status, "white")
        line = Text.assemble(("✓ ", style), (f"{result.name:<8} ", "bold"), (f"{result.status:<7}", style),
                             f"{result.seconds:6.1f}s  {result.summary}")
        self.progress.console.print(line)


def summary_table(result) -> Table:
    table = Table(title=f"llmc build → {result.output}", title_justify="left")
    for col in ("stage", "status", "time", "result"):
        table.add_column(col)
    for s in result.stages:
        table.add_row(s.name, Text(s.status, style=_STATUS_STYLE.get(s.status, "white")), f"{s.seconds:.1f}s",
                      Text(s.summary))
    table.add_row("total", "", f"{sum(s.seconds for s in result.stages):.1f}s", "", style="bold")
    return table


def sections_table(sections) -> list[Table]:
    tables = []
    for sec in sections:
        t = Table(title=sec.title, title_justify="left", show_header=False)
        t.add_column(style="bold")
        t.add_column(overflow="fold")
        for k, v in sec.rows:
            t.add_row(Text(k), Text(v))  # plain text: shapes like [batch, seq] are not markup
        tables.append(t)
    return tables


class progress_bar:
    """`with progress_bar("what") as advance: advance(done, total)`: a transient bar on stderr."""

    def __init__(self, description: str):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.description = description

    def __enter__(self):
        self.progress.start()
        task = self.progress.add_task(self.description, total=None)
        return lambda done, total: self.progress.update(task, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        self.progress.stop()


def bench_table(results: dict) -> Table:
    table = Table(title="llmc bench (streaming over gRPC)", title_justify="left")
    for col in ("run", "requests", "errors", "TTFT p50 / p90 / p99", "ITL p50 / p90 / p99", "latency p50 / p90 / p99",
                "tokens/s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        table.add_row(name, str(r["requests"]), str(r["errors"]),
                      *(" / ".join(ms(r[f"{m}_{p}"]) for p in ("p50", "p90", "p99")) for m in ("ttft_s", "itl_s", "latency_s")),
                      f"{r['tokens_per_s']:.1f}")
    return table
