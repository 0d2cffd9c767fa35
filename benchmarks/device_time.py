"""Device time of a JAX call: the GPU's own kernel durations, read from a profiler trace.

Host-side step timing has a floor (dispatch and launch work on the host: 12-15 us per Mosaic
GPU launch on the H200), so it cannot show a 4 us kernel. ``device_time`` runs the call under
``jax.profiler.trace``, reads the written ``*.xplane.pb`` with ``jax.profiler.ProfileData``
and sums, per call, the durations of the kernels on the GPU plane's stream lines (what ncu
calls a kernel's duration). The copies and memsets on those lines (CUPTI names them
"Memcpy..."/"Memset") are summed apart (``copy_us``): a pool that was copied instead of
donated, or an argument that came from the host, shows there. The derived lines of a trace
("XLA Ops", "XLA Modules", ...) repeat the stream events and are not read; gaps between a
call's events are not device work (``span_us`` includes them).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.profiler import ProfileData

__all__ = ["DeviceTime", "call_events", "device_time", "split_calls"]

GPU_PLANE = "/device:GPU:0"
# CUPTI names a device line "Stream #<id>(<activity kinds>)"; every other line of the GPU
# plane ("XLA Ops", "XLA Modules", "Steps", "CUPTI overhead") is derived or not device work.
_STREAM_LINE = "Stream #"
_COPY_PREFIXES = ("Memcpy", "Memset")


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    """Medians over the traced calls, in microseconds: ``us`` = summed kernel durations of one
    call; ``copy_us`` = its summed copy and memset durations; ``span_us`` = its first start to
    last end; ``events``: event name -> per-call time, in the order of the first call."""

    us: float
    copy_us: float
    span_us: float
    events: dict[str, float]
    calls: int

    def breakdown(self, top: int = 3, width: int = 48) -> str:
        """The ``top`` longest events as ``"name 1.2 us, ..."`` (names cut to ``width``)."""
        ranked = sorted(self.events.items(), key=lambda item: -item[1])[:top]
        text = ", ".join(f"{name[:width]} {us:.1f} us" for name, us in ranked)
        more = len(self.events) - len(ranked)
        return text + (f" (+{more} more)" if more > 0 else "")


def call_events(profile: ProfileData, plane: str = GPU_PLANE) -> list[tuple[str, float, float]]:
    """``(name, start_ns, duration_ns)`` of every event on the stream lines of ``plane``,
    sorted by start. Raises ``RuntimeError`` naming the planes or lines found when the trace
    has no such plane or no device events on it."""
    found = profile.find_plane_with_name(plane)
    if found is None:
        names = [p.name for p in profile.planes]
        raise RuntimeError(
            f"the trace has no {plane!r} plane (planes: {names}); device_time needs a GPU "
            "with CUPTI available to the profiler"
        )
    events = [
        (event.name, event.start_ns, event.duration_ns)
        for line in found.lines
        if line.name.startswith(_STREAM_LINE)
        for event in line.events
    ]
    if not events:
        lines = [line.name for line in found.lines]
        raise RuntimeError(
            f"plane {plane!r} has no events on lines named {_STREAM_LINE!r}... (lines: "
            f"{lines}): the profiler recorded no device activity"
        )
    return sorted(events, key=lambda event: event[1])


def split_calls(events: Sequence[tuple[str, float, float]], calls: int) -> DeviceTime:
    """Cuts start-sorted ``events`` of ``calls`` identical, serialized calls into equal runs
    (one per call) and takes medians. Raises ``RuntimeError`` when the events do not split
    into ``calls`` runs with the same event names in the same order (another program ran on
    the device, or a call was not the same executable)."""
    if calls < 1 or len(events) % calls:
        raise RuntimeError(f"{len(events)} device events do not split into {calls} equal calls")
    size = len(events) // calls
    runs = [events[i * size : (i + 1) * size] for i in range(calls)]
    names = [name for name, _, _ in runs[0]]
    for i, run in enumerate(runs[1:], start=1):
        if [name for name, _, _ in run] != names:
            raise RuntimeError(f"call {i} ran other device events than call 0 ({names[:4]}...)")
    per_name: dict[str, list[float]] = {name: [0.0] * calls for name in names}
    for i, run in enumerate(runs):
        for name, _, duration in run:
            per_name[name][i] += duration / 1e3

    def median_of(keep: Callable[[str], bool]) -> float:
        return statistics.median(sum(d for name, _, d in run if keep(name)) / 1e3 for run in runs)

    spans = [max(start + d for _, start, d in run) - run[0][1] for run in runs]
    return DeviceTime(
        us=median_of(lambda name: not name.startswith(_COPY_PREFIXES)),
        copy_us=median_of(lambda name: name.startswith(_COPY_PREFIXES)),
        span_us=statistics.median(spans) / 1e3,
        events={name: statistics.median(us) for name, us in per_name.items()},
        calls=calls,
    )


def device_time(
    call: Callable[[], Any], *, calls: int = 20, warmup: int = 2, plane: str = GPU_PLANE
) -> DeviceTime:
    """Device time of one ``call()`` (a call of a jitted function; it keeps its own state,
    e.g. a donated pool carried from call to call, and returns the call's outputs).

    ``warmup`` calls compile and settle outside the trace; then ``calls`` calls, each waited
    for before the next (so that the events of one call form one run), are traced. Arguments
    should already be on the device: a host argument adds its copy to the device time.
    """
    for _ in range(warmup):
        jax.block_until_ready(call())
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # host Python frames: not needed, and they slow the host
    options.raise_error_on_start_failure = True
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, profiler_options=options):
            for _ in range(calls):
                jax.block_until_ready(call())
        files = sorted(Path(log_dir).rglob("*.xplane.pb"))
        if len(files) != 1:
            raise RuntimeError(f"expected one *.xplane.pb under {log_dir}, found {files}")
        profile = ProfileData.from_file(str(files[0]))
        return split_calls(call_events(profile, plane), calls)
