"""bench_scale.py's output: the header (device, versions, command line) and the Markdown tables."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys

import torch


def header(args) -> dict:
    import peft
    import transformers

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    cuda = torch.cuda.is_available()
    return dict(
        device=torch.cuda.get_device_name()
        if cuda
        else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__,
        triton=triton_v,
        transformers=transformers.__version__,
        peft=peft.__version__,
        command="python " + shlex.join(sys.argv),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        preset=args.preset,
        shape=args.shape,
    )


def header_lines(h: dict) -> str:
    return (
        f"device {h['device']} | torch {h['torch']} | triton {h['triton']} | transformers {h['transformers']} | "
        f"peft {h['peft']} | {h['date']}\ncommand: {h['command']}"
    )


def setup_line(results: dict) -> str:
    bw = results["bandwidth"]
    files = ", ".join(
        f"{k}: {v['files']} files, {v['bytes'] / 1e9:.2f} GB in {v['seconds']:.1f} s"
        for k, v in results.get("adapter_files", {}).items()
    )
    return (
        f"# copy bandwidth: host->device (pinned) {bw['h2d_gbps']:.1f} GB/s, device->device {bw['d2d_copy_gbps']:.1f} GB/s "
        f"(HBM read+write {bw['hbm_gbps']:.1f} GB/s); adapter files: {files}"
    )


def f(x, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def progress(elapsed: float, conf: dict, row: dict) -> str:
    return (
        f"[{elapsed:.0f} s] {conf['adapter_shape']} max_loras {row.get('max_loras')}: batch {row['batch']} "
        f"{row['lengths']} {row['mode']} {row['adapters'] or 'base'} {row['dist']} {row['start']}: "
        f"{f(row.get('tok_s'), '.0f')} tok/s ({f(row.get('tok_s_vs_base'), '.2f', 'x')}), step "
        f"{f(row.get('decode_ms'), '.2f')} ms ({f(row.get('decode_vs_base'), '.2f', 'x')}), TTFT p50 "
        f"{f(row.get('ttft_p50_ms'), '.0f')} ms {row.get('note') or ''}"
    )


COLUMNS = " | ".join(
    (
        "batch", "lengths", "mode", "adapters", "choice", "start", "distinct adapters per step", "gen tok/s",
        "vs base", "decode step ms", "vs base step", "prefill tok/s", "vs base prefill", "TTFT p50 ms",
        "TTFT p99 ms", "cold extra TTFT p50 ms", "adapter MB per step", "bytes bound ms", "extra step / bound",
        "note",
    )
)  # fmt: skip


def row_line(r: dict) -> str:
    mode = (
        r["mode"]
        if r["mode"] == "offline"
        else f"poisson {r['rate']:g} ({f(r.get('rate_req_s'), '.1f')} req/s)"
    )
    mb = r.get("adapter_bytes_per_step")
    cells = [
        r["batch"], r["lengths"], mode, r["adapters"] or "base", r["dist"], r["start"],
        f(r.get("distinct_per_step") if r["adapters"] else None, ".0f"), f(r.get("tok_s"), ".0f"), f(r.get("tok_s_vs_base"), ".2f", "x"),
        f(r.get("decode_ms"), ".2f"), f(r.get("decode_vs_base"), ".2f", "x"), f(r.get("prefill_tok_s"), ".0f"),
        f(r.get("prefill_vs_base"), ".2f", "x"), f(r.get("ttft_p50_ms"), ".0f"),
        f(r.get("ttft_p99_ms"), ".0f"), f(r.get("cold_extra_ttft_p50_ms"), ".0f"), f(mb / 1e6 if mb else None, ".3g"),
        f(r.get("bytes_bound_ms"), ".2f"), f(r.get("extra_over_bound"), ".2f", "x"), r.get("note") or "",
    ]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


PROBE_NAMES = {
    "base": "no adapter (base)",
    "resident": "resident (used just before)",
    "registered_unused": "registered, never used (cold)",
    "registered_unused_8_at_once_p50": "8 registered-unused at once, p50",
    "registered_unused_8_at_once_max": "8 registered-unused at once, last",
    "unregistered": "not registered (path on the request)",
    "unregistered_8_at_once_p50": "8 not registered at once, p50",
    "unregistered_8_at_once_max": "8 not registered at once, last",
    "after_max_loras_others": "used, then max_loras other adapters served",
}


def tables(res: dict) -> str:
    h = res["header"]
    bw = res.get("bandwidth") or {}
    out = ["", header_lines(h)]
    if bw:
        out.append(setup_line(res)[2:])
    for c in res["configs"]:
        used = c.get("max_loras")
        cpu = (c.get("kwargs") or {}).get("max_cpu_loras")
        out += ["", f"### {c['shape']}, adapters {c['adapter_shape']}, max_loras {used if used else '–'} "
                f"(asked {c['max_loras_asked']}), max_cpu_loras {cpu}, engine built + warmed up in "
                f"{f(c.get('build_s'), '.0f')} s, CUDA graphs {c.get('cuda_graphs', '–')}"
                + (f" (at the end: {c['cuda_graphs_at_end']})" if c.get("cuda_graphs_at_end", c.get("cuda_graphs")) != c.get("cuda_graphs") else "")
                + (f" — {c['error']}" if c.get("error") else "")]  # fmt: skip
        if c.get("dropped_args"):
            out.append(f"LLM(...) does not take {c['dropped_args']}: not passed")
        if c.get("preregister"):
            p = c["preregister"]
            out.append(
                f"registered {p['adapters']} adapters at start in {f(p.get('seconds'), '.1f')} s {p.get('note', '')}"
            )
        out += ["", "| " + COLUMNS + " |", "|" + "---|" * len(COLUMNS.split("|"))]
        out += [row_line(r) for r in c["rows"]]
        p = c.get("probe")
        if p:
            out += ["", "TTFT of one request on an idle engine, by where its adapter is (median):", ""]
            if "error" in p:
                out.append(f"probe failed: {p['error']}")
            else:
                res_ms = p.get("resident")
                out += ["| adapter at request time | TTFT ms | over resident ms |", "|---|---|---|"]
                for k, v in p.items():
                    over = None if res_ms is None or k in ("base", "resident") else v - res_ms
                    out.append(f"| {PROBE_NAMES.get(k, k)} | {v:.1f} | {f(over, '.1f')} |")
    hf = res.get("hf")
    if hf:
        out += ["", "HF transformers + PEFT mixed-batch generate (request i uses adapter i % n):", ""]
        if "error" in hf:
            out.append(f"not run: {hf['error']}")
        else:
            out += [f"batch {hf['batch']}, prompt {hf['prompt_len']} -> {hf['new_tokens']} new tokens; "
                    f"{f(hf['adapters_load_s'], '.1f')} s to load the adapters", "",
                    "| adapters | gen tok/s | vs base | decode step ms | vs base step |", "|---|---|---|---|---|"]  # fmt: skip
            b = hf["0"]
            for k, v in hf.items():
                if isinstance(v, dict):
                    out.append(
                        f"| {k if k != '0' else 'base'} | {v['tok_s']:.1f} | {v['tok_s'] / b['tok_s']:.2f}x | "
                        f"{v['decode_ms']:.2f} | {v['decode_ms'] / b['decode_ms']:.2f}x |"
                    )
    out.append(f"\ntotal {f(res.get('elapsed_s'), '.0f')} s")
    return "\n".join(out)
