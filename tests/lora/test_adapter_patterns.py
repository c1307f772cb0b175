"""rank_pattern / alpha_pattern keys: loraserve's linear-time matcher gives PEFT's answer
(``re.match(rf"(.*\\.)?({key})$", name)``) on every key Python's re finishes on, and finishes fast on keys
it does not."""

from __future__ import annotations

import re
import time

import pytest

from loraserve.lora.errors import LoRAUnsupportedFeatureError
from loraserve.lora.patterns import MAX_AUTOMATON_KEYS, PatternTable, dot_suffixes

NAMES = [
    f"model.layers.{i}.{m}"
    for i in (0, 1, 12, 31)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.experts.gate_up_proj",
    )
] + [
    "lm_head",
    "model.embed_tokens",
    "a",
    "",
    "q_proj\n",
    "model.layers.0.self_attn.q_proj\n",
    "ünï.cødé_proj",
]

KEYS = [
    "q_proj",
    "layers.0.self_attn.q_proj",  # its dots match any character
    r"layers\.\d+\.self_attn\.(q|k)_proj",
    r".*(q|v)_proj",
    r"(?s:.)*proj",
    r"layers\.1[0-9]?\..*",
    r"\bq_proj\b",
    r"\Bproj",
    r"mlp\.(gate|down)_proj$",
    r"[^.]+_proj",
    r"^model",
    r"(model\.)?layers\.0\..*",
    r"a)|(model",  # unbalanced alone; PEFT's wrapped form is a valid alternation
    r"q_proj\Z",
    r"(?:x|y)*",
    r"a{0,3}",
    r"[a-z_]{2,6}proj",
    r"p.*?j",
    r"\w+",
    r"\S+\s*",
    "",
    r"(a|ab)(c|bcd)(d*)",
    r"(q|k)_proj|lm_head",
    r"(a|b)+",
    r"\d{1,2}\.mlp\..*",
    r"[\w.]+_proj",
    r"(?=\w)q_proj",  # a lookahead without repetition: Python's re itself
    r"self_a(?P<t>t)(?P=t)n\.q_proj",  # a backreference without repetition: Python's re itself
]


@pytest.mark.parametrize("key", KEYS)
def test_lookup_equals_peft_regex(key):
    table = PatternTable({key: 1}, "rank_pattern", "test")
    for name in NAMES:
        want = re.match(rf"(.*\.)?({key})$", name) is not None
        assert (table.lookup(name) == 1) == want, (key, name)


def test_first_key_in_file_order_wins():
    table = PatternTable({r"layers\.0\..*": 4, "q_proj": 8, r".*": 16}, "rank_pattern", "test")
    assert table.lookup("model.layers.0.self_attn.q_proj") == 4
    assert table.lookup("model.layers.1.self_attn.q_proj") == 8
    assert table.lookup("model.layers.1.mlp.down_proj") == 16


def test_backtracking_keys_finish_in_linear_time():
    hostile = {
        r"(.+)+\.nomatch": 1,
        r"(a|a)*(a|a)*(a|a)*b": 2,
        r"(.*)*(.*)*(.*)*(.*)*zz": 3,
        r"(\w+\.?)+!": 4,
    }
    table = PatternTable(hostile, "rank_pattern", "test")
    names = [n + ".x" * 100 for n in NAMES]  # 200 more characters: 2^200 backtracking steps for re
    t0 = time.perf_counter()
    assert all(table.lookup(n) is None for n in names)
    assert time.perf_counter() - t0 < 5


def test_too_many_automaton_keys_are_refused():
    keys = {f"k{i}(a|b)*": 1 for i in range(MAX_AUTOMATON_KEYS + 1)}
    with pytest.raises(LoRAUnsupportedFeatureError, match="repetition or alternation"):
        PatternTable(keys, "alpha_pattern", "test")
    PatternTable(
        {f"k{i}": 1 for i in range(4 * MAX_AUTOMATON_KEYS)}, "alpha_pattern", "test"
    )  # plain keys: fine


def test_dot_suffixes_are_the_list_rule():
    names = ["model.layers.0.self_attn.q_proj", "lm_head", "a.b"]
    for name in names:
        for t in (
            "q_proj",
            "self_attn.q_proj",
            "0.self_attn.q_proj",
            "lm_head",
            "b",
            "a.b",
            "proj",
            "attn.q_proj",
        ):
            assert (t in dot_suffixes(name)) == (name == t or name.endswith("." + t)), (name, t)
