"""Plays a schedule's action lists against compute and transfer times: step time, idle, bubble, memory.

The model (the same one the cutter optimises, see [Note: transfer cost] in
``coordinator/planning/cutting.py``):

- each stage runs its actions one after another, never two at once, from its start time
  (``StageCosts.start_s``, 0 by default);
- FORWARD and BACKWARD take the stage's per-microbatch compute time;
- a SEND keeps the sender busy for the transfer time of what crosses the cut; the
  tensors are available to the receiver when the send ends (eager sends, see
  [Note: send semantics] in ``services/compute/actions.py``);
- a RECV waits (idle) until the matching send has ended, then keeps the receiver busy for
  the same transfer time;
- a microbatch's activations are held from the start of its forward to the end of its
  backward.

A :class:`~coordinator.planning.schedules.Schedule` is valid by construction, deadlock
freedom included, so every action gets played.

Everything a stage spends waiting is idle; the bubble fraction is total idle time over
``num_stages * step_time``. For equal stages and free transfers it is ``(p-1)/(m+p-1)``
for GPipe and 1F1B alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coordinator.planning.schedules import Schedule
from services.protocol import Action, ActionKind

__all__ = ["SimResult", "StageCosts", "TimedAction", "draw_timeline", "simulate"]


@dataclass(frozen=True)
class StageCosts:
    """Per-microbatch times of a pipeline, in seconds.

    Args:
        forward_s: Forward time of each stage (length p).
        backward_s: Backward time of each stage (length p).
        activation_transfer_s: ``[c]`` is the time to move one microbatch's activations
            across the cut between stage c and c+1 (length p-1); each endpoint pays it.
        gradient_transfer_s: The same for gradients flowing from c+1 back to c (length p-1).
        activation_bytes: Bytes one microbatch's activations hold on each stage (length p,
            or empty when memory is not of interest).
        start_s: When each stage can begin its first action (length p, or empty: at 0),
            e.g. after applying the previous step's update.

    Raises:
        ValueError: On inconsistent lengths or negative times.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_transfer_s: tuple[float, ...]
    gradient_transfer_s: tuple[float, ...]
    activation_bytes: tuple[float, ...] = ()
    start_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        p = len(self.forward_s)
        lengths = (len(self.backward_s), len(self.activation_transfer_s) + 1,
                   len(self.gradient_transfer_s) + 1)
        if (p < 1 or any(n != p for n in lengths) or len(self.activation_bytes) not in (0, p)
                or len(self.start_s) not in (0, p)):
            raise ValueError(f"inconsistent stage cost lengths for {p} stages: {lengths}")
        times = (*self.forward_s, *self.backward_s, *self.activation_transfer_s, *self.gradient_transfer_s,
                 *self.start_s)
        if any(t < 0 for t in times):
            raise ValueError("stage costs must be >= 0")

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(cls, num_stages: int, forward_s: float, backward_s: float,
                transfer_s: float = 0.0) -> StageCosts:
        """Equal stages with one transfer time for every cut and direction."""
        cuts = (transfer_s,) * (num_stages - 1)
        return cls((forward_s,) * num_stages, (backward_s,) * num_stages, cuts, cuts)


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One played action: it ran from ``start`` to ``end`` (a RECV's wait precedes ``start``)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts for one step.

    Attributes:
        step_time_s: When the last stage finishes its last action.
        timeline: Per stage, its played actions in order.
        busy_s: Per stage, time spent computing, sending or receiving.
        idle_s: Per stage, ``step_time_s - busy_s`` (waiting, fill and drain included).
        bubble_fraction: ``sum(idle_s) / (num_stages * step_time_s)``.
        held: Per stage, ``(time, microbatches held)`` after every change.
        peak_in_flight: Per stage, the most microbatches held at once.
        peak_activation_bytes: Per stage, ``peak_in_flight * activation_bytes`` (0 if unknown).
    """

    schedule_name: str
    step_time_s: float
    timeline: tuple[tuple[TimedAction, ...], ...]
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    bubble_fraction: float
    held: tuple[tuple[tuple[float, int], ...], ...]
    peak_in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]

    def summary(self) -> str:
        """A small table: one row per stage (busy, idle, peak microbatches held)."""
        rows = [f"{self.schedule_name}: step {self.step_time_s * 1e3:.3f} ms, "
                f"bubble {self.bubble_fraction:.1%}",
                f"{'stage':>5} {'busy ms':>10} {'idle ms':>10} {'peak held':>9}"]
        for s, (busy, idle, peak) in enumerate(zip(self.busy_s, self.idle_s, self.peak_in_flight,
                                                   strict=True)):
            rows.append(f"{s:>5} {busy * 1e3:>10.3f} {idle * 1e3:>10.3f} {peak:>9}")
        return "\n".join(rows)


def _duration(a: Action, costs: StageCosts) -> float:
    if a.kind == "F":
        return costs.forward_s[a.stage]
    if a.kind == "B":
        return costs.backward_s[a.stage]
    assert a.peer is not None
    cut = min(a.stage, a.peer)
    gradient = a.kind in ("SEND_B", "RECV_B")
    return costs.gradient_transfer_s[cut] if gradient else costs.activation_transfer_s[cut]


def simulate(schedule: Schedule, costs: StageCosts) -> SimResult:
    """Plays ``schedule`` against ``costs`` (see the module docstring for the model).

    Args:
        schedule: The schedule (valid, so free of deadlocks).
        costs: Times of as many stages as the schedule has.

    Returns:
        The predicted step, per-stage idle time, bubble fraction and activations held.

    Raises:
        ValueError: If the stage counts differ.
    """
    p = schedule.num_stages
    if costs.num_stages != p:
        raise ValueError(f"schedule has {p} stages, costs describe {costs.num_stages}")
    arrival: dict[tuple[int, int, int], float] = {}  # (src, dst, microbatch) -> send end
    clock = list(costs.start_s) if costs.start_s else [0.0] * p
    pos = [0] * p
    played: list[list[TimedAction]] = [[] for _ in range(p)]
    busy = list(clock)  # the time before the start counts as busy (applying an update)
    held: list[list[tuple[float, int]]] = [[(0.0, 0)] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(schedule.actions):
            while pos[s] < len(acts):
                a = acts[pos[s]]
                start = clock[s]
                if a.kind in ("RECV_F", "RECV_B"):
                    assert a.peer is not None
                    key = (a.peer, s, a.microbatch)
                    if key not in arrival:
                        break
                    start = max(start, arrival[key])
                end = start + _duration(a, costs)
                if a.kind in ("SEND_F", "SEND_B"):
                    assert a.peer is not None
                    arrival[(s, a.peer, a.microbatch)] = end
                elif a.kind == "F":
                    held[s].append((start, held[s][-1][1] + 1))
                elif a.kind == "B":
                    held[s].append((end, held[s][-1][1] - 1))
                played[s].append(TimedAction(a, start, end))
                busy[s] += end - start
                clock[s] = end
                pos[s] += 1
                progress = True
    assert pos == [len(acts) for acts in schedule.actions], "a Schedule is free of deadlocks by construction"
    step = max(clock)
    idle = tuple(step - b for b in busy)
    peaks = tuple(max(n for _, n in h) for h in held)
    act_bytes = costs.activation_bytes or (0.0,) * p
    return SimResult(
        schedule_name=schedule.name,
        step_time_s=step,
        timeline=tuple(tuple(t) for t in played),
        busy_s=tuple(busy),
        idle_s=idle,
        bubble_fraction=sum(idle) / (p * step) if step > 0 else 0.0,
        held=tuple(tuple(h) for h in held),
        peak_in_flight=peaks,
        peak_activation_bytes=tuple(n * b for n, b in zip(peaks, act_bytes, strict=True)),
    )


_COLOURS: dict[ActionKind, str] = {"F": "#4e79a7", "B": "#59a14f", "SEND_F": "#bab0ac", "SEND_B": "#bab0ac",
                                   "RECV_F": "#d7d2cb", "RECV_B": "#d7d2cb"}


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def draw_timeline(result: SimResult, path: str | Path, *, title: str = "", width: int = 1200) -> Path:
    """Draws the predicted timeline (stage x time, one box per action) as an SVG file, or with matplotlib.

    Forward boxes are blue, backward green, sends and receives grey and thin; each compute
    box is labelled with its microbatch. Gaps are idle time. A path ending in ``.svg`` is
    written here with no dependency; any other suffix (``.png``, ``.pdf``) by matplotlib
    (``coordinator/planning/timeline_plot.py``, the optional extra ``plot``).

    Args:
        result: A simulation result.
        path: Where to write the picture (parent directories must exist).
        title: A caption; defaults to the schedule name, step time and bubble.
        width: SVG width in pixels.

    Returns:
        The path written.

    Raises:
        ValueError: A non-SVG picture without matplotlib, or in a format it cannot write.
    """
    caption = title or (f"{result.schedule_name}: step {result.step_time_s * 1e3:.3f} ms, "
                        f"bubble {result.bubble_fraction:.1%}")
    target = Path(path)
    if target.suffix.lower() != ".svg":
        from coordinator.planning.timeline_plot import plot_timeline

        return plot_timeline(result, target, caption)
    rows = len(result.timeline)
    left, top, row_h, gap = 70, 40, 28, 8
    scale = (width - left - 20) / result.step_time_s if result.step_time_s > 0 else 0.0
    height = top + rows * (row_h + gap) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{_escape(caption)}</text>']
    for s, played in enumerate(result.timeline):
        y = top + s * (row_h + gap)
        out.append(f'<text x="5" y="{y + row_h / 2 + 4}">stage {s}</text>')
        out.append(f'<line x1="{left}" y1="{y + row_h}" x2="{width - 20}" y2="{y + row_h}" stroke="#ddd"/>')
        for t in played:
            x, w = left + t.start * scale, max((t.end - t.start) * scale, 0.5)
            compute = t.action.kind in ("F", "B")
            h, dy = (row_h, 0) if compute else (row_h / 3, row_h * 2 / 3)
            out.append(f'<rect x="{x:.2f}" y="{y + dy:.2f}" width="{w:.2f}" height="{h:.2f}" '
                       f'fill="{_COLOURS[t.action.kind]}" stroke="white" stroke-width="0.5">'
                       f'<title>{_escape(str(t.action))} {t.start * 1e3:.3f}-{t.end * 1e3:.3f} ms'
                       '</title></rect>')
            if compute and w > 14:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                           f'fill="white">{t.action.kind}{t.action.microbatch}</text>')
    axis_y = top + rows * (row_h + gap) + 15
    out.append(f'<text x="{left}" y="{axis_y}">0 ms</text>')
    out.append(f'<text x="{width - 20}" y="{axis_y}" text-anchor="end">'
               f'{result.step_time_s * 1e3:.3f} ms</text>')
    out.append("</svg>")
    target.write_text("\n".join(out) + "\n", encoding="utf-8")
    return target

