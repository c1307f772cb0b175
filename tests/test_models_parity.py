"""Model parity with Hugging Face transformers on tiny random models (fp32, CPU).

For every supported architecture (llama, mistral, qwen2, qwen3; tied and untied embeddings; GQA
with 4 query heads over 2 KV heads) one batch of three prompts of different lengths goes through
``LLM.generate``; the oracle is ``AutoModelForCausalLM``: prompt logprobs and every decoded token's
logprob within 1e-4 of HF's log-softmax over prompt + generated ids, and the greedy ids equal to
HF ``generate``. Then rope scaling (linear, llama3, yarn) at positions far past the original
context, Mistral's sliding window, and the error for an unknown architecture.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from helpers import VOCAB, hf_logprobs, make_tiny_model

from loraserve import LLM, SamplingParams
from loraserve.models.registry import UnsupportedModelError, get_model_class, supported_architectures

ATOL = 1e-4
MAX_TOKENS = 16
SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()  # no pad (0) / eos (1)


PROMPTS = [random_prompt(n, seed=n) for n in (5, 11, 17)]


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Give the weights HF initializes to constants (norm weights = 1, biases = 0) random values,
    so norms, q/k norms and the qkv bias are actually exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def build(path, arch: str, tied: bool = False, seed: int = 0, **overrides):
    """A tiny model with non-trivial norms and biases, saved at path; returns the HF model."""
    overrides.setdefault("initializer_range", 0.1)  # peaked enough that greedy has clear winners
    model = make_tiny_model(path, arch, tied=tied, seed=seed, **overrides)
    perturb_(model, seed + 1)
    model.save_pretrained(str(path))
    return model.eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            eos_token_id=None,
            max_new_tokens=n,
        )
    ids = out[0, len(prompt) :].tolist()
    assert len(ids) == n, "HF stopped early: eos_token_id=None should disable the eos stop"
    return ids


def check_logprobs(hf_model, prompt: list[int], out) -> None:
    """Prompt logprobs (with the rank-1 entry) and every decode logprob match HF log-softmax."""
    gen = out.outputs[0].token_ids
    ref = hf_logprobs(hf_model, prompt + gen)  # (len, V): row i predicts token i + 1
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        d = plp[i]
        tok = prompt[i]
        assert tok in d, f"prompt position {i}: token {tok} missing from {d}"
        assert abs(d[tok].logprob - ref[i - 1, tok].item()) <= ATOL, (
            i,
            d[tok].logprob,
            ref[i - 1, tok].item(),
        )
        assert d[tok].rank == int((ref[i - 1] > ref[i - 1, tok]).sum()) + 1
        top = int(ref[i - 1].argmax())
        assert top in d and d[top].rank == 1
        assert abs(d[top].logprob - ref[i - 1, top].item()) <= ATOL
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(gen) == MAX_TOKENS
    for j, tok in enumerate(gen):
        row = ref[len(prompt) - 1 + j]
        assert abs(lps[j][tok].logprob - row[tok].item()) <= ATOL, (j, lps[j][tok].logprob, row[tok].item())


# ---- every architecture, tied and untied ---------------------------------------------------------
ARCH_CASES = [(arch, tied) for arch in ("llama", "mistral", "qwen2", "qwen3") for tied in (False, True)]


@pytest.fixture(
    scope="module", params=ARCH_CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in ARCH_CASES]
)
def arch_run(request, tmp_path_factory):
    arch, tied = request.param
    path = tmp_path_factory.mktemp(f"{arch}_{int(tied)}")
    hf = build(path, arch, tied=tied, seed=len(arch) + tied)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP)
    yield hf, outs
    del llm


def test_arch_config_is_gqa_and_tied_as_named(arch_run, request):
    hf, _ = arch_run
    arch, tied = request.node.callspec.params["arch_run"]
    cfg = hf.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.tie_word_embeddings is tied
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) is tied


def test_arch_logprobs_match_hf(arch_run):
    hf, outs = arch_run
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        check_logprobs(hf, prompt, out)


def test_arch_greedy_ids_match_hf_generate(arch_run):
    hf, outs = arch_run
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        assert out.outputs[0].finish_reason == "length"


# ---- rope scaling --------------------------------------------------------------------------------
LONG_PROMPT = random_prompt(190, seed=190)  # positions 0..205 with the 16 generated tokens
ORIG = 64
ROPE_CASES = {
    # the transformers v4 key; transformers 5 still accepts it and moves it to rope_parameters
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, max_position_embeddings=ORIG),
    "llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        max_position_embeddings=4 * ORIG,
    ),
    "yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        max_position_embeddings=4 * ORIG,
    ),
    "yarn-custom": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": ORIG,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.3,
            "truncate": False,
        },
        max_position_embeddings=4 * ORIG,
    ),
}


@pytest.fixture(scope="module", params=list(ROPE_CASES))
def rope_run(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(f"rope_{name}")
    hf = build(path, "llama", seed=7, **ROPE_CASES[name])
    saved = json.loads((path / "config.json").read_text())
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, max_num_seqs=2)
    (out,) = llm.generate([{"prompt_token_ids": LONG_PROMPT}], SP)
    yield name, hf, out, saved
    del llm


def test_rope_scaling_config_is_what_we_asked(rope_run):
    name, hf, _, saved = rope_run
    want = name.split("-")[0]
    assert saved["rope_parameters"]["rope_type"] == want
    assert hf.config.rope_parameters["factor"] == 4.0


def test_rope_scaling_matters_here(rope_run):
    """The test would catch an engine that ignores the scaling: HF with default rope differs."""
    _, hf, out, _ = rope_run
    cfg = hf.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    plain.load_state_dict(hf.state_dict())
    ids = LONG_PROMPT + out.outputs[0].token_ids
    diff = (hf_logprobs(hf, ids) - hf_logprobs(plain, ids)).abs().max().item()
    assert diff > 100 * ATOL


def test_rope_scaling_logprobs_match_hf_at_long_positions(rope_run):
    _, hf, out, _ = rope_run
    check_logprobs(hf, LONG_PROMPT, out)
    assert len(LONG_PROMPT) + len(out.outputs[0].token_ids) > 3 * ORIG


def test_rope_scaling_greedy_matches_hf_generate(rope_run):
    _, hf, out, _ = rope_run
    assert out.outputs[0].token_ids == hf_greedy(hf, LONG_PROMPT, MAX_TOKENS)


# ---- mistral sliding window ----------------------------------------------------------------------
WINDOW = 8
SW_PROMPT = random_prompt(20, seed=20)


@pytest.fixture(scope="module")
def sliding_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral_sw")
    hf = build(path, "mistral", seed=11, sliding_window=WINDOW)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2)
    (out,) = llm.generate([{"prompt_token_ids": SW_PROMPT}], SP)
    yield path, hf, out
    del llm


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_matches_hf(sliding_run, attn):
    path, _, out = sliding_run
    hf = transformers.MistralForCausalLM.from_pretrained(str(path), attn_implementation=attn).eval()
    assert hf.config.sliding_window == WINDOW
    check_logprobs(hf, SW_PROMPT, out)
    assert out.outputs[0].token_ids == hf_greedy(hf, SW_PROMPT, MAX_TOKENS)


def test_sliding_window_matters_here(sliding_run):
    """HF without the window gives different logprobs past position WINDOW: the test can fail."""
    path, hf, out = sliding_run
    full = transformers.MistralForCausalLM.from_pretrained(str(path), sliding_window=None).eval()
    ids = SW_PROMPT + out.outputs[0].token_ids
    a, b = hf_logprobs(hf, ids), hf_logprobs(full, ids)
    assert (a[:WINDOW] - b[:WINDOW]).abs().max().item() <= ATOL  # inside the window: identical
    assert (a[WINDOW:] - b[WINDOW:]).abs().max().item() > 100 * ATOL


# ---- unknown architecture ------------------------------------------------------------------------
def test_unknown_architecture_lists_supported(tmp_path):
    src = tmp_path / "src"
    make_tiny_model(src, "llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(model=str(src), dtype="float32")
    msg = str(e.value)
    assert "FancyNewForCausalLM" in msg
    supported = supported_architectures()
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        supported
    )
    for arch in supported:
        assert arch in msg


def test_config_without_architectures_is_refused(tmp_path):
    make_tiny_model(tmp_path / "m", "llama")
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / "m"))
    cfg.architectures = None
    with pytest.raises(UnsupportedModelError, match="architectures"):
        get_model_class(cfg)
    shutil.rmtree(tmp_path / "m")
