"""Sampling: seeds, the support and distribution of top-k / top-p / min-p, stop conditions, logprobs.

Filters are checked on an 8-token vocabulary against sets and probabilities computed here from
the definitions (vLLM/HF semantics: temperature first, then top-k, top-p on the renormalized
top-k distribution, min-p relative to the most likely survivor).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import VOCAB, hf_logprobs, make_tiny_model

from loraserve import LLM, SamplingParams
from loraserve.engine.sampler import Sampler, apply_filters, apply_filters_batched, compute_logprobs
from loraserve.sampling import SamplingParamsError

# ---- filters on a small vocabulary ---------------------------------------------------------------
# token id -> probability (distinct values, ids deliberately not in probability order)
PROBS = {0: 0.10, 1: 0.30, 2: 0.02, 3: 0.15, 4: 0.07, 5: 0.20, 6: 0.04, 7: 0.12}
LOGITS = torch.tensor([math.log(PROBS[i]) + 1.7 for i in range(8)])  # offset: logits, not logprobs
N_SAMPLES = 6000


def expected_dist(
    temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> dict[int, float]:
    """The filtered, renormalized distribution, from the definitions (plain python)."""
    w = {i: p ** (1.0 / temperature) for i, p in PROBS.items()}
    z = sum(w.values())
    dist = {i: v / z for i, v in w.items()}
    order = sorted(dist, key=dist.get, reverse=True)
    if top_k > 0:
        order = order[:top_k]
    dist = {i: dist[i] / sum(dist[j] for j in order) for i in order}
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in order:  # smallest prefix whose mass reaches top_p
            kept.append(i)
            mass += dist[i]
            if mass >= top_p:
                break
        order = kept
        dist = {i: dist[i] / sum(dist[j] for j in order) for i in order}
    if min_p > 0.0:
        top = max(dist.values())
        order = [i for i in order if dist[i] >= min_p * top]
        dist = {i: dist[i] / sum(dist[j] for j in order) for i in order}
    return dist


FILTER_CASES = {
    "none": dict(temperature=1.0),
    "top_k_3": dict(temperature=1.0, top_k=3),
    "top_k_1": dict(temperature=1.0, top_k=1),
    "top_k_all": dict(temperature=1.0, top_k=8),
    "top_p_0.6": dict(temperature=1.0, top_p=0.6),  # 0.30 + 0.20 = 0.50 < 0.6 <= 0.65: 3 tokens
    "top_p_0.25": dict(temperature=1.0, top_p=0.25),  # the top token alone exceeds it
    "top_p_0.9": dict(temperature=1.0, top_p=0.9),
    "min_p_0.3": dict(temperature=1.0, min_p=0.3),  # p >= 0.09: 5 tokens
    "min_p_0.6": dict(temperature=1.0, min_p=0.6),
    "hot_min_p": dict(temperature=2.0, min_p=0.6),  # temperature changes which tokens pass
    "cold_top_p": dict(temperature=0.5, top_p=0.8),
    "top_k_then_top_p": dict(temperature=1.0, top_k=3, top_p=0.7),  # top_p on the renormalized top-3
    "all_three": dict(temperature=1.3, top_k=6, top_p=0.85, min_p=0.2),
}


def test_expected_sets_are_not_trivial():
    """Guard for the cases below: the reference sets differ from each other and from the full vocab."""
    sets = {name: frozenset(expected_dist(**kw)) for name, kw in FILTER_CASES.items()}
    assert sets["top_k_3"] == {1, 5, 3}
    assert sets["top_p_0.6"] == {1, 5, 3}
    assert sets["min_p_0.3"] == {1, 5, 3, 7, 0}
    assert sets["hot_min_p"] != sets["min_p_0.6"]
    assert sets["top_k_then_top_p"] == {1, 5} != set(expected_dist(1.0, top_p=0.7))  # {1, 5, 3, 7}
    assert sum(s != frozenset(range(8)) for s in sets.values()) >= len(sets) - 2


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_apply_filters_support_is_exact(case):
    params = SamplingParams(**FILTER_CASES[case])
    out = apply_filters(LOGITS.clone(), params)
    allowed = {i for i in range(8) if math.isfinite(out[i].item())}
    assert allowed == set(expected_dist(**FILTER_CASES[case]))
    got = out.softmax(-1)
    for i, p in expected_dist(**FILTER_CASES[case]).items():
        assert abs(got[i].item() - p) < 1e-5


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_sampler_draws_only_and_all_allowed_tokens(case):
    params = SamplingParams(**FILTER_CASES[case])
    want = expected_dist(**FILTER_CASES[case])
    logits = LOGITS.expand(N_SAMPLES, 8).clone()
    gen = torch.Generator().manual_seed(1234)
    draws = Sampler(seed=0)(logits, [params] * N_SAMPLES, [gen] * N_SAMPLES).tolist()
    counts = {i: draws.count(i) for i in range(8) if draws.count(i)}
    assert set(counts) == set(want)
    for i, p in want.items():  # frequencies within 5 sigma of the target distribution
        sigma = math.sqrt(p * (1 - p) / N_SAMPLES)
        assert abs(counts[i] / N_SAMPLES - p) <= 5 * sigma + 1e-9, (i, counts[i] / N_SAMPLES, p)


def test_greedy_ignores_filters_and_takes_argmax():
    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.arange(8.0)])
    params = [SamplingParams(temperature=0, top_k=2, top_p=0.1, min_p=0.9)] * 3
    out = Sampler()(logits, params, [None] * 3).tolist()
    assert out == [1, 6, 7]


def test_banned_tokens_are_never_drawn():
    logits = LOGITS.expand(2000, 8).clone()
    params = [SamplingParams(temperature=1.0)] * 1999 + [SamplingParams(temperature=0)]
    banned = [[1, 5]] * 2000
    out = Sampler(seed=3)(logits, params, [None] * 2000, banned).tolist()
    assert not {1, 5} & set(out)
    assert out[-1] == 3  # greedy falls to the best allowed token
    assert set(out[:-1]) == set(range(8)) - {1, 5}


def test_same_generator_seed_same_draws_different_seed_different_draws():
    logits = LOGITS.expand(200, 8).clone()
    p = [SamplingParams(temperature=1.0)] * 200

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return Sampler(seed=99)(logits, p, [g] * 200).tolist()

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


# ---- the batched filters equal the single-row reference ------------------------------------------
def random_params(g: torch.Generator, n: int, V: int) -> list[SamplingParams]:
    """Mixed filters per row, each often off, k sometimes >= V."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    return [
        SamplingParams(
            temperature=pick([0.3, 0.7, 1.0, 1.9]),
            top_k=pick([0, 0, 1, 2, 5, V - 1, V, V + 3]),
            top_p=pick([1.0, 1.0, 0.05, 0.5, 0.8, 0.95]),
            min_p=pick([0.0, 0.0, 0.05, 0.3, 0.9]),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("ties", [False, True])
def test_batched_filters_equal_apply_filters_row_by_row(ties):
    g = torch.Generator().manual_seed(int(ties))
    checked = {"k": 0, "p": 0, "m": 0}
    for _ in range(60):
        n = int(torch.randint(1, 10, (1,), generator=g))
        V = [8, 64, 500][int(torch.randint(3, (1,), generator=g))]
        if ties:  # few distinct values: ties at the k-th value and across the top-p boundary
            logits = torch.randint(-3, 3, (n, V), generator=g).float()
        else:
            logits = torch.randn(n, V, generator=g) * 3
        logits[torch.rand(n, V, generator=g) < 0.05] = float("-inf")  # banned tokens
        logits[:, 0] = 1.0  # at least one token allowed per row
        params = random_params(g, n, V)
        got = apply_filters_batched(logits, params)
        for i, p in enumerate(params):
            want = apply_filters(logits[i], p)
            assert torch.equal(got[i], want), (p, (got[i] != want).nonzero())
            checked["k"] += 0 < p.top_k < V and bool(torch.isinf(want).sum() > torch.isinf(logits[i]).sum())
            checked["p"] += p.top_p < 1
            checked["m"] += p.min_p > 0
    assert min(checked.values()) >= 20  # every filter was exercised, and top-k really cut


def test_off_filters_change_nothing_but_temperature():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g)
    on = SamplingParams(temperature=0.8, top_k=3, top_p=0.5, min_p=0.2)
    off = [
        SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=0.8, top_k=300),  # k >= V is off too
        SamplingParams(temperature=0.8, top_k=-1),
    ]
    params = [off[0], on, off[1], on, off[2], on]  # batched with rows whose filters are on
    got = apply_filters_batched(logits, params)
    for i in (0, 2, 4):
        assert torch.equal(got[i], logits[i] / 0.8)
    for i in (1, 3, 5):
        assert int(torch.isfinite(got[i]).sum()) < 3


def test_sampler_mixed_batch_seeded_rows_do_not_depend_on_the_batch():
    """Greedy rows take the argmax; a seeded row draws the same alone as inside any batch."""
    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(6, V, generator=g)
    hot = SamplingParams(temperature=1.5, top_p=0.9)
    params = [SamplingParams(temperature=0), hot, hot, SamplingParams(temperature=0), hot, hot]

    def draws(seed_a, seed_b, rows=range(6)):
        gens = {1: seed_a, 4: seed_b}
        gens = [torch.Generator().manual_seed(gens[i]) if i in gens else None for i in rows]
        return Sampler(seed=1)(logits[list(rows)], [params[i] for i in rows], gens).tolist()

    out = draws(7, 8)
    assert out[0] == int(logits[0].argmax()) and out[3] == int(logits[3].argmax())
    seq_a = [draws(7, 8)[1] for _ in range(3)]
    assert len(set(seq_a)) == 1  # a fresh generator of the same seed: the same token
    assert draws(7, 8, rows=[1])[0] == out[1]  # alone
    assert draws(7, 99, rows=[5, 1, 4])[1] == out[1]  # other rows, other order, other seeds
    many = {tuple(draws(s, s + 1)) for s in range(20)}
    assert len(many) > 1  # different seeds, different draws


def test_sampler_returns_ids_on_the_logits_device():
    logits = LOGITS.expand(3, 8).clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=2)]
    out = Sampler()(logits, params, [None] * 3, [[1], [], [1, 5]])
    assert out.device == logits.device and out.dtype == torch.long and out.shape == (3,)
    assert out[0] == 5 and out[2] in (3, 7)  # top-2 after banning 1 and 5: {3, 7}


def test_compute_logprobs_per_row_top_k():
    lp = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 1.0, -1.0]]), dim=-1)
    top = compute_logprobs(lp, torch.tensor([2, 3]), [2, 0])
    assert top.token_rank == [3, 4]  # two ties ahead of token 2 in row 0
    assert top.token_logprob == pytest.approx([lp[0, 2].item(), lp[1, 3].item()])
    assert top.top_ids[1] == [] and top.top_logprobs[1] == []
    assert set(top.top_ids[0]) == {1, 3} and top.top_logprobs[0] == pytest.approx([lp[0, 1].item()] * 2)


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(temperature=-1.0),
        dict(logprobs=21),
    ],
)
def test_bad_sampling_params_are_refused(kw):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kw)


# ---- through the engine --------------------------------------------------------------------------
PROMPT = [200, 31, 7, 64, 128, 9, 77]  # its greedy continuation hardly repeats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = make_tiny_model(path, "llama", initializer_range=0.1)
    llm = LLM(model=str(path), dtype="float32", max_model_len=48, max_num_seqs=8, seed=0)
    return path, hf, llm


def ids_of(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_seeded_generate_is_reproducible(tiny):
    _, _, llm = tiny
    p = {"prompt_token_ids": PROMPT}

    def run(seed, n=1):
        return ids_of(
            llm.generate(p, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed, n=n))
        )

    a, b = run(11), run(11)
    assert a == b and len(a[0]) == 16
    assert run(12) != a
    two = run(11, n=2)
    assert two[0] == a[0] and two[1] != two[0]  # completion i uses seed + i
    # the same seed inside a batch of other requests
    batch = llm.generate(
        [p, {"prompt_token_ids": [5, 6, 7]}, p],
        [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s) for s in (11, 3, 11)],
    )
    assert batch[0].outputs[0].token_ids == batch[2].outputs[0].token_ids == a[0]


def test_seeded_generators_are_made_on_the_sampling_device(tiny):
    _, _, llm = tiny
    eng = llm.engine
    eng.add_request("g", None, SamplingParams(temperature=1.0, max_tokens=4, seed=3, n=2), PROMPT)
    seqs = eng.requests["g"].seqs
    assert [s.seed for s in seqs] == [3, 4] and all(s.generator is None for s in seqs)
    while eng.has_unfinished_requests():
        eng.step()
    assert all(s.generator is not None and s.generator.device == eng.device for s in seqs)


def test_unseeded_requests_follow_the_engine_seed(tiny):
    path, _, _ = tiny
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run(engine_seed):
        llm = LLM(model=str(path), dtype="float32", max_model_len=48, seed=engine_seed)
        return ids_of(llm.generate({"prompt_token_ids": PROMPT}, params)), ids_of(
            llm.generate({"prompt_token_ids": PROMPT}, params)
        )

    first, second = run(5)
    assert run(5) == (first, second)
    assert first != second  # the engine's generator moves on between calls
    assert run(6)[0] != first


def test_top_k_1_sampling_is_greedy(tiny):
    _, _, llm = tiny
    p = {"prompt_token_ids": PROMPT}
    g = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    s = llm.generate(p, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=1))
    assert ids_of(g) == ids_of(s)


@pytest.fixture(scope="module")
def greedy_ref(tiny):
    """Greedy continuation without stops, and the text the tokenizer makes of it."""
    _, _, llm = tiny
    (o,) = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    ids = o.outputs[0].token_ids
    tok = llm.get_tokenizer()
    text = tok.decode(PROMPT + ids)[len(tok.decode(PROMPT)) :]
    assert o.outputs[0].text == text
    return ids, text


def first_fresh_index(ids: list[int], start: int) -> int:
    """An index j >= start whose token appears nowhere before j (so a stop on it triggers at j)."""
    for j in range(start, len(ids)):
        if ids[j] not in ids[:j]:
            return j
    raise AssertionError(f"test setup: the greedy continuation {ids} repeats itself too much")


def char_start(tok, ids: list[int], j: int) -> int:
    """Where the text of generated token j (with its leading space) starts in the output text."""
    return len(tok.decode(PROMPT + ids[:j])) - len(tok.decode(PROMPT))


def pick_stop(tok, ids: list[int], text: str, make, start: int = 3) -> tuple[int, str]:
    """The first j >= start whose stop string make(j) -> (stop, first token) first occurs right there."""
    for j in range(start, len(ids)):
        stop, first = make(j)
        if stop and text.find(stop) == char_start(tok, ids, first):
            return j, stop
    raise AssertionError(f"test setup: no usable stop string in {text!r}")


def gen(llm, **kw):
    kw.setdefault("max_tokens", 20)
    (o,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, ignore_eos=True, **kw))
    return o.outputs[0]


def test_max_tokens_finishes_with_length(tiny, greedy_ref):
    _, _, llm = tiny
    ids, _ = greedy_ref
    out = gen(llm, max_tokens=7)
    assert out.token_ids == ids[:7] and out.finish_reason == "length" and out.stop_reason is None


def test_no_max_tokens_runs_to_max_model_len(tiny):
    _, _, llm = tiny
    out = gen(llm, max_tokens=None)
    assert len(PROMPT) + len(out.token_ids) == 48 and out.finish_reason == "length"


def test_stop_token_ids(tiny, greedy_ref):
    _, _, llm = tiny
    ids, _ = greedy_ref
    j = first_fresh_index(ids, 3)
    out = gen(llm, stop_token_ids=[ids[j], 255 if ids[j] != 255 else 254])
    assert out.token_ids == ids[: j + 1]  # the stop token is returned (vLLM)
    assert out.finish_reason == "stop" and out.stop_reason == ids[j]


def test_min_tokens_defers_stop_tokens(tiny, greedy_ref):
    _, _, llm = tiny
    ids, _ = greedy_ref
    stop = ids[1]
    out = gen(llm, stop_token_ids=[stop], min_tokens=6, max_tokens=20)
    assert len(out.token_ids) >= 6
    assert stop not in out.token_ids[:6]
    assert out.finish_reason == "length" or (out.token_ids[-1] == stop and out.finish_reason == "stop")


def test_stop_string_truncates_text(tiny, greedy_ref):
    _, _, llm = tiny
    ids, text = greedy_ref
    tok = llm.get_tokenizer()
    j, stop = pick_stop(tok, ids, text, lambda j: (" " + tok.decode([ids[j]]), j), start=4)
    out = gen(llm, stop=[stop, "never-appears"])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[: j + 1]  # the token that completed the stop string is returned
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text

    kept = gen(llm, stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[: text.find(stop) + len(stop)]
    assert kept.token_ids == out.token_ids


def test_stop_string_spanning_tokens(tiny, greedy_ref):
    _, _, llm = tiny
    ids, text = greedy_ref
    tok = llm.get_tokenizer()
    j, stop = pick_stop(tok, ids, text, lambda j: (" " + tok.decode(ids[j - 1 : j + 1]), j - 1), start=4)
    assert " " in stop.strip()  # two words
    out = gen(llm, stop=stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[: j + 1]
    assert out.text == text[: text.find(stop)]


def test_stop_string_inside_a_token(tiny, greedy_ref):
    """A stop string that is a prefix of one token's text (" t12" of " t123") cuts right there."""
    _, _, llm = tiny
    ids, text = greedy_ref
    tok = llm.get_tokenizer()

    def partial(j):
        word = tok.decode([ids[j]])
        return (" " + word[:-1], j) if len(word) >= 3 else ("", j)

    j, stop = pick_stop(tok, ids, text, partial)
    out = gen(llm, stop=stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[: j + 1]
    assert out.text == text[: text.find(stop)]


def test_eos_stops_unless_ignored(tmp_path):
    """A model whose lm_head makes eos (id 1) overwhelmingly likely after PROMPT: it stops at once."""
    hf = make_tiny_model(tmp_path, "llama")
    with torch.no_grad():
        h = hf.model(torch.tensor([PROMPT])).last_hidden_state[0, -1]  # final-norm output
        hf.lm_head.weight[1] = 10.0 * h / h.norm()  # eos logit = 10 |h|, the others ~ 0.02 |h|
    hf.save_pretrained(str(tmp_path))
    assert int(hf_logprobs(hf, PROMPT)[-1].argmax()) == 1
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=48)
    p = {"prompt_token_ids": PROMPT}
    (o,) = llm.generate(p, SamplingParams(temperature=0, max_tokens=10))
    assert o.outputs[0].token_ids == [1] and o.outputs[0].finish_reason == "stop"
    assert o.outputs[0].text == ""  # eos is special, skipped in text
    (o,) = llm.generate(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(o.outputs[0].token_ids) == 4 and o.outputs[0].finish_reason == "length"
    (o,) = llm.generate(p, SamplingParams(temperature=0, max_tokens=5, min_tokens=3))
    assert len(o.outputs[0].token_ids) >= 3 and 1 not in o.outputs[0].token_ids[:3]


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_contain_sampled_token_with_correct_rank(tiny, k):
    _, hf, llm = tiny
    tok = llm.get_tokenizer()
    (o,) = llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(
            temperature=2.0, max_tokens=16, ignore_eos=True, seed=4, logprobs=k, prompt_logprobs=k
        ),
    )
    out = o.outputs[0]
    ref = hf_logprobs(hf, PROMPT + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    not_top = 0
    for j, (d, t) in enumerate(zip(out.logprobs, out.token_ids)):
        row = ref[len(PROMPT) - 1 + j]
        assert t in d
        assert d[t].rank == int((row > row[t]).sum()) + 1
        assert abs(d[t].logprob - row[t].item()) < 1e-4
        assert d[t].decoded_token == tok.decode([t])
        top = row.topk(k).indices.tolist() if k else []
        assert set(d) == set(top) | {t}
        for r, tid in enumerate(top):
            assert d[tid].rank == r + 1 and abs(d[tid].logprob - row[tid].item()) < 1e-4
        not_top += d[t].rank > 1
    assert not_top > 0, "temperature 2 should sample some non-argmax tokens"
    assert o.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        d, t = o.prompt_logprobs[i], PROMPT[i]
        assert t in d and d[t].rank == int((ref[i - 1] > ref[i - 1, t]).sum()) + 1
        assert len(d) in (k, k + 1)


def test_vocab_is_what_the_tests_assume():
    assert VOCAB == 256
