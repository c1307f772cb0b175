"""Broken adapters loaded over HTTP (`/v1/load_lora_adapter`): a 400 naming the problem, nothing
registered, and the server serves the same greedy answers afterwards. The checks themselves are
tested in depth in tests/lora/test_hostile_adapters.py; this is the server's side of them."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from test_hostile_requests import AUTH, HTTP, check_refused, check_still_serving, post, reference  # noqa: F401


def broken_copy(
    files, name: str, scale: float | None = None, poke_nan: bool = False, config: dict | None = None
):
    """A copy of the root's adapter a2, under the root, with its weights or config broken."""
    d = files.root / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(files.root / "a2", d)
    if scale is not None or poke_nan:
        sd = load_file(str(d / "adapter_model.safetensors"))
        key = sorted(sd)[0]
        if scale is not None:
            sd = {k: v * scale for k, v in sd.items()}
        if poke_nan:
            sd[key].view(-1)[0] = float("nan")
        save_file(sd, str(d / "adapter_model.safetensors"))
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config)
        (d / "adapter_config.json").write_text(json.dumps(cfg))  # NaN written as JSON's NaN
    return d


CASES = [
    ("nan-weights", dict(poke_nan=True), ["NaN"]),
    ("huge-weights", dict(scale=1e30), ["overflow"]),
    ("nan-alpha", dict(config={"lora_alpha": float("nan")}), ["lora_alpha"]),
]


@pytest.mark.parametrize("name,broken,words", CASES, ids=[c[0] for c in CASES])
def test_a_broken_adapter_is_refused_over_http(server, files, reference, name, broken, words):  # noqa: F811
    broken_copy(files, name, **broken)
    r = post(server.url, "/v1/load_lora_adapter", json.dumps({"lora_name": name, "lora_path": name}))
    check_refused(r, 400, None, *words)
    names = {m["id"] for m in HTTP.get(server.url + "/v1/models", headers=AUTH).json()["data"]}
    assert name not in names
    check_still_serving(server.url, reference)
