"""Incremental detokenization (vLLM's prefix/read offsets) and stop-string checks."""

from __future__ import annotations

from loraserve.engine.sequence import Sequence


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append the newly decodable text of seq to seq.text and return it ('' while a char is incomplete)."""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += new
        return new
    return ""


def find_stop_string(seq: Sequence, new_text_len: int) -> str | None:
    """If a stop string appeared in the new text, truncate seq.text and return the stop string."""
    for stop in seq.params.stop_list:
        # only the tail can hold a new match
        window = max(len(seq.text) - new_text_len - len(stop) + 1, 0)
        idx = seq.text.find(stop, window)
        if idx != -1:
            end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
            seq.text = seq.text[:end]
            return stop
    return None
