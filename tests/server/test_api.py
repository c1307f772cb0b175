"""The server answers like the offline API: completions, chat, streaming, logprobs, adapters, models."""

from __future__ import annotations

import pytest

from loraserve.lora.request import LoRARequest
from loraserve.sampling import SamplingParams

PROMPT = "t5 t9 t17 t33 t65"


def lora(files, name):
    return (
        None
        if name == "tiny-llama"
        else LoRARequest(name, {"a0": 1, "a1": 2}[name], str(getattr(files, name)))
    )


def ref(offline, files, prompt, model="tiny-llama", **kw):
    kw.setdefault("temperature", 0.0)
    return offline.generate(prompt, SamplingParams(**kw), lora_request=lora(files, model))[0]


def test_models_lists_base_and_adapters(client):
    cards = {m.id: m for m in client.models.list().data}
    assert {"tiny-llama", "a0", "a1"} <= set(cards)
    assert cards["tiny-llama"].parent is None
    assert cards["a0"].parent == cards["a1"].parent == "tiny-llama"


@pytest.mark.parametrize("model", ["tiny-llama", "a0", "a1"])
def test_completion_equals_offline(client, offline, files, model):
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    want = ref(offline, files, PROMPT, model, max_tokens=12, ignore_eos=True, logprobs=2)
    c = r.choices[0]
    assert c.text == want.outputs[0].text
    assert c.finish_reason == "length"
    assert c.logprobs.tokens == [offline.get_tokenizer().decode([t]) for t in want.outputs[0].token_ids]
    got_lp = c.logprobs.token_logprobs
    want_lp = [d[t].logprob for t, d in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert got_lp == pytest.approx(want_lp, abs=1e-5)
    assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 12


def test_adapters_change_the_answer(client):
    texts = {
        m: client.completions.create(
            model=m, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for m in ("tiny-llama", "a0", "a1")
    }
    assert len(set(texts.values())) == 3, texts


def test_prompt_forms(client, offline, files):
    tok = offline.get_tokenizer()
    ids = [tok.encode(p) for p in ("t5 t6", "t7 t8 t9")]
    want = [
        ref(offline, files, {"prompt_token_ids": i}, "a0", max_tokens=6, ignore_eos=True).outputs[0].text
        for i in ids
    ]
    for prompt in (["t5 t6", "t7 t8 t9"], ids):
        r = client.completions.create(
            model="a0", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in r.choices] == [0, 1]
        assert [c.text for c in r.choices] == want
    r = client.completions.create(
        model="a0", prompt=ids[1], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in r.choices] == want[1:]


def test_n_and_seed_equal_offline(client, offline, files):
    r = client.completions.create(
        model="a1",
        prompt=PROMPT,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=8,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    want = ref(
        offline, files, PROMPT, "a1", n=3, temperature=1.0, seed=7, top_k=50, max_tokens=8, ignore_eos=True
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in want.outputs]
    assert len({c.text for c in r.choices}) > 1  # sampled, seeded per completion


def test_echo_with_logprobs(client, offline, files):
    r = client.completions.create(
        model="a0",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    want = ref(offline, files, PROMPT, "a0", max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT + want.outputs[0].text
    n_prompt = len(want.prompt_token_ids)
    assert len(c.logprobs.tokens) == n_prompt + 4
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    tok = offline.get_tokenizer()
    assert c.logprobs.tokens == [tok.decode([t]) for t in want.prompt_token_ids + want.outputs[0].token_ids]
    want_prompt = [want.prompt_logprobs[i][t].logprob for i, t in enumerate(want.prompt_token_ids) if i > 0]
    assert c.logprobs.token_logprobs[1:n_prompt] == pytest.approx(want_prompt, abs=1e-5)
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)


def test_stop_string(client, offline, files):
    full = ref(offline, files, PROMPT, "a0", max_tokens=12, ignore_eos=True).outputs[0].text
    stop = full.split()[3]  # a word from the middle of the answer
    r = client.completions.create(
        model="a0", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    want = ref(offline, files, PROMPT, "a0", max_tokens=12, ignore_eos=True, stop=[stop]).outputs[0]
    assert r.choices[0].text == want.text and stop not in want.text and want.finish_reason == "stop"
    assert r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model="a0",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text


MESSAGES = [{"role": "system", "content": "t40 t41"}, {"role": "user", "content": "t5 t6 t7"}]


@pytest.mark.parametrize("model", ["tiny-llama", "a1"])
def test_chat_equals_offline(client, offline, files, model):
    r = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    want = offline.chat(
        MESSAGES,
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
        lora_request=lora(files, model),
    )[0]
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    lps = c.logprobs.content
    assert [x.logprob for x in lps] == pytest.approx(
        [d[t].logprob for t, d in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)], abs=1e-5
    )
    assert all(
        len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob for x in lps
    )


def test_chat_content_parts(client):
    plain = client.chat.completions.create(
        model="a0", messages=[{"role": "user", "content": "t5 t6"}], max_tokens=5, temperature=0
    )
    parts = client.chat.completions.create(
        model="a0",
        messages=[{"role": "user", "content": [{"type": "text", "text": "t5 t6"}]}],
        max_tokens=5,
        temperature=0,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("model", ["tiny-llama", "a0"])
def test_streaming_equals_non_streaming(client, model):
    kw = dict(model=model, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPT, **kw)
    chunks = list(
        client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    whole = client.chat.completions.create(messages=MESSAGES, **kw)
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert (
        chunks[-1].usage.completion_tokens == 10
        and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    )


def test_streaming_n_and_logprobs(client):
    kw = dict(
        model="a1",
        prompt=PROMPT,
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=6,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw)
    texts, toks = {0: "", 1: ""}, {0: [], 1: []}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
            toks[c.index] += c.logprobs.tokens
    for c in whole.choices:
        assert texts[c.index] == c.text and toks[c.index] == c.logprobs.tokens


def test_load_unload_round_trip(client, offline, files, server):
    import httpx

    h = {"Authorization": f"Bearer {client.api_key}"}
    url = server.url + "/v1"

    def use(name):
        return (
            client.completions.create(
                model=name, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    def want(path, lid):
        return (
            offline.generate(
                PROMPT,
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                lora_request=LoRARequest("x", lid, str(path)),
            )[0]
            .outputs[0]
            .text
        )

    r = httpx.post(
        url + "/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(files.root / "a2")}, headers=h
    )
    assert r.status_code == 200, r.text
    first_id = r.json()["lora_int_id"]
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a2"].parent == "tiny-llama"
    assert use("a2") == want(files.root / "a2", 10)
    # reloading the name with new weights (a relative path: under the root) gets a new id
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "a2", "lora_path": "a2b"}, headers=h)
    assert r.status_code == 200, r.text
    assert r.json()["lora_int_id"] > first_id
    assert use("a2") == want(files.root / "a2b", 11)
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "a2"}, headers=h)
    assert r.status_code == 200, r.text
    assert "a2" not in {m.id for m in client.models.list().data}
    r = httpx.post(url + "/completions", json={"model": "a2", "prompt": PROMPT}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "a2"}, headers=h)
    assert r.status_code == 404


def test_health_and_metrics(server, client):
    import httpx

    from loraserve.server.metrics import parse_metrics

    client.completions.create(model="a1", prompt=PROMPT, max_tokens=3, temperature=0)
    assert httpx.get(server.url + "/health").status_code == 200
    m = parse_metrics(httpx.get(server.url + "/metrics").text)
    assert m['loraserve_adapter_requests_total{model="a1"}'] >= 1
    assert m['loraserve_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m["loraserve_time_to_first_token_seconds_count"] >= 1
    assert m["loraserve_generation_tokens_total"] >= 3
    assert m["loraserve_kv_cache_blocks"] == 64
    assert 1 <= m["loraserve_lora_slots_used"] <= m["loraserve_lora_slots"] == 4


def test_unload_while_streaming_finishes_on_the_old_weights(client, offline, files, server):
    import httpx

    from loraserve.server.metrics import parse_metrics

    h = {"Authorization": f"Bearer {client.api_key}"}
    r = httpx.post(
        server.url + "/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": "a2"}, headers=h
    )
    assert r.status_code == 200, r.text
    want = (
        offline.generate(
            PROMPT,
            SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
            lora_request=LoRARequest("a2", 12, str(files.root / "a2")),
        )[0]
        .outputs[0]
        .text
    )
    stream = client.completions.create(
        model="tmp",
        prompt=PROMPT,
        max_tokens=100,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    running = parse_metrics(httpx.get(server.url + "/metrics").text)["loraserve_num_requests_running"]
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "tmp"}, headers=h)
    assert r.status_code == 200, r.text
    assert running == 1  # the unload came while the request was running
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    r = httpx.post(server.url + "/v1/completions", json={"model": "tmp", "prompt": PROMPT}, headers=h)
    assert r.status_code == 404


def test_docs_show_every_request_schema_with_resolvable_refs(server):
    """The routes parse their raw bodies themselves; /docs must still show what they take."""
    spec = server.app.openapi()
    schemas = spec["components"]["schemas"]
    for path, name in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
    ]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert "model" in schemas[name]["properties"] or name.startswith("Load")
    refs = {v for v in _walk(spec) if isinstance(v, str) and v.startswith("#/")}
    for ref in refs:
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def _walk(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)
    else:
        yield node
