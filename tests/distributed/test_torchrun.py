"""Under torchrun: rank 0 runs the engine, rank 1 follows it inside ``LLM(...)`` and exits with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import make_tiny_model

from loraserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [90, 91], [3, 200, 17, 17, 40]]
SCRIPT = """
import json, sys
from loraserve import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    # only rank 0 gets here: rank 1 served inside LLM(...) and exited when rank 0 shut down
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[3])],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    llm.shutdown()
    with open(sys.argv[2], "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
"""


def test_torchrun_two_ranks_generate_like_tp1(tmp_path: Path):
    model = tmp_path / "model"
    make_tiny_model(model, "llama", num_key_value_heads=1, initializer_range=0.2)
    llm = LLM(str(model), device="cpu", num_kv_blocks=64)
    ref = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    script, out = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(model),
            str(out),
            json.dumps(PROMPTS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == [o.outputs[0].token_ids for o in ref]
