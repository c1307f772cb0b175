"""The ``loraserve`` command: ``generate``, ``chat``, ``bench``, ``serve`` (loraserve/server/cli_serve.py), ``verify``.

Each subcommand is a thin layer over the public API (``LLM``, ``LLMEngine``, ``SamplingParams``,
``LoRARequest``); nothing here is needed to use loraserve from Python.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

# NOTE: heavy imports (torch, transformers, the engine) happen inside the commands, so that
# `loraserve --help` and argument errors answer at once.


class CLIError(Exception):
    """A usage problem the user can fix; printed as `loraserve: error: ...` with exit code 2."""


def _lora_arg(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. sql=/adapters/sql), got {value!r}")
    return name, path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default=None, help="HF model dir or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto = fp32 on CPU)")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    g.add_argument(
        "--seed", type=int, default=0, help="engine seed (and the sampling seed unless --sample-seed)"
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from loraserve.server.cli_serve import add_lora_capacity_args  # light: argparse only

    _add_model_args(p)
    g = p.add_argument_group("engine")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's)"
    )
    g.add_argument("--max-num-seqs", type=int, default=16, help="sequences in one batch")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache size on the CPU")
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="shard the model over N processes/GPUs of this host"
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
    g = p.add_argument_group("LoRA (--lora enables it)")
    g.add_argument(
        "--lora", type=_lora_arg, default=None, metavar="NAME=PATH", help="a PEFT adapter dir to apply"
    )
    add_lora_capacity_args(g)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument(
        "--sample-seed", type=int, default=None, help="per-request sampling seed (default: --seed)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve", description="Serve one base LLM with many LoRA adapters at once, equal to PEFT."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,bench,serve,verify}")

    p = sub.add_parser("generate", help="complete one prompt and print the completion")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    _add_engine_args(p)
    _add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat on stdin, streaming tokens; /exit or EOF quits")
    p.add_argument("--system", default=None, help="system message")
    _add_engine_args(p)
    _add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="generation tokens/s of loraserve vs transformers generate()")
    _add_model_args(p)
    g = p.add_argument_group("workload")
    g.add_argument("--batch", type=int, default=8, help="prompts in one batch")
    g.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (EOS ignored)")
    g.add_argument("--repeat", type=int, default=1, help="timed runs per engine (tokens/s from the fastest)")
    p.set_defaults(func=cmd_bench)

    from loraserve.server.cli_serve import add_serve_parser  # light: argparse only

    add_serve_parser(sub)

    p = sub.add_parser("verify", help="compare an adapter served by loraserve with transformers + PEFT")
    p.add_argument("adapter", help="a PEFT adapter dir")
    p.add_argument("--model", default=None, help="base model (HF dir or .gguf); default SmolLM2-135M-Instruct")
    p.add_argument("--prompt", action="append", default=[], help="a prompt to compare on (repeatable)")
    p.add_argument("--max-tokens", type=int, default=12, help="greedy tokens per prompt")
    p.add_argument("--threshold", type=float, default=1e-3, help="largest |delta logprob| that passes")
    p.set_defaults(func=cmd_verify)
    return parser


def cmd_verify(args: argparse.Namespace) -> int:
    from loraserve.verify import main as verify_main

    return verify_main(args)


# ---- helpers ------------------------------------------------------------------------------------
def _make_llm(args: argparse.Namespace):
    from loraserve.llm import LLM
    from loraserve.server.cli_serve import lora_capacity_kwargs

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_lora=args.lora is not None,
        **lora_capacity_kwargs(args),
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )


def _lora_request(args: argparse.Namespace):
    if args.lora is None:
        return None
    from loraserve.lora.request import LoRARequest

    name, path = args.lora
    if not Path(path).expanduser().is_dir():
        raise CLIError(f"--lora {name}={path}: {path} is not a directory; pass a PEFT adapter dir")
    return LoRARequest(name, 1, str(Path(path).expanduser()))


def _sampling_params(args: argparse.Namespace):
    from loraserve.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed if args.sample_seed is None else args.sample_seed,
    )


# ---- commands -----------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise CLIError("--system needs --chat")
    params = _sampling_params(args)  # bad sampling flags fail before the model loads
    lora = _lora_request(args)
    llm = _make_llm(args)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        messages.append({"role": "user", "content": args.prompt})
        out = llm.chat(messages, params, lora_request=lora)
    else:
        out = llm.generate(args.prompt, params, lora_request=lora)
    print(out[0].outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from loraserve.engine.engine import RequestError

    params = _sampling_params(args)
    lora = _lora_request(args)
    llm = _make_llm(args)
    engine = llm.engine
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = []
    if interactive:
        print("loraserve chat: /exit (or Ctrl-D) quits, /reset clears the conversation", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            history.clear()
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        prompt = llm.apply_chat_template(system + history)
        rid = engine.new_request_id()
        try:
            engine.add_request(rid, prompt["prompt"], params, prompt["prompt_token_ids"], lora)
        except RequestError as e:
            history.pop()
            print(f"error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        reply = _stream(engine, rid)
        history.append({"role": "assistant", "content": reply})
    return 0


def _stream(engine, request_id: str) -> str:
    """Step the engine until the request finishes, printing each new piece of text as it arrives."""
    shown = ""
    try:
        done = False
        while not done:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                # NOTE: text normally only grows; if it changes behind what was shown (a stop string
                # trimmed), print nothing more and keep what the engine finally returns for history.
                if text.startswith(shown) and len(text) > len(shown):
                    print(text[len(shown) :], end="", flush=True)
                    shown = text
                if out.finished:
                    shown, done = text, True
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print(" [interrupted]", end="")
    print(flush=True)
    return shown


def _load_bench_module():
    """benchmarks/ sits beside the package in a source checkout (it is not installed)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    if not path.exists():
        raise CLIError(f"{path} not found: `loraserve bench` needs a source checkout (pip install -e .)")
    spec = importlib.util.spec_from_file_location("loraserve_bench_generate", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def cmd_bench(args: argparse.Namespace) -> int:
    bench = _load_bench_module()
    result = bench.run(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        batch=args.batch,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        repeat=args.repeat,
    )
    print(bench.format_report(result))
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from loraserve.config import ConfigError
    from loraserve.engine.engine import RequestError
    from loraserve.lora.errors import LoRAError
    from loraserve.models.loader import ModelNotFoundError
    from loraserve.sampling import SamplingParamsError

    return (CLIError, ConfigError, RequestError, LoRAError, ModelNotFoundError, SamplingParamsError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        parser.exit(2, f"loraserve: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, "\n")
    except Exception as e:
        if isinstance(e, _user_errors()):
            parser.exit(1, f"loraserve: error: {e}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
