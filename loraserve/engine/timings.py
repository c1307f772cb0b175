"""Cumulative wall time per phase of ``LLMEngine.step()``, for profiling (``engine.step_timings``).

Phases: schedule, prepare (batch lists + adapter slot writes), forward (the model, and under TP
the broadcast to the workers), sample (sampling and logprobs, queued), wait (until the sampled ids
and logprobs reached the host), postprocess (append tokens, detokenize, stop checks).

Only ``time.perf_counter``: GPU work is asynchronous, so without syncs its time lands in the phase
that first waits for it: wait, which reads the token ids back. With ``LORASERVE_PROFILE_SYNC=1`` the
engine synchronizes the device after forward and after sample, so each phase holds its own GPU time
(at the cost of those syncs, which also undo async scheduling's overlap). A step with nothing to run
(requests waiting on adapter loads) counts in ``steps`` / ``step_seconds`` and ``schedule`` only.

Under async scheduling a ``step()`` call launches the next step ahead (schedule .. sample) before it
finishes the current one (wait, postprocess): schedule .. sample count twice in a call that also
scheduled the current step, and prepare .. sample not at all in one that finishes the step the last
call launched without launching another. ``wait`` is then the device time the host did not hide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "wait", "postprocess")


@dataclass
class StepTimings:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    steps: int = 0  # step() calls, idle ones included
    step_seconds: float = 0.0  # wall time of whole step() calls

    def reset(self) -> None:
        for p in PHASES:
            self.seconds[p] = 0.0
            self.counts[p] = 0
        self.steps = 0
        self.step_seconds = 0.0

    def start(self, sync_device: torch.device | None = None) -> StepClock:
        """A clock for one step; ``sync_device``: synchronize it at ``lap(..., sync=True)`` (CUDA only)."""
        return StepClock(self, sync_device)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{phase: {"seconds", "count", "mean_ms"}} plus "step"."""
        out = {
            p: {"seconds": s, "count": self.counts[p], "mean_ms": 1e3 * s / max(self.counts[p], 1)}
            for p, s in self.seconds.items()
        }
        out["step"] = {
            "seconds": self.step_seconds,
            "count": self.steps,
            "mean_ms": 1e3 * self.step_seconds / max(self.steps, 1),
        }
        return out


class StepClock:
    """Laps of one step: each ``lap(phase)`` adds the time since the previous lap to that phase."""

    __slots__ = ("timings", "sync_device", "t0", "last")

    def __init__(self, timings: StepTimings, sync_device: torch.device | None):
        self.timings = timings
        self.sync_device = sync_device if sync_device is not None and sync_device.type == "cuda" else None
        self.t0 = self.last = time.perf_counter()

    def lap(self, phase: str, sync: bool = False) -> None:
        if sync and self.sync_device is not None:
            torch.cuda.synchronize(self.sync_device)
        now = time.perf_counter()
        self.timings.seconds[phase] += now - self.last
        self.timings.counts[phase] += 1
        self.last = now

    def stop(self) -> None:
        """The step is over: count it and its whole wall time."""
        self.timings.steps += 1
        self.timings.step_seconds += time.perf_counter() - self.t0
