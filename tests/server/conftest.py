"""A real server (uvicorn on 127.0.0.1, a free port, in a background thread) on a tiny random llama,
with PEFT adapters made on the fly, and the offline LLM on the same files as the reference."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import make_peft_adapter, make_tiny_model

API_KEY = "test-key"
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 64
MAX_LORA_RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ServerThread:
    def __init__(self, app):
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.app = app
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@dataclass
class Files:
    base: Path
    a0: Path
    a1: Path
    root: Path  # --lora-root
    outside: Path  # an adapter outside the root


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> Files:
    d = tmp_path_factory.mktemp("server")
    base = d / "tiny-llama"
    make_tiny_model(base, "llama")
    a0 = make_peft_adapter(base, d / "a0", seed=1, r=8, lora_alpha=16, target_modules=TARGETS)
    a1 = make_peft_adapter(
        base, d / "a1", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    root = d / "root"
    root.mkdir()
    make_peft_adapter(base, root / "a2", seed=3, r=8, lora_alpha=32, target_modules=TARGETS)
    make_peft_adapter(base, root / "a2b", seed=4, r=8, lora_alpha=32, target_modules=TARGETS)
    make_peft_adapter(
        base, root / "too-big", seed=5, r=MAX_LORA_RANK * 2, lora_alpha=8, target_modules=["q_proj"]
    )
    outside = make_peft_adapter(base, d / "outside", seed=6, r=8, lora_alpha=16, target_modules=TARGETS)
    os.symlink(outside, root / "link-out")  # a dir symlink pointing outside the root
    sneaky = root / "sneaky"  # a real dir under the root whose weights file links outside
    sneaky.mkdir()
    (sneaky / "adapter_config.json").write_text((outside / "adapter_config.json").read_text())
    os.symlink(outside / "adapter_model.safetensors", sneaky / "adapter_model.safetensors")
    return Files(base, a0, a1, root, outside)


def make_engine(base: Path, enable_lora: bool = True):
    from loraserve.llm import LLM

    return LLM(
        model=str(base),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=16,
        enable_lora=enable_lora,
        max_loras=4,
        max_lora_rank=MAX_LORA_RANK,
        device="cpu",
    )


@pytest.fixture(scope="session")
def server(files):
    from loraserve.server.app import ServerConfig, build_app

    config = ServerConfig(
        api_key=API_KEY,
        allow_runtime_lora_updating=True,
        lora_root=str(files.root),
        lora_modules=[("a0", str(files.a0)), ("a1", str(files.a1))],
    )
    app = build_app(make_engine(files.base).engine, config)
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def offline(files):
    """The offline API on the same files: the reference answers."""
    return make_engine(files.base)
