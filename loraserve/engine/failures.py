"""What the engine needs to fail one request, or one step, without failing the others.

``LLMEngine.step`` fails the requests of a step that raised and goes on; a second failure in a row,
or a device that no longer runs work, ends the engine (``EngineDeadError``). A request whose logits
are not finite fails alone (the sampler marks its row ``NO_TOKEN``).
"""

from __future__ import annotations

import logging

import torch

from loraserve.engine.scheduler import ScheduledBatch
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.worker import EngineDeadError
from loraserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


def device_usable(device: torch.device) -> bool:
    """Whether ``device`` still runs work: an illegal memory access or a device-side assert poisons a
    CUDA context for good, and every later call on it raises."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False


def non_finite_message(seq: Sequence) -> str:
    """The error of a request whose logits held a NaN or an Inf: what to check."""
    lora = seq.lora_request
    cause = (
        f"its adapter {lora.lora_name!r} may hold broken weights (check it with `loraserve verify`)"
        if lora is not None
        else "the base model's weights or the prompt may be the cause"
    )
    return f"the model produced non-finite logits (NaN or Inf) for this request; {cause}"


class FailureIsolation:
    """LLMEngine's failure paths: fail one step's requests, one request, or an adapter's requests.

    Uses the engine's ``requests``, ``_inflight``, ``_finish``, ``_request_output``, ``lora_manager``,
    ``device`` and ``is_healthy``; owns ``consecutive_step_failures`` and ``dead``.
    """

    requests: dict[str, Request]
    consecutive_step_failures: int = 0
    dead: EngineDeadError | None = None

    def _fail_step(self, exc: Exception, batches: list[ScheduledBatch]) -> list[RequestOutput]:
        """A step raised: fail its requests (their KV blocks and adapter references freed) and go on.

        The requests are those of the batches the call ran or had launched ahead; all of them when
        it failed before a batch existed (the scheduler itself). A second failure in a row, or a
        device left unusable (a CUDA error is sticky), means the engine cannot go on: every request
        fails and ``EngineDeadError`` is raised; the engine refuses work from then on.
        """
        if self._inflight is not None:
            batches.append(self._inflight.batch)
            self._inflight = None
        rids = {s.request_id for b in batches for s in b.seqs} if batches else set(self.requests)
        self.consecutive_step_failures += 1
        logger.error(
            "a step failed (%d in a row); failing its %d requests",
            self.consecutive_step_failures,
            len(rids),
            exc_info=exc,
        )
        if self.consecutive_step_failures >= 2 or not (self.is_healthy() and device_usable(self.device)):
            self.dead = EngineDeadError(f"the engine cannot go on after {exc!r}")
            for rid in list(self.requests):
                self.abort_request(rid)
            raise self.dead from exc
        msg = f"the engine failed while running this request: {exc!r}; other requests go on"
        return [self._fail_request(rid, msg) for rid in rids if rid in self.requests]

    def _fail_request(self, request_id: str, message: str) -> RequestOutput:
        """End every sequence of the request with finish_reason "error" and ``message``; its output."""
        req = self.requests[request_id]
        req.error = message
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "error")
        return self._request_output(req)

    def _fail_broken_reloads(self) -> list[RequestOutput]:
        """Fail the requests whose adapter's re-read failed (its files changed since registration, ...)."""
        failed = self.lora_manager.take_load_errors() if self.lora_manager is not None else {}
        return [
            self._fail_request(
                r.request_id, f"reloading adapter {r.lora_request.lora_name!r} failed: {failed[lid]}"
            )
            for r in list(self.requests.values())
            if (lid := r.lora_request.lora_int_id if r.lora_request else None) in failed
        ]
