"""What bench_scale.py serves: adapter files, adapter ids per engine, requests (lengths, adapter choice, arrivals).

Adapter files are PEFT dirs made by ``benchmarks/gpu/dummy.py``. Writing thousands of Llama-8B-sized adapters
from fresh random numbers would take minutes, so each rank gets one random template and file ``i`` is that
template with its first tensor (layer 0's first A) drawn anew from seed ``i``: every file has its own bytes.
Ids beyond ``n_files`` reuse file ``id % n_files`` under their own ``lora_int_id`` (engines key adapters by id;
nothing in loraserve shares weights between ids with equal files).
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

from dummy import LLAMA_MODULES, SLORA_MODULES, adapter_tensors, write_adapter  # noqa: E402

from loraserve import LoRARequest  # noqa: E402

# name -> (ranks, one per file in turn; target modules)
ADAPTER_SHAPES: dict[str, tuple[tuple[int, ...], list[str]]] = {
    "all-linear-16": ((16,), LLAMA_MODULES),
    "slora-8": ((8,), SLORA_MODULES),
    "mixed-8-64": ((8, 16, 32, 64), SLORA_MODULES),
}


@dataclass
class AdapterStore:
    """Adapter dirs on disk, file ``i`` of rank ``ranks[i % len(ranks)]``."""

    shape: str
    paths: list[Path]
    ranks: list[int]
    nbytes: list[int]  # the file's tensor bytes (bf16): what one step reads of this adapter

    @classmethod
    def build(
        cls, root: Path, cfg, shape: str, n_files: int, std: float = 0.02, threads: int = 8
    ) -> AdapterStore:
        ranks, modules = ADAPTER_SHAPES[shape]
        templates = {r: adapter_tensors(cfg, r, seed=r, std=std, modules=modules) for r in ranks}

        def one(i: int) -> tuple[Path, int, int]:
            r = ranks[i % len(ranks)]
            tensors = dict(templates[r])
            first = next(iter(tensors))
            g = torch.Generator().manual_seed(1000 + i)
            t = tensors[first]
            tensors[first] = (torch.randn(t.shape, generator=g) * std).to(t.dtype)
            path = write_adapter(root / f"{shape}-{i}", tensors, r, alpha=2 * r, modules=modules)
            return path, r, sum(x.numel() * x.element_size() for x in tensors.values())

        with ThreadPoolExecutor(threads) as pool:
            made = list(pool.map(one, range(n_files)))
        return cls(shape, [m[0] for m in made], [m[1] for m in made], [m[2] for m in made])

    def file_of(self, lora_int_id: int) -> int:
        return (lora_int_id - 1) % len(self.paths)

    def bytes_of(self, lora_int_id: int) -> int:
        return self.nbytes[self.file_of(lora_int_id)]

    def read_into_page_cache(self, lora_int_ids) -> None:
        """Read each distinct file once, so "files in the page cache" holds for a cold start."""
        for f in sorted({self.file_of(i) for i in lora_int_ids}):
            for p in self.paths[f].iterdir():
                with open(p, "rb") as fh:
                    while fh.read(64 << 20):
                        pass


@dataclass
class AdapterIds:
    """The ``lora_int_id``s one engine knows. Logical adapter ``k`` of a warm row is ``warm[k]`` (registered once,
    reused by every warm row); a cold row maps its adapters to ids registered but never used by any request, and
    retires them afterwards (``LLM.remove_lora``). Registration goes through ``LLM.add_lora`` only."""

    llm: object
    store: AdapterStore
    next_id: int = 1
    warm: dict[int, LoRARequest] = field(default_factory=dict)  # logical adapter -> id
    fresh: list[LoRARequest] = field(default_factory=list)  # registered, never used
    reg_seconds: list[float] = field(default_factory=list)

    def new(self) -> LoRARequest:
        i, self.next_id = self.next_id, self.next_id + 1
        return LoRARequest(f"a{i}", i, str(self.store.paths[self.store.file_of(i)]))

    def register(self, n: int) -> None:
        for _ in range(n):
            req = self.new()
            t = time.perf_counter()
            self.llm.add_lora(req)
            self.reg_seconds.append(time.perf_counter() - t)
            self.fresh.append(req)

    def avg_register_s(self, default: float = 0.5) -> float:
        return sum(self.reg_seconds) / len(self.reg_seconds) if self.reg_seconds else default

    def warm_for(self, ks) -> dict[int, LoRARequest]:
        """The warm id of each logical adapter in ``ks``, registering the missing ones (never-used ids first)."""
        missing = [k for k in sorted(set(ks)) if k not in self.warm]
        self.register(max(0, len(missing) - len(self.fresh)))
        for k in missing:
            self.warm[k] = self.fresh.pop(0)
        return {k: self.warm[k] for k in ks}

    def cold_ids(self, n: int) -> list[LoRARequest]:
        """n ids registered now or earlier and never used; hand them to ``retire`` after use."""
        self.register(max(0, n - len(self.fresh)))
        out, self.fresh = self.fresh[:n], self.fresh[n:]
        return out

    def new_registrations(self, warm_ks, cold_needed: int) -> int:
        """How many ``register`` calls a row with these warm logical adapters and this many cold ones will make."""
        short_warm = len(set(warm_ks) - set(self.warm))
        return max(0, short_warm + cold_needed - len(self.fresh))

    def retire(self, reqs: list[LoRARequest]) -> None:
        for r in reqs:
            self.llm.remove_lora(r.lora_int_id)


def choose_adapters(dist: str, n_adapters: int, n_requests: int, rng: random.Random) -> list[int]:
    """Logical adapter (0..n_adapters-1) per request: uniform, zipfS (P(k) ~ 1/(k+1)^S) or distinct (round robin)."""
    if dist == "distinct":
        return [i % n_adapters for i in range(n_requests)]
    if dist == "uniform":
        return [rng.randrange(n_adapters) for _ in range(n_requests)]
    if dist.startswith("zipf"):
        s = float(dist[4:])
        weights = [1.0 / (k + 1) ** s for k in range(n_adapters)]
        return rng.choices(range(n_adapters), weights=weights, k=n_requests)
    raise ValueError(f"unknown adapter choice {dist!r}; use uniform, zipf1.0, zipf1.5 or distinct")


def max_distinct_in_window(choice: list[int], window: int) -> int:
    """Most distinct adapters among any ``window`` consecutive requests: what a step may hold at once."""
    best, counts = 0, {}
    for i, k in enumerate(choice):
        counts[k] = counts.get(k, 0) + 1
        if i >= window:
            old = choice[i - window]
            counts[old] -= 1
            if not counts[old]:
                del counts[old]
        best = max(best, len(counts))
    return best


@dataclass
class Lengths:
    kind: str  # fixed | varied
    prompt_len: int = 128
    new_tokens: int = 128
    prompt_range: tuple[int, int] = (64, 512)
    output_range: tuple[int, int] = (32, 256)

    def draw(self, n: int, seed: int) -> list[tuple[int, int]]:
        """(prompt tokens, new tokens) per request; the same seed gives every row of a group the same lengths."""
        if self.kind == "fixed":
            return [(self.prompt_len, self.new_tokens)] * n
        rng = random.Random(seed)
        return [(rng.randint(*self.prompt_range), rng.randint(*self.output_range)) for _ in range(n)]

    @property
    def max_total(self) -> int:
        if self.kind == "fixed":
            return self.prompt_len + self.new_tokens
        return self.prompt_range[1] + self.output_range[1]


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    adapter: int | None  # logical adapter index; None = the base model
    arrival_s: float = 0.0


def make_requests(
    lengths: list[tuple[int, int]],
    choice: list[int] | None,
    vocab: int,
    seed: int,
    arrivals: list[float] | None = None,
) -> list[Request]:
    """Random prompt ids in [2, vocab) (0 and 1 are pad and EOS), fresh per ``seed``: no pass repeats a prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, o) in enumerate(lengths):
        ids = torch.randint(2, vocab, (p,), generator=g).tolist()
        out.append(
            Request(ids, o, None if choice is None else choice[i], 0.0 if arrivals is None else arrivals[i])
        )
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival seconds of n requests at ``rate`` per second (exponential gaps), the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
