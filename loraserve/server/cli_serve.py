"""``loraserve serve [MODEL]``: the OpenAI-compatible server, with vLLM's flag names.

``add_serve_parser(subparsers)`` adds the subcommand to the CLI; ``run_serve(args)`` runs it.
Without MODEL it serves the default model (SmolLM2-135M-Instruct) with the demo adapters shipped in
``loraserve/demo_adapters/*/`` (each dir holding an adapter_config.json), under their dir names.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from loraserve.sampling import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS
from loraserve.server.server_config import default as server_default

LORA_DTYPES = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
)  # --lora-dtype (generate, chat, serve); LoRAConfig.resolved_dtype

DEMO_ADAPTERS = Path(__file__).resolve().parents[1] / "demo_adapters"


def add_lora_capacity_args(g) -> None:
    """The LoRA flags that ``generate``/``chat`` and ``serve`` share (how many adapters, how large, in
    which dtype, how sharded): one definition, read back by ``lora_capacity_kwargs``."""
    g.add_argument("--max-loras", type=int, default=4, help="adapters resident on the device at once")
    g.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    g.add_argument(
        "--lora-dtype",
        default="auto",
        choices=LORA_DTYPES,
        help="auto (PEFT's numbers: float32, or on the GPU for bf16 models float16 balanced per rank, which keeps "
        "the bits the GPU's tf32 products use) | float32 | bfloat16 (vLLM's default, fastest) | float16",
    )
    g.add_argument(
        "--max-cpu-loras", type=int, default=None, help="host adapter cache (default: max(max_loras, 32))"
    )
    g.add_argument(
        "--fully-sharded-loras", action="store_true", help="with TP: shard LoRA A and B too (S-LoRA)"
    )


def lora_capacity_kwargs(args: argparse.Namespace) -> dict:
    """The LoRAConfig fields (also ``LLM`` keyword arguments) of ``add_lora_capacity_args``' flags."""
    return dict(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_dtype=args.lora_dtype,
        max_cpu_loras=args.max_cpu_loras,
        fully_sharded_loras=args.fully_sharded_loras,
    )


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. sql=/adapters/sql), got {value!r}")
    return name, path


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, LoRA adapters by model name)",
        description="Serve MODEL (default: SmolLM2-135M-Instruct with the demo adapters) over an "
        "OpenAI-compatible HTTP API; the request's `model` picks the adapter.",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="HF model dir or .gguf file (default: the demo model)"
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 = every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    g.add_argument(
        "--served-model-name", default=None, help="the base model's name in the API (default: its dir name)"
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=server_default("max_n"),
        help="largest n (completions per request) accepted",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=server_default("max_request_bytes"),
        help="largest request body; larger ones get 413 before they are parsed (default: 8 MiB)",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=server_default("max_prompts_per_request"),
        help="largest batch of prompts in one /v1/completions request",
    )
    g.add_argument(
        "--max-stop-strings",
        type=int,
        default=server_default("max_stop_strings"),
        help=f"most stop strings in one request (at most {MAX_STOP_STRINGS})",
    )
    g.add_argument(
        "--max-stop-string-length",
        type=int,
        default=server_default("max_stop_string_length"),
        help=f"longest stop string, in characters (at most {MAX_STOP_STRING_LENGTH})",
    )
    g.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto = fp32 on CPU)")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)"
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache size on the CPU")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (overrides the size)")
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks to shard the model over (one host)"
    )
    g.add_argument(
        "--distributed-timeout", type=float, default=60.0, help="seconds before a stuck collective fails"
    )
    g.add_argument(
        "--enforce-eager", action="store_true", help="never use CUDA graphs (on by default on the GPU)"
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap each step's host work with the next step on the device (default: on for CUDA)",
    )
    g = p.add_argument_group("LoRA")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve adapters (implied by --lora-modules, --allow-runtime-lora-updating and the demo model)",
    )
    g.add_argument(
        "--lora-modules",
        type=_lora_module,
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to load at startup, served under NAME",
    )
    add_lora_capacity_args(g)
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="apply LoRA to these modules only (e.g. q_proj v_proj)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-root)",
    )
    g.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="runtime loads must resolve (symlinks followed) under DIR",
    )
    p.set_defaults(func=run_serve)
    return p


def demo_adapters() -> list[tuple[str, str]]:
    if not DEMO_ADAPTERS.is_dir():
        return []
    return [
        (d.name, str(d)) for d in sorted(DEMO_ADAPTERS.iterdir()) if (d / "adapter_config.json").is_file()
    ]


def build_engine(args: argparse.Namespace, lora_modules: list[tuple[str, str]]):
    from loraserve.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from loraserve.engine.engine import LLMEngine

    lora = None
    if args.enable_lora or lora_modules or args.allow_runtime_lora_updating:
        lora = LoRAConfig(**lora_capacity_kwargs(args), lora_target_modules=args.lora_target_modules)
    config = EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            device=args.device,
            enforce_eager=args.enforce_eager,
        ),
        cache=CacheConfig(num_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=args.async_scheduling,
        ),
        lora=lora,
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size, distributed_timeout_s=args.distributed_timeout
        ),
    )
    return LLMEngine(config, progress=False)


def make_app(args: argparse.Namespace):
    from loraserve.server.app import build_app
    from loraserve.server.server_config import ServerConfig

    lora_modules = list(args.lora_modules)
    if args.model is None:
        taken = {n for n, _ in lora_modules}
        lora_modules += [(n, p) for n, p in demo_adapters() if n not in taken]
    config = ServerConfig(  # validated before the model loads
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_root=args.lora_root,
        lora_modules=lora_modules,
        max_n=args.max_n,
        max_request_bytes=args.max_request_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
    )
    for name, path in lora_modules:
        if not Path(path).expanduser().is_dir():
            from loraserve.config import ConfigError

            raise ConfigError(
                f"--lora-modules {name}={path}: {path} is not a directory; pass a PEFT adapter dir"
            )
    return build_app(build_engine(args, lora_modules), config)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = make_app(args)
    server = app.state.server
    adapters = ", ".join(sorted(server.engine.adapters.snapshot())) or "none"
    logging.getLogger("loraserve.server").info(
        "serving %s (adapters: %s) on http://%s:%d/v1", server.model_name, adapters, args.host, args.port
    )
    return serve_app(app, args.host, args.port, args.uvicorn_log_level)


SHUTDOWN_GRACE_S = 5.0  # how long SIGINT/SIGTERM waits for open connections before closing them


def serve_app(app, host: str, port: int, log_level: str = "info") -> int:
    """Serve ``app`` until SIGINT/SIGTERM, or until its engine cannot go on; the exit status
    (``exit_status``)."""
    make_server(app, host, port, log_level).run()
    return exit_status(app)


def make_server(app, host: str, port: int, log_level: str = "info"):
    """The uvicorn server of ``app``: it stops on SIGINT/SIGTERM, and by itself once the engine
    cannot go on (``/health`` answers 503 from then).

    A signal ends the running streams at once (each gets an error chunk and ``[DONE]``, a plain
    request a 503); connections still open after ``SHUTDOWN_GRACE_S`` are closed, and the engine
    thread is waited for at most a few seconds (``AsyncEngine.shutdown``); an adapter still loading
    is left behind (a daemon thread).
    """
    import uvicorn

    engine = app.state.server.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.stop_streams_soon()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    server = Server(config)
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    return server


def exit_status(app) -> int:
    """0 after a signal; 1 when the engine died, so a supervisor restarts the process."""
    dead = app.state.server.engine.dead
    if dead is None:
        return 0
    logging.getLogger("loraserve.server").error(
        "exiting with status 1: the engine stopped (%r); restart the server", dead
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m loraserve.server.cli_serve`` (the same as ``loraserve serve``)."""
    parser = argparse.ArgumentParser(prog="loraserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    import sys

    sys.exit(main())
