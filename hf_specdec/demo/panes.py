"""What the demo shows: one pane per mode (its state while it streams, its metrics, its HTML), the plot of
accepted draft tokens per round, and the summary line. Inline styles only, so the panes look the same in any
Gradio theme and without custom CSS."""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..harness import IncrementalText

DRAFT_COLORS = ("#fcd34d", "#fde68a")  # accepted draft tokens, alternating by round
PLOT_COLORS = MappingProxyType({"assisted": "#6b7280", "hf_specdec": "#d97706", "lookahead": "#2563eb"})
STATUS_COLORS = MappingProxyType({"running": "#2563eb", "done": "#16a34a", "error": "#dc2626"})


@dataclass
class PaneRun:
    """Everything one pane shows, updated in place while its mode streams; ``row`` is the harness's
    measurement of the call once it returned (the numbers shown from then on)."""

    key: str  # the pane: "plain", "assisted", "hf_specdec" or "lookahead"
    title: str
    drafts: bool  # whether an acceptance rate applies (every mode but plain)
    status: str = "waiting"  # waiting | running | done | error
    message: str = ""
    ids: list[int] = field(default_factory=list)  # streamed so far
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (accepted draft tokens, emitted) per round
    paths: list[int | None] = field(default_factory=list)  # per round: paths verified (>1: a tree), None: unknown
    segments: list[tuple[str, str, int]] = field(default_factory=list)  # (text, "draft" | "target", round)
    row: dict[str, Any] | None = None
    t_start: float | None = None
    t_first: float | None = None
    drafted_live: int | None = None  # draft forwards so far (draft-model modes), for a live acceptance estimate
    text: IncrementalText | None = None
    divergence: str = ""  # greedy, where it left plain's output: the target's margin there (harness.margins)

    def start(self, t: float, decode: Callable[[list[int]], str]) -> None:
        self.status, self.t_start, self.text = "running", t, IncrementalText(decode)

    def add_round(self, ids: list[int], accepted: int, t: float, paths: int | None = None) -> None:
        """One round's tokens; the first ``accepted`` came from accepted draft tokens (highlighted); ``paths``:
        how many paths the round verified (more than one: a tree round, marked in the plot)."""
        if self.t_first is None:
            self.t_first = t
        index = len(self.rounds)
        self.rounds.append((accepted, len(ids)))
        self.paths.append(paths)
        self.ids.extend(ids)
        for kind, part in (("draft", ids[:accepted]), ("target", ids[accepted:])):
            piece = self.text.append(part) if part else ""
            if piece:
                self.segments.append((piece, kind, index))

    def finish(self, row: dict[str, Any], notes: list[str]) -> None:
        rest = self.text.flush() if self.text is not None else ""
        if rest:
            self.segments.append((rest, "target", max(0, len(self.rounds) - 1)))
        if row["output_ids"] != self.ids:
            notes = notes + ["the streamed tokens differ from the returned ones; tokens/s uses the returned ones"]
        self.row, self.status, self.message = row, "done", "; ".join(notes)

    def fail(self, message: str) -> None:
        self.status, self.message = "error", message

    @property
    def output_ids(self) -> list[int] | None:
        return self.row["output_ids"] if self.row is not None else None

    def acceptance(self) -> tuple[float | None, bool]:
        """(accepted / drafted draft tokens, whether that is exact); None where nothing applies or is known."""
        if not self.drafts:
            return None, True
        accepted = sum(a for a, _ in self.rounds)
        if self.row is None:
            live = None if not self.drafted_live else min(accepted / self.drafted_live, 1.0)
            return live, False
        spec = self.row.get("spec")
        if spec is not None:
            return (spec["accepted"] / spec["drafted"] if spec.get("drafted") else 0.0), True
        drafted = self.row.get("draft_forwards") or 0
        return (min(accepted / drafted, 1.0) if drafted else 0.0), True

    def metrics(self, now: float | None = None) -> dict[str, Any]:
        """tokens/s, TTFT, elapsed, mean accepted length, acceptance; None where not measured (yet)."""
        rate, exact = self.acceptance()
        if self.row is not None:
            r = self.row
            rounds = (r["spec"] or {}).get("rounds") or r["target_forwards"]
            return {"tok_s": r["tokens_per_s"], "ttft_s": r["ttft_s"], "elapsed_s": r["e2e_s"],
                    "mean_accepted_length": r["mean_accepted_length"], "acceptance_rate": rate,
                    "acceptance_exact": exact, "tokens": r["new_tokens"], "rounds": rounds}
        if self.t_start is None:
            return {"tok_s": None, "ttft_s": None, "elapsed_s": None, "mean_accepted_length": None,
                    "acceptance_rate": None, "acceptance_exact": True, "tokens": 0, "rounds": 0}
        elapsed = max((now or time.perf_counter()) - self.t_start, 1e-9)
        rounds = len(self.rounds)
        ttft = None if self.t_first is None else self.t_first - self.t_start
        return {"tok_s": len(self.ids) / elapsed, "ttft_s": ttft, "elapsed_s": elapsed,
                "mean_accepted_length": len(self.ids) / rounds if rounds else None, "acceptance_rate": rate, "acceptance_exact": exact, "tokens": len(self.ids), "rounds": rounds}


def _fmt(value, pattern: str, dash: str = "—") -> str:
    return dash if value is None else pattern.format(value)


def render_pane(run: PaneRun | None, key: str = "") -> str:
    if run is None:
        return f'<div class="hfsd-pane" data-mode="{key}" data-status="idle"></div>'
    m = run.metrics()
    rate = m["acceptance_rate"]
    if not run.drafts:
        rate_text = "— (no draft)"
    else:
        rate_text = ("" if m["acceptance_exact"] else "≈") + _fmt(None if rate is None else 100 * rate, "{:.0f}%")
    metrics = [
        ("tok_s", "tokens/s", _fmt(m["tok_s"], "{:.1f}")),
        ("ttft", "TTFT", _fmt(m["ttft_s"], "{:.2f} s")),
        ("elapsed", "elapsed", _fmt(m["elapsed_s"], "{:.2f} s")),
        ("mal", "mean accepted length", _fmt(m["mean_accepted_length"], "{:.2f}")),
        ("acceptance", "acceptance rate", rate_text),
        ("tokens", "tokens / rounds", f"{m['tokens']} / {m['rounds']}"),
    ]
    cells = "".join(
        f'<div class="hfsd-metric" data-metric="{key}" style="padding:2px 8px 2px 0">'
        f'<div style="font-size:11px;opacity:.7">{label}</div>'
        f'<div style="font-weight:600">{html.escape(value)}</div></div>'
        for key, label, value in metrics
    )
    status_color = STATUS_COLORS.get(run.status, "#6b7280")
    spans = []
    for text, kind, index in run.segments:
        if kind == "draft":
            paths = run.paths[index] if index < len(run.paths) else None
            tree = f" (a tree of {paths} paths)" if paths and paths > 1 else ""
            spans.append(f'<span class="hfsd-draft" data-round="{index}" title="round {index}: accepted draft tokens'
                         f'{tree}" '
                         f'style="background:{DRAFT_COLORS[index % 2]};color:#111;border-radius:2px">'
                         f'{html.escape(text)}</span>')
        else:
            spans.append(f'<span class="hfsd-target" data-round="{index}">{html.escape(text)}</span>')
    waiting = '<span style="opacity:.5">waiting for its turn…</span>' if run.status == "waiting" else ""
    message_color = status_color if run.status == "error" else "#6b7280"
    message = (f'<div class="hfsd-message" style="color:{message_color};font-size:13px;margin:4px 0">'
               f'{html.escape(run.message)}</div>') if run.message else ""
    return (
        f'<div class="hfsd-pane" data-mode="{run.key}" data-status="{run.status}" '
        f'style="border:1px solid #d1d5db;border-radius:8px;padding:10px;min-height:120px">'
        f'<div style="display:flex;justify-content:space-between;align-items:baseline">'
        f'<b style="font-size:15px">{html.escape(run.title)}</b>'
        f'<span class="hfsd-status" style="color:{status_color};font-size:12px">{run.status}</span></div>'
        f'<div class="hfsd-metrics" style="display:flex;flex-wrap:wrap;margin:6px 0">{cells}</div>{message}'
        f'<pre class="hfsd-text" style="white-space:pre-wrap;word-break:break-word;font-size:13px;'
        f'line-height:1.45;margin:0;max-height:420px;overflow:auto">{"".join(spans) or waiting}</pre></div>'
    )


def tree_rounds(run: PaneRun) -> list[int]:
    """Indices of the rounds that verified a tree (more than one path)."""
    return [i for i, paths in enumerate(run.paths) if paths is not None and paths > 1]


def rounds_figure(runs: list[PaneRun]):
    """Accepted draft tokens per round, one line per drafting mode; rounds that verified a tree (several of the
    draft's continuations in one forward) get a hollow triangle (matplotlib's object API, no pyplot: safe in
    Gradio's worker threads)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for run in runs:
        if not run.drafts or not run.rounds:
            continue
        accepted = [a for a, _ in run.rounds]
        ax.plot(range(len(accepted)), accepted, marker="o", markersize=3, linewidth=1.2,
                color=PLOT_COLORS.get(run.key), label=f"{run.title} (mean {sum(accepted) / len(accepted):.2f})")
        trees = tree_rounds(run)
        if trees:
            ax.scatter(trees, [accepted[i] for i in trees], marker="^", s=60, facecolors="none",
                       edgecolors=PLOT_COLORS.get(run.key), linewidths=1.2,
                       label=f"{run.title}: tree rounds ({len(trees)} of {len(accepted)})")
    ax.set_xlabel("round (one target forward)")
    ax.set_ylabel("accepted")
    ax.set_title("Accepted draft tokens per round", fontsize=10)
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no drafting mode has run yet", ha="center", va="center", transform=ax.transAxes,
                color="#6b7280")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.yaxis.get_major_locator().set_params(integer=True)
    return fig


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summary_line(runs: list[PaneRun], sampling: bool) -> str:
    """Speedup of each mode over plain (tokens/s ratio) and whether its tokens equal plain's."""
    plain = next((r for r in runs if r.key == "plain" and r.status == "done"), None)
    others = [r for r in runs if r.key != "plain"]
    if not others:
        return "Pick a second mode to compare against plain."
    if plain is None:
        return "Speedup and identity are measured against **plain**: select it (and let it finish) to see them."
    speed, same = [], []
    for r in others:
        if r.status == "error":
            speed.append(f"{r.title} failed")
        elif r.status == "done":
            speed.append(f"{r.title} **{speedup(r, plain):.2f}×**")
            first = first_difference(r.output_ids, plain.output_ids)
            note = f" ({r.divergence})" if first is not None and r.divergence else ""
            same.append(f"{r.title} ✓ identical" if first is None
                        else f"{r.title} ✗ differs from token {first}{note}")
    if not speed:
        return ""
    line = f"**Speedup over plain on this prompt:** {' · '.join(speed)}"
    if same:
        line += f"  \n**Output vs plain:** {' · '.join(same)}"
        if sampling:
            line += " (sampling at temperature > 0: each mode draws its own sample, so outputs may differ)"
    return line


def speedup(run: PaneRun, plain: PaneRun) -> float:
    return run.metrics()["tok_s"] / (plain.metrics()["tok_s"] or 1e-9)


def session_line(speedups: dict[str, list[float]]) -> str:
    """This visitor's median speedup per mode over the runs so far."""
    if not speedups:
        return ""
    parts = [f"{title} median {statistics.median(values):.2f}× over {len(values)} run(s)"
             for title, values in speedups.items()]
    return f"  \nThis session: {' · '.join(parts)}"
