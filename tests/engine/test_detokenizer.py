"""Incremental detokenization and stop strings, with a byte-level BPE tokenizer built here.

A small vocabulary splits accented letters, CJK and emoji over several byte tokens, so single
tokens decode to incomplete characters; fed one token at a time, the streamed pieces must add up
to what the tokenizer decodes from the whole output, and no piece may hold a broken character.
"""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from loraserve.engine.detokenizer import detokenize_incrementally, fast_decoder, find_stop_string
from loraserve.engine.sequence import Sequence

TEXTS = [
    "naïve café, déjà vu — über straße",
    "你好，世界！这是一个测试。",
    "emoji 🙂🚀👩‍💻 and flags 🇫🇷 mixed with ascii",
    "plain ascii words only, nothing special here",
    "  leading spaces\nand\ttabs\n\nnewlines ",
]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 5, "ascii words only"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def make_seq(prompt: list[int], **kw) -> Sequence:
    return Sequence(0, "r", 0, list(prompt), SamplingParams(**kw))


def stream(tok, prompt: list[int], out: list[int], **kw) -> tuple[Sequence, list[str]]:
    seq = make_seq(prompt, **kw)
    pieces = []
    decode = fast_decoder(tok)
    for t in out:
        seq.output_token_ids.append(t)
        pieces.append(detokenize_incrementally(decode, seq))
    return seq, pieces


def test_tokenizer_really_splits_characters(tok):
    broken = [t for t in tok.encode("🙂你ï") if "\ufffd" in tok.decode([t])]
    assert broken, "the test tokenizer should split multi-byte characters"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "Q: ", "prompt with ü and 🚀 "])
def test_streamed_pieces_add_up_to_the_decoded_output(tok, text, prompt_text):
    prompt = tok.encode(prompt_text) or tok.encode(" ")
    out = tok.encode(text)
    seq, pieces = stream(tok, prompt, out)
    assert "".join(pieces) == seq.text == tok.decode(out)
    assert all("\ufffd" not in p for p in pieces)


def test_incomplete_character_is_held_back(tok):
    out = tok.encode("🙂")
    assert len(out) > 1
    seq, pieces = stream(tok, tok.encode("x"), out)
    assert pieces[:-1] == [""] * (len(out) - 1) and pieces[-1] == "🙂"


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.convert_tokens_to_ids("<eos>")
    out = tok.encode("hi there") + [eos]
    seq, _ = stream(tok, tok.encode("x"), out)
    assert seq.text == "hi there"
    seq, _ = stream(tok, tok.encode("x"), out, skip_special_tokens=False)
    assert seq.text == "hi there<eos>"


def with_text(text_before: str, new: str, **kw) -> Sequence:
    seq = make_seq([1], **kw)
    seq.text = text_before + new
    return seq


def test_find_stop_string_in_new_text_and_across_pieces():
    seq = with_text("hello wor", "ld, and more", stop=["world"])
    assert find_stop_string(seq, len("ld, and more")) == "world"
    assert seq.text == "hello "
    seq = with_text("hello wor", "ld, and more", stop="world", include_stop_str_in_output=True)
    assert find_stop_string(seq, len("ld, and more")) == "world"
    assert seq.text == "hello world"


def test_find_stop_string_first_occurrence_and_no_match():
    seq = with_text("a", "bXcXd", stop=["X"])
    assert find_stop_string(seq, 5) == "X"
    assert seq.text == "ab"  # cut at the first occurrence
    seq = with_text("abc", "def", stop=["zzz", "cdx"])
    assert find_stop_string(seq, 3) is None and seq.text == "abcdef"


@pytest.mark.parametrize("clean_up", [False, True])
def test_fast_decoder_equals_tokenizer_decode(tok, clean_up):
    """The backend shortcut (clean-up off) and the fallback (clean-up on) both return decode()'s text."""
    import random

    from loraserve.engine.detokenizer import _plain_fast_tokenizer

    assert _plain_fast_tokenizer(tok)  # the shortcut applies to this tokenizer when clean-up is off
    tok.clean_up_tokenization_spaces = clean_up
    try:
        decode = fast_decoder(tok)
        rng = random.Random(0)
        eos = tok.convert_tokens_to_ids("<eos>")
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))] + [eos] * rng.randrange(2)
            rng.shuffle(ids)
            for skip in (False, True):
                assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), ids
    finally:
        tok.clean_up_tokenization_spaces = False


def test_token_slice_equals_slicing_the_whole_list():
    seq = make_seq([1, 2, 3, 4])
    seq.output_token_ids.extend([5, 6, 7])
    whole = seq.token_ids
    for start in range(len(whole) + 1):
        assert seq.token_slice(start) == whole[start:]
        for end in range(start, len(whole) + 1):
            assert seq.token_slice(start, end) == whole[start:end], (start, end)
