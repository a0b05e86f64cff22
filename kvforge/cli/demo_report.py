"""What ``kvforge demo`` reports: the counts, checks and timings of a run, and their tables.

:class:`DemoResult` is everything a run measured (``counts()`` leaves out the timings, so two
runs with the same config compare equal); :func:`print_summary` prints it as rich tables and
ends with the one line scripts read: ``verified N entries, M mismatched``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, computed_field

from kvforge.cli.demo_prefix import PrefixDemoResult
from kvforge.cli.formatting import console, format_bytes
from kvforge.verify import EntryCheck

__all__ = ["DemoResult", "GroupUsage", "VerifyCount", "print_summary"]


class GroupUsage(BaseModel):
    """Block use of one group over the run."""

    group: str
    kind: str
    block_size: int
    bytes_per_block: int
    usable_blocks: int
    peak_used_blocks: int
    host_usable_pages: int
    """0 when the group has nothing to offload."""
    host_peak_used_pages: int


class VerifyCount(BaseModel):
    """Entries checked at one kind of checkpoint, and how many differed."""

    entries: int = 0
    mismatched: int = 0

    def add(self, check: EntryCheck) -> None:
        self.entries += check.entries
        self.mismatched += check.mismatched


class DemoResult(BaseModel):
    """Everything a demo run measured. ``counts()`` leaves out the timings."""

    model: str
    device: str
    seed: int
    requests_total: int
    requests_finished: int
    steps: int
    tokens_generated: int
    """Decode tokens written (one per running request per step)."""
    prompt_tokens_written: int
    """Prefill positions written, re-prefills of recomputed requests included."""
    preemptions: int
    """Swap outs (purpose ``preempt``)."""
    swap_ins: int
    most_swapped: int
    """The most requests swapped out at the same time."""
    recomputes: int
    """Preemptions that dropped a request to recompute it later (host pool full)."""
    bytes_swapped_out: int
    bytes_swapped_in: int
    swap_out_seconds: float
    swap_in_seconds: float
    wall_seconds: float
    device_memory_budget: int
    device_cache_bytes: int
    host_cache_bytes: int
    device_share: float
    """Share of the requests' combined peak block demand the device pools hold, per group."""
    longest_request: int
    """Tokens the longest request reaches."""
    groups: list[GroupUsage]
    verify_finished: VerifyCount
    """Requests verified when they finished (or before a recompute dropped them)."""
    verify_swap_in: VerifyCount
    """Requests verified right after each swap-in."""
    verify_end: VerifyCount
    """Requests still live when the run stopped."""
    running_at_end: int
    """Requests running when the run stopped (``max_steps``), verified then freed."""
    swapped_at_end: int
    """Requests swapped out when the run stopped, swapped back in, verified, then freed."""
    unverified_requests: int
    """Requests holding entries that could not be checked (0 unless something went wrong)."""
    corrupted: bool
    """The self-test flipped a byte."""
    prefix: PrefixDemoResult | None = None
    """The prefix-reuse phase (``None`` when skipped)."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def entries_verified(self) -> int:
        prefix = self.prefix.entries_verified if self.prefix else 0
        return (
            self.verify_finished.entries
            + self.verify_swap_in.entries
            + self.verify_end.entries
            + prefix
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def entries_mismatched(self) -> int:
        return (
            self.verify_finished.mismatched
            + self.verify_swap_in.mismatched
            + self.verify_end.mismatched
            + (self.prefix.entries_mismatched if self.prefix else 0)
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """True when every checked entry matched and nothing was left unchecked."""
        return self.entries_mismatched == 0 and self.unverified_requests == 0

    @staticmethod
    def _gbps(nbytes: int, seconds: float) -> float | None:
        return nbytes / seconds / 1e9 if seconds > 0 else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def swap_out_gbps(self) -> float | None:
        """Bytes swapped out per second spent in ``swap_out`` (GB/s)."""
        return self._gbps(self.bytes_swapped_out, self.swap_out_seconds)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def swap_in_gbps(self) -> float | None:
        """Bytes swapped in per second spent in ``swap_in`` (GB/s)."""
        return self._gbps(self.bytes_swapped_in, self.swap_in_seconds)

    def counts(self) -> dict[str, Any]:
        """Everything except timings: equal for two runs with the same config."""
        timings = {"swap_out_seconds", "swap_in_seconds", "wall_seconds"}
        return self.model_dump(exclude=timings | {"swap_out_gbps", "swap_in_gbps"})

    def summary_line(self) -> str:
        """The last line the CLI prints."""
        return f"verified {self.entries_verified} entries, {self.entries_mismatched} mismatched"


def _rate(gbps: float | None) -> str:
    return f"{gbps:.2f} GB/s" if gbps is not None else "-"


def _run_rows(result: DemoResult) -> list[tuple[str, str]]:
    """The run's counts, bytes, throughputs and sizes, one (what, value) row each."""
    return [
        ("requests finished / total", f"{result.requests_finished} / {result.requests_total}"),
        ("seed", str(result.seed)),
        ("steps", f"{result.steps:,}"),
        ("tokens generated (decode)", f"{result.tokens_generated:,}"),
        ("prompt tokens written (prefill)", f"{result.prompt_tokens_written:,}"),
        ("preemptions (swap outs)", f"{result.preemptions:,}"),
        ("swap ins", f"{result.swap_ins:,}"),
        ("most requests swapped out at once", f"{result.most_swapped:,}"),
        ("recomputes (host pool full)", f"{result.recomputes:,}"),
        ("bytes swapped out", format_bytes(result.bytes_swapped_out)),
        ("bytes swapped in", format_bytes(result.bytes_swapped_in)),
        ("swap-out throughput", _rate(result.swap_out_gbps)),
        ("swap-in throughput", _rate(result.swap_in_gbps)),
        (
            "device cache (budget)",
            f"{format_bytes(result.device_cache_bytes)} "
            f"({format_bytes(result.device_memory_budget)})",
        ),
        ("device pools hold (share of peak demand)", f"{result.device_share:.0%}"),
        ("longest request", f"{result.longest_request:,} tokens"),
        ("host cache", format_bytes(result.host_cache_bytes)),
        ("wall time", f"{result.wall_seconds:.2f} s"),
    ]


def _two_columns(title: str, rows: list[tuple[str, str]]) -> Any:
    """A headerless table of (what, value) rows, values right-aligned."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in rows:
        table.add_row(what, value)
    return table


def _groups_table(result: DemoResult) -> Any:
    from rich.table import Table

    groups = Table(title="blocks per group (peak used / usable)")
    for col in ("group", "kind", "block size", "device peak", "device usable", "use", "host peak"):
        groups.add_column(col, justify="left" if col in ("group", "kind") else "right")
    for g in result.groups:
        use = f"{100 * g.peak_used_blocks // max(1, g.usable_blocks)}%"
        host = f"{g.host_peak_used_pages} / {g.host_usable_pages}" if g.host_usable_pages else "-"
        groups.add_row(
            g.group,
            g.kind,
            str(g.block_size),
            f"{g.peak_used_blocks:,}",
            f"{g.usable_blocks:,}",
            use,
            host,
        )
    return groups


def _checks_table(result: DemoResult) -> Any:
    from rich.table import Table

    checks = Table(title="byte-for-byte verification")
    for col in ("checkpoint", "entries", "mismatched"):
        checks.add_column(col, justify="left" if col == "checkpoint" else "right")
    for what, count in (
        ("finished requests (before free)", result.verify_finished),
        ("after each swap-in", result.verify_swap_in),
        (
            f"still live at the end ({result.running_at_end} running, "
            f"{result.swapped_at_end} swapped)",
            result.verify_end,
        ),
    ):
        checks.add_row(what, f"{count.entries:,}", f"{count.mismatched:,}")
    return checks


def _host_tier_rows(p: PrefixDemoResult) -> list[tuple[str, str]]:
    """Where the hits came from with the host tier alone (none without it)."""
    if p.tier != "host":
        return []
    return [
        ("  of them from the device", f"{p.hit_tokens - p.host_hit_tokens:,}"),
        (
            "  of them from host tier pages",
            f"{p.host_hit_tokens:,} ({p.host_blocks:,} blocks brought back)",
        ),
        ("blocks the device evicted into host pages", f"{p.host_demotions:,}"),
    ]


def _reuse_rows(p: PrefixDemoResult) -> list[tuple[str, str]]:
    """The prefix-reuse table's rows (two engines: the remote tier's rows too)."""
    two = p.engines > 1
    each, by_b = (" (each engine)", " (engine B)") if two else ("", "")
    return [
        ("conversations / turns" + each, f"{p.conversations} / {p.turns}"),
        ("prompt tokens" + each, f"{p.prompt_tokens:,}"),
        *(_remote_rows(p) if two else []),
        ("served from cache" + by_b, f"{p.hit_tokens:,} ({p.hit_rate:.1%})"),
        *_host_tier_rows(p),
        *(_store_rows(p) if two else []),
        ("reuse boundary (LCM of block sizes)", f"{p.boundary} tokens"),
        (
            "entries verified (reused included" + (", both engines)" if two else ")"),
            f"{p.entries_verified:,}",
        ),
        ("mismatched", f"{p.entries_mismatched:,}"),
    ]


def print_summary(result: DemoResult, out: Any = None) -> None:
    """Print ``result`` as rich tables; the very last line is ``verified N entries, M mismatched``.

    Args:
        result: what :func:`run_demo` returned.
        out: a rich ``Console`` (default: :func:`kvforge.cli.formatting.console`).
    """
    out = out or console()
    out.print(_two_columns(f"kvforge demo: {result.model} on {result.device}", _run_rows(result)))
    out.print(_groups_table(result))
    out.print(_checks_table(result))
    if result.prefix is not None:
        p = result.prefix
        out.print(_two_columns("prefix reuse (multi-turn, shared system prompt)", _reuse_rows(p)))
        for note in p.notes:
            out.print(f"note: {note}", markup=False, highlight=False)
    if result.corrupted:
        out.print("self-test: one byte of one live entry was flipped on purpose")
    if result.unverified_requests:
        out.print(f"{result.unverified_requests} requests could not be verified")
    out.print(result.summary_line(), markup=False, highlight=False, soft_wrap=True)


def _remote_rows(p: PrefixDemoResult) -> list[tuple[str, str]]:
    """How the remote-tier run was set up: the store, its server, the two engines."""
    server = "started by the demo" if p.server == "started" else f"given, {p.server}"
    rate = p.writer_hit_tokens / p.prompt_tokens if p.prompt_tokens else 0.0
    return [
        ("store (server)", f"{p.backend} ({server})"),
        ("engines", "A publishes, then B reuses (two controllers, one process)"),
        ("served from cache (engine A, empty store)", f"{p.writer_hit_tokens:,} ({rate:.1%})"),
    ]


def _store_rows(p: PrefixDemoResult) -> list[tuple[str, str]]:
    """Engine B's hits by where they came from, and the store's traffic."""
    host_only = max(0, p.host_hit_tokens - p.remote_hit_tokens)
    return [
        ("  of them from the device", f"{p.hit_tokens - p.host_hit_tokens:,}"),
        ("  of them from host pages", f"{host_only:,}"),
        ("  of them from the store (fetched into host pages)", f"{p.remote_hit_tokens:,}"),
        ("values fetched / missed (engine B)", f"{p.remote_fetched:,} / {p.remote_fetch_misses:,}"),
        (
            "values published (engine A) / stored",
            f"{p.remote_published:,} / {p.remote_stored:,}",
        ),
    ]
