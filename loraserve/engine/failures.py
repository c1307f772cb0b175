"""What the engine needs to fail one request, or one step, without failing the others.

``LLMEngine.step`` fails the requests of a step that raised and goes on; a second failure in a row,
or a device that no longer runs work, ends the engine (``EngineDeadError``). A request whose logits
are not finite fails alone (the sampler marks its row ``NO_TOKEN``).
"""

from __future__ import annotations

import torch

from loraserve.engine.sequence import Sequence


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
