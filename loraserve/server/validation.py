"""Checks at the HTTP boundary: every one raises ``APIError`` (a 4xx) naming the field and the fix.

``parse_body`` turns a request body (already size-capped by ``middleware.Guard``) into its schema:
JSON only, every string valid Unicode, numbers finite. The rest check what the schema cannot:
token ids inside the vocabulary, the server's caps, adapter names and paths.
"""

from __future__ import annotations

import json
import re
from email.message import Message
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from loraserve.lora.errors import LoRAPathError
from loraserve.lora.files import confine
from loraserve.server.errors import APIError

M = TypeVar("M", bound=BaseModel)

# NOTE: fullmatch and ASCII: `$` would let a trailing newline through, and \w alone is any Unicode letter
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.:@+-][A-Za-z0-9_.:/@+-]{0,127}")
# a lone surrogate can only come from a \uD800-\uDFFF escape: bodies without one skip the walk
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _is_json(content_type: str | None) -> bool:
    """No header, application/json or application/*+json (FastAPI's rule: a form or text/plain POST,
    which a browser sends cross-site without asking, is never read as JSON)."""
    if not content_type:
        return True
    m = Message()
    m["content-type"] = content_type
    sub = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


def find_lone_surrogate(obj: Any) -> str | None:
    """The dotted path of a string (key or value) in parsed JSON that is not valid Unicode, if any."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:  # NOTE: iterative: JSON nests as deep as json.loads allows
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                key = k.encode("utf-8", "backslashreplace").decode("utf-8")  # the path goes into a message
                p = f"{path}.{key}" if path else key
                stack += [(k, p), (x, p)]
        elif isinstance(v, list):
            stack.extend((x, f"{path}.{i}") for i, x in enumerate(v) if not isinstance(x, (int, float)))
    return None


def parse_body(body: bytes, content_type: str | None, model: type[M]) -> M:
    """``body`` as a ``model``, or a 4xx: 415 for a non-JSON type, 400 naming the field otherwise."""
    if not _is_json(content_type):
        raise APIError(415, f"Content-Type {content_type!r} is not JSON; send application/json")
    try:
        # NOTE: strict UTF-8 first: json.loads(bytes) would take UTF-16 too, and decode encoded
        # surrogates (b"\xed\xa0\x80") into lone ones without any escape for the walk to find
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            400, f"the body is not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON"
        ) from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: it nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, an int of over 4300 digits
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text):
        where = find_lone_surrogate(obj)
        if where is not None:
            raise APIError(
                400,
                f"{where}: a string holds a lone surrogate (\\ud800-\\udfff); send valid UTF-8 text",
                where.split(".")[0],
            )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        msgs = [f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in errors[:5]]
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        raise APIError(400, "invalid request: " + "; ".join(msgs), param) from None


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """Every id in [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}); pass ids of this model",
            name.split("[")[0],
        )


def check_stop(stop: str | list[str] | None, max_count: int, max_length: int) -> None:
    """The server's caps on stop strings (``--max-stop-strings``, ``--max-stop-string-length``)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > max_count:
        raise APIError(
            400,
            f"stop has {len(stops)} strings; this server accepts at most {max_count} (--max-stop-strings)",
            "stop",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > max_length:
        raise APIError(
            400,
            f"a stop string has {longest} characters; this server accepts at most {max_length} "
            f"(--max-stop-string-length)",
            "stop",
        )


def check_adapter_name(name: str, base_name: str) -> None:
    if not ADAPTER_NAME.fullmatch(name):
        raise APIError(
            400,
            f"lora_name {name!r} is not a valid name: use 1-128 ASCII letters, digits and . _ - : / @ + "
            f"(not starting with /)",
            "lora_name",
        )
    if name == base_name:
        raise APIError(400, f"lora_name {name!r} is the base model's name; pick another", "lora_name")


def resolve_lora_path(given: str, root: Path) -> str:
    """The real path of ``given`` (relative = under ``root``) if it and every file in it lie under ``root``:
    the manager's own check (``lora.files.confine``), which it applies again on every re-read."""
    try:
        return str(confine(given, root))
    except LoRAPathError as e:
        raise APIError(400, str(e), "lora_path") from None
