"""The adapter-scale benchmark matrix of issue 47: loraserve with many adapters, each row against the base model
served by the same engine in the same run.

Model: a real HF config of ``--shape`` (``benchmarks/gpu/dummy.py``; llama-3.1-8b on a GPU, tiny-llama on the
CPU) with random weights (``load_format="dummy"``), random prompt ids, greedy, EOS ignored. Adapters: random PEFT
files of ``--adapter-shape`` (all-linear-16: rank 16 on q, k, v, o, gate, up, down; slora-8: rank 8 on q, k, v, o;
mixed-8-64: ranks 8, 16, 32, 64 in turn on q, k, v, o) written once to a temp dir (see scale_workload.py).

One engine per (adapter shape, ``max_loras``), built once, serves every row of that config, base rows included.
Only the public API is used (``LLM(...)`` arguments it accepts, ``add_lora`` / ``remove_lora``, the engine's
``add_request`` / ``step``), so the script measures slot-based engines and pool-based ones alike. A config that
does not fit in memory is rebuilt with half the ``max_loras`` (the table says which ran).

Rows (the product of the matrix flags, per config; a preset may list several blocks of them):
- batch B, lengths fixed (``--prompt-len`` -> ``--new-tokens``) or varied (prompts uniform in ``--prompt-range``,
  outputs in ``--output-range``, the same draws for every row of a group);
- adapters N, choice per request uniform / zipfS / distinct (request i -> adapter i % N);
- start warm (a first, short pass over the same adapters before the timed pass) or cold (the row's adapters are
  registered with ``add_lora`` but never used by any request: files in the page cache, loaded on first use;
  today's add_lora parses them into host memory, so "cold" is a slot load here);
- mode offline (B requests at once) or poisson (``--poisson-mult`` x B requests arriving at ``--rates`` x the
  base's offline request rate of that group; base and adapter rows share the arrival timeline).
A row whose requests put more distinct adapters in any B consecutive requests than ``max_loras`` is skipped
(``--over-slots run`` serves it anyway, queueing behind the slots), as is a row whose requests equal an earlier one.

Metrics: generated tokens/s (whole pass, prefill included), median decode-step ms (steps that returned tokens
and finished no prefill), prefill tok/s (offline: prompt tokens / time to the last first token), TTFT p50/p99
(end of the step returning the first token - arrival), each with its ratio to the base row; cold rows: extra
TTFT p50 over the warm row. Bytes bound: the decode steps' distinct adapters' bytes (bf16) / HBM bandwidth
(device->device copy, read + write bytes), against the step's extra time over base (issue 47's target: extra
<= 1.25x the bound). Probe (first config): one request's TTFT by where its adapter is. ``--hf``: HF transformers
+ PEFT mixed-batch generate at ``--hf-adapters``, after the loraserve rows. ``--budget-s`` skips the rows that
would not end in time (their notes say so); ``--json`` is rewritten after every row.

Presets (scale_plan.py): smoke (CPU, tiny, < 60 s: every path at toy size); gpu-core (Llama-8B, batch 32 and
256, 8 adapters at max_loras 8 and 512, 64 and 256 distinct, warm and cold); slora (rank 8 on q, k, v, o, 8 vs
2000 adapters uniform, 2000 registered at start, varied lengths, offline and Poisson 80%); hf (HF + PEFT at 8 and
64 adapters beside loraserve at batch 64).

    python benchmarks/bench_scale.py --preset smoke                     # CPU, tiny, < 60 s
    python benchmarks/bench_scale.py --preset gpu-core --json /tmp/scale.json
    python benchmarks/bench_scale.py --preset slora --json /tmp/slora.json
    python benchmarks/bench_scale.py --preset gpu-core --batches 256 --adapters 64 --dists uniform,zipf1.0
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "gpu")]

import scale_report  # noqa: E402
import torch  # noqa: E402
from dummy import hf_config, make_model_dir  # noqa: E402
from scale_plan import csv, parse_args, plan_rows, span  # noqa: E402
from scale_run import (  # noqa: E402
    bench_hf,
    copy_bandwidth,
    device_headroom_gb,
    free_llm,
    is_oom,
    llm_kwargs,
    probe_cold,
    ramp_sizes,
    ramp_warmup,
    release_memory,
    run_pass,
)
from scale_workload import (  # noqa: E402
    AdapterIds,
    AdapterStore,
    Lengths,
    choose_adapters,
    make_requests,
    max_distinct_in_window,
    poisson_arrivals,
)

from loraserve import LLM  # noqa: E402


def graphs_state(llm) -> str:
    """Whether the engine replays CUDA graphs (reported only: an engine turns them off when a capture fails)."""
    runner = getattr(llm.engine, "runner", None)
    if runner is None or not hasattr(runner, "graphs"):
        return "unknown"
    return "on" if runner.graphs is not None else "off"


class Bench:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.deadline = self.t_start + args.budget_s - (args.hf_reserve_s if args.hf else 0.0)  # the rows'
        self.cfg = hf_config(args.shape)
        self.vocab = self.cfg.vocab_size
        cuda = torch.cuda.is_available()
        self.dtype = args.dtype or ("bfloat16" if cuda else "float32")
        self.results = dict(header=scale_report.header(args), configs=[], hf=None)
        self.extra = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.llm_arg)}
        self.construct_s = 60.0 if cuda else 5.0
        self.passes = 0

    def next_seed(self) -> int:
        """A new prompt seed per pass: no pass repeats another's prompts (a prefix cache would skip their prefill)."""
        self.passes += 1
        return self.args.seed * 100_000 + 1000 + self.passes

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.results, f, indent=1, default=str)

    def lengths(self, kind: str) -> Lengths:
        a = self.args
        return Lengths(kind, a.prompt_len, a.new_tokens, span(a.prompt_range), span(a.output_range))

    # ---- one engine ------------------------------------------------------------------------------------------
    def build(self, model_dir: Path, store: AdapterStore, asked: int, max_len: int, cpu_loras: int):
        """(llm, ids, max_loras it runs) for the largest max_loras <= asked that builds, warms up and leaves
        ``--reserve-gb`` free; (None, None, error) if none does."""
        a, batch = self.args, max(csv(self.args.batches, int))
        m, err = asked, "no max_loras fits"
        while m >= 1:
            if self.left() < self.construct_s:
                return None, None, f"time budget ({a.budget_s:.0f} s) spent before building the engine"
            kw = dict(model=str(model_dir), dtype=self.dtype, load_format="dummy", enable_lora=True, max_loras=m,
                      max_lora_rank=max(store.ranks), max_cpu_loras=max(m, cpu_loras), max_num_seqs=batch,
                      max_num_batched_tokens=a.max_batched_tokens, max_model_len=max_len,
                      num_kv_blocks=batch * math.ceil(max_len / 16) + 16, seed=a.seed, **self.extra)  # fmt: skip
            kw, dropped = llm_kwargs(kw)
            llm = ids = None
            t = time.perf_counter()
            try:
                llm = LLM(**kw)
                ids = AdapterIds(llm, store)
                warm8 = list(ids.warm_for(range(min(8, m))).values())
                ramp_warmup(llm, batch, self.longest_prompt(), self.vocab, [None], a.seed + 1)
                ramp_warmup(llm, batch, self.longest_prompt(), self.vocab, warm8, a.seed + 2)
                room = device_headroom_gb()
                if room is not None and room < a.reserve_gb:
                    raise torch.OutOfMemoryError(
                        f"out of memory: {room:.1f} GiB left after the warm-up < --reserve-gb"
                    )
                self.construct_s = time.perf_counter() - t
                return llm, ids, dict(max_loras=m, kwargs={k: v for k, v in kw.items() if k != "model"},
                                      dropped_args=dropped, build_s=self.construct_s, headroom_gb=room)  # fmt: skip
            except Exception as e:
                err, oom = f"max_loras {m}: {type(e).__name__}: {str(e)[:300]}", is_oom(e)
            print(f"# engine with {err}", file=sys.stderr, flush=True)
            # NOTE: freed here, after the except block: its exception's frames hold the failed build's tensors
            free_llm(llm)
            del llm, ids
            release_memory()
            if not oom:
                return None, None, err
            m //= 2
        return None, None, err

    def kinds(self) -> list[str]:
        return sorted({k for b in self.args.blocks for k in csv(b["lengths"])})

    def longest_prompt(self) -> int:
        return max(
            self.lengths(k).prompt_len if k == "fixed" else self.lengths(k).prompt_range[1]
            for k in self.kinds()
        )

    def run_config(self, model_dir: Path, store: AdapterStore, asked: int) -> None:
        a = self.args
        ramp = self.longest_prompt() + 1 + len(ramp_sizes(max(csv(a.batches, int))))
        max_len = 16 * math.ceil((max([ramp] + [self.lengths(k).max_total for k in self.kinds()]) + 16) / 16)
        max_len = min(max_len, getattr(self.cfg, "max_position_embeddings", max_len))
        specs = [s for b in csv(a.batches, int) for s in plan_rows(a, b)]
        warm_max = max([s["adapters"] for s in specs if s["start"] == "warm"], default=0)
        cold_max = max([s["adapters"] for s in specs if s["start"] == "cold"], default=0)
        cpu_loras = max(a.preregister, warm_max) + cold_max + 2 * (a.probe_reps + 8) + 16
        conf = dict(shape=a.shape, adapter_shape=store.shape, max_loras_asked=asked, rows=[], probe=None)
        self.results["configs"].append(conf)
        self.base, self.seen, self.warm_rows, self.dead = {}, {}, {}, None
        llm, ids, info = self.build(model_dir, store, asked, max_len, cpu_loras)
        if llm is None:
            conf["error"] = info
            for spec in specs:
                conf["rows"].append(dict(spec, note=f"not run: {info}"))
            self.save()
            return
        conf.update(info)
        conf["cuda_graphs"] = graphs_state(llm)
        try:
            self.config_rows(conf, llm, ids, info["max_loras"], specs)
            conf["cuda_graphs_at_end"] = graphs_state(llm)
        finally:
            free_llm(llm)
            ids.llm = None
            del llm, ids
            release_memory()

    def config_rows(self, conf: dict, llm, ids: AdapterIds, m: int, specs: list[dict]) -> None:
        a = self.args
        if a.preregister:  # at most half the time left: the rows register what they lack themselves
            n = max(0, a.preregister - len(ids.warm) - len(ids.fresh))
            n_fit = min(n, int(0.5 * self.left() / ids.avg_register_s()))
            t = time.perf_counter()
            ids.register(n_fit)
            conf["preregister"] = dict(
                adapters=len(ids.warm) + len(ids.fresh), seconds=time.perf_counter() - t
            )
            if n_fit < n:
                conf["preregister"]["note"] = (
                    f"(of {a.preregister} asked: the rest did not fit the time budget)"
                )
        if a.probe == "all" or (a.probe == "first" and len(self.results["configs"]) == 1):
            try:
                prompt = min(a.prompt_len, self.longest_prompt())
                conf["probe"] = probe_cold(llm, ids, m, prompt, self.vocab, a.probe_reps, a.seed + 500)
            except Exception as e:
                conf["probe"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            self.save()
        for batch in csv(a.batches, int):
            for kind in self.kinds():
                group = [s for s in specs if s["batch"] == batch and s["lengths"] == kind]
                if not group:
                    continue
                prompt = (
                    self.lengths(kind).prompt_len if kind == "fixed" else self.lengths(kind).prompt_range[1]
                )
                if (batch, prompt) != (max(csv(a.batches, int)), self.longest_prompt()) and not self.dead:
                    try:  # the build warmed up the largest batch at the longest prompt already
                        ramp_warmup(llm, batch, prompt, self.vocab, [None], a.seed + 3)
                        ramp_warmup(
                            llm,
                            batch,
                            prompt,
                            self.vocab,
                            list(ids.warm_for(range(min(8, m))).values()),
                            a.seed + 4,
                        )
                    except Exception as e:
                        print(
                            f"# warm-up of batch {batch}: {type(e).__name__}: {e}",
                            file=sys.stderr,
                            flush=True,
                        )
                base_of = dict(adapters=0, dist="-", start="-")
                self.row(conf, llm, ids, m, dict(group[0], mode="offline", rate=None, **base_of))
                for spec in group:
                    gkey = (batch, kind, spec["mode"], spec["rate"])
                    if spec["mode"] == "poisson" and gkey not in self.base:
                        self.row(conf, llm, ids, m, dict(spec, **base_of))
                    self.row(conf, llm, ids, m, spec)

    def row(self, conf: dict, llm, ids: AdapterIds, m: int, spec: dict) -> None:
        a = self.args
        batch, kind, mode = spec["batch"], spec["lengths"], spec["mode"]
        gkey = (batch, kind, mode, spec["rate"])
        n = batch if mode == "offline" else batch * a.poisson_mult
        row = dict(spec, requests=n, max_loras=m)
        conf["rows"].append(row)
        cold = []
        try:
            row["note"] = self.serve_row(row, llm, ids, m, gkey, cold)
        except Exception as e:
            row["note"] = f"error: {type(e).__name__}: {str(e)[:300]}"
            if is_oom(e):
                release_memory()
            healthy = getattr(llm.engine, "is_healthy", lambda: True)
            if not healthy():
                self.dead = f"the engine died in an earlier row ({row['note']})"
        finally:
            if cold:
                try:
                    ids.retire(cold)
                except Exception as e:
                    row["note"] = (row.get("note") or "") + f"; removing its adapters failed: {e}"
        print(
            "# " + scale_report.progress(time.perf_counter() - self.t_start, conf, row),
            file=sys.stderr,
            flush=True,
        )
        self.save()

    def serve_row(self, row: dict, llm, ids: AdapterIds, m: int, gkey: tuple, cold: list) -> str:
        """Serve one row (filling ``row``); the note for the table."""
        a = self.args
        batch, kind, mode, n_ad, n = (
            row["batch"],
            row["lengths"],
            row["mode"],
            row["adapters"],
            row["requests"],
        )
        if self.dead:
            return f"not run: {self.dead}"
        if mode == "poisson" and (batch, kind, "offline", None) not in self.base:
            return "not run: no base offline rate to scale the poisson rate from"
        lens = self.lengths(kind).draw(n, seed=a.seed + 7)
        arrivals, est = None, 0.0
        if mode == "poisson":
            row["rate_req_s"] = row["rate"] * self.base[(batch, kind, "offline", None)]["req_s"]
            arrivals = poisson_arrivals(n, row["rate_req_s"], a.seed + 11)
            est = arrivals[-1]
        choice, used = None, []
        if n_ad:
            choice = choose_adapters(row["dist"], n_ad, n, random.Random(f"{a.seed}-{n_ad}-{row['dist']}"))
            used = sorted(set(choice))
            row["distinct_adapters"] = len(used)
            row["max_distinct_in_batch_window"] = w = max_distinct_in_window(choice, batch)
            dup = (gkey, row["start"], tuple(choice))
            if dup in self.seen:
                return f"skipped: the same requests as {self.seen[dup]}"
            self.seen[dup] = f"{n_ad} adapters {row['dist']}"
            if w > m and a.over_slots == "skip":
                return f"skipped: {w} distinct adapters in {batch} requests > max_loras {m} (--over-slots run queues them)"
            base_s = self.base.get(gkey, {}).get("total_s") or 0.0
            regs = ids.new_registrations(
                used if row["start"] == "warm" else [], len(used) if row["start"] == "cold" else 0
            )
            est = (
                max(est, 2.5 * base_s)
                + regs * ids.avg_register_s()
                + (0.5 * base_s if row["start"] == "warm" else 0)
            )
        row["estimated_s"] = est
        if est > self.left():
            return f"skipped: time budget (needs ~{est:.0f} s, {max(0.0, self.left()):.0f} s left)"
        by_k = {}
        if n_ad and row["start"] == "warm":
            by_k = ids.warm_for(used)
            warm = make_requests([(min(p, 16), 2) for p, _ in lens], choice, self.vocab, self.next_seed())
            run_pass(llm, warm, [by_k[k] for k in choice])
        elif n_ad:
            t = time.perf_counter()
            cold += ids.cold_ids(len(used))
            by_k = dict(zip(used, cold))
            ids.store.read_into_page_cache([r.lora_int_id for r in cold])
            row["cold_setup_s"] = time.perf_counter() - t
        reqs = make_requests(lens, choice, self.vocab, self.next_seed(), arrivals)
        loras = [None] * n if not n_ad else [by_k[k] for k in choice]
        res = run_pass(llm, reqs, loras, ids.store.bytes_of, timeline=mode == "poisson")
        s = res.summary()
        row.update(s)
        row["raw"] = dict(ttft_s=res.ttft_s, step_s=res.step_s, decode_s=res.decode_s, decode_batch=res.decode_batch,
                          decode_distinct=res.decode_distinct, decode_bytes=res.decode_bytes)  # fmt: skip
        if not n_ad:
            self.base[gkey] = s
        else:
            self.compare(row, gkey)
        return f"{len(res.errors)} requests failed: {res.errors[0]}" if res.errors else ""

    def compare(self, row: dict, gkey: tuple) -> None:
        """Ratios to the base row of the group, the bytes bound and (cold) the extra TTFT over the warm row."""
        b = self.base.get(gkey)
        ratio = lambda x, y: None if x is None or not y else x / y  # noqa: E731
        if b:
            row["tok_s_vs_base"] = ratio(row["tok_s"], b["tok_s"])
            row["decode_vs_base"] = ratio(row["decode_ms"], b["decode_ms"])
            row["prefill_vs_base"] = ratio(row["prefill_tok_s"], b["prefill_tok_s"])
            if row["decode_ms"] is not None and b["decode_ms"] is not None:
                row["extra_step_ms"] = row["decode_ms"] - b["decode_ms"]
        hbm = self.results["bandwidth"]["hbm_gbps"]
        if row.get("adapter_bytes_per_step"):
            row["bytes_bound_ms"] = row["adapter_bytes_per_step"] / (hbm * 1e9) * 1e3
            row["extra_over_bound"] = ratio(row.get("extra_step_ms"), row["bytes_bound_ms"])
        wkey = (gkey, row["adapters"], row["dist"])
        if row["start"] == "warm":
            self.warm_rows[wkey] = row
        elif wkey in self.warm_rows and row["ttft_p50_ms"] is not None:
            w = self.warm_rows[wkey]["ttft_p50_ms"]
            row["cold_extra_ttft_p50_ms"] = None if w is None else row["ttft_p50_ms"] - w


def main() -> None:
    args = parse_args(__doc__)
    if args.threads and not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    bench = Bench(args)
    print(scale_report.header_lines(bench.results["header"]), file=sys.stderr, flush=True)
    shapes = csv(args.adapter_shapes)
    counts = [n for b in args.blocks for n in csv(b["adapters"], int)]
    if args.hf:
        counts += csv(args.hf_adapters, int)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        model_dir = make_model_dir(root / "model", args.shape)
        bench.results["bandwidth"] = copy_bandwidth()
        release_memory()
        stores = {}
        for shape in shapes:
            t = time.perf_counter()
            stores[shape] = AdapterStore.build(
                root / "adapters", bench.cfg, shape, max(1, min(args.max_files, max(counts)))
            )
            bench.results.setdefault("adapter_files", {})[shape] = dict(
                files=len(stores[shape].paths),
                seconds=time.perf_counter() - t,
                bytes=sum(stores[shape].nbytes),
            )
        print(scale_report.setup_line(bench.results), file=sys.stderr, flush=True)
        for shape in shapes:
            for m in csv(args.max_loras, int):
                bench.run_config(model_dir, stores[shape], m)
        if args.hf:
            hf_counts = csv(args.hf_adapters, int)
            if time.perf_counter() - bench.t_start > args.budget_s:
                bench.results["hf"] = dict(error=f"skipped: time budget ({args.budget_s:.0f} s) spent")
            else:
                try:
                    dt = torch.bfloat16 if bench.dtype in ("bfloat16", "bf16") else torch.float32
                    bench.results["hf"] = bench_hf(bench.cfg, stores[shapes[0]], hf_counts, args.hf_batch, args.prompt_len,
                                                   args.hf_new_tokens, dt, args.seed + 900)  # fmt: skip
                except Exception as e:
                    bench.results["hf"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                    release_memory()
    bench.results["elapsed_s"] = time.perf_counter() - bench.t_start
    bench.save()
    print(scale_report.tables(bench.results), flush=True)


if __name__ == "__main__":
    main()
