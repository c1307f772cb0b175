"""Reading an adapter's files: confined, size-capped, cancellable, and fingerprinted.

Every read of an adapter dir, the first and each one after a host-cache eviction, goes through
``read_adapter_files``:

- with a root (the server's ``--lora-root``, carried by ``LoRARequest.lora_root``), the dir and each
  file it reads must resolve under it, symlinks followed (``confine``, which the server's runtime-load
  check uses too);
- each file is opened at its resolved path with O_NOFOLLOW and must be a regular file (a FIFO or a
  device would block or never end), its size checked before reading (``adapter_config.json`` at most
  ``MAX_CONFIG_BYTES``, the weights at most the caller's cap) and read in chunks that check ``cancel``;
- the bytes read are hashed (sha256) and parsed from memory, so what was hashed is what is served.
  ``AdapterFiles`` records the real paths and digests; a re-read given ``expect`` must find the same
  real paths and the same digests, or raises ``LoRAChangedError``: an adapter id is one set of weights.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from loraserve.lora.errors import (
    LoRAAdapterNotFoundError,
    LoRAChangedError,
    LoRAFormatError,
    LoRALoadCancelledError,
    LoRAPathError,
)

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # PEFT's configs are a few KiB; 1 MiB leaves room for long pattern dicts
_CHUNK = 8 << 20


@dataclass(frozen=True)
class AdapterFiles:
    """What one read of an adapter dir saw: the dir's real path and, per file read, (real path, sha256)."""

    real_dir: str
    files: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        """One sha256 over the files' digests: the adapter's content identity."""
        return hashlib.sha256("".join(d for _, d in self.files).encode()).hexdigest()


def check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise LoRALoadCancelledError(f"{where}: loading was cancelled (the server is shutting down)")


def _expand(given: str | Path) -> Path:
    try:
        return Path(given).expanduser()
    except RuntimeError as e:  # "~unknownuser/..."
        raise LoRAPathError(
            f"lora_path {str(given)!r} does not exist: its ~user is unknown ({e}); pass an absolute path "
            "or one relative to --lora-root"
        ) from None


def confine(given: str | Path, root: str | Path) -> Path:
    """The real path of the adapter dir ``given`` (relative = under ``root``), if it and every entry in it
    resolve under ``root`` (symlinks followed); else LoRAPathError saying why. The server's runtime-load
    check, and the manager's on every read of an adapter that carries a root."""
    if "\x00" in str(given):
        raise LoRAPathError(f"lora_path {str(given)!r} contains a NUL byte; pass a directory path")
    root_real = _expand(root).resolve()
    p = _expand(given)
    if not p.is_absolute():
        p = root_real / p
    try:
        real = p.resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, or a link loop
        raise LoRAPathError(f"lora_path {str(given)!r} does not exist") from None
    if not real.is_relative_to(root_real):
        raise LoRAPathError(
            f"lora_path {str(given)!r} resolves outside --lora-root {root_real}; adapters must live "
            f"under it (symlinks are followed)"
        )
    try:
        if not real.is_dir():
            raise LoRAPathError(f"lora_path {str(given)!r} is not a directory; pass a PEFT adapter dir")
        for f in real.iterdir():
            if not f.resolve().is_relative_to(root_real):
                raise LoRAPathError(
                    f"lora_path {str(given)!r}: {f.name} links outside --lora-root {root_real}"
                )
    except (OSError, RuntimeError) as e:  # RuntimeError: a link loop inside
        raise LoRAPathError(
            f"lora_path {str(given)!r} cannot be read: {getattr(e, 'strerror', None) or e}"
        ) from None
    return real


def _opened_path(fd: int) -> str | None:
    """The path the kernel opened for ``fd`` (Linux /proc), None where it cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _read_file(
    path: Path,
    cap: int,
    root: Path | None,
    expect_real: str | None,
    cancel: threading.Event | None,
    where: str,
) -> tuple[bytes, str, str]:
    """(bytes, real path, sha256) of one file of an adapter dir, read as the module docstring says."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise LoRAFormatError(f"{where}: cannot open {path.name} ({e})") from None
    if root is not None and not real.is_relative_to(root):
        raise LoRAPathError(f"{where}: {path.name} links outside --lora-root {root}")
    if expect_real is not None and str(real) != expect_real:
        raise LoRAChangedError(
            f"{where}: {path.name} now resolves to {real}, but the adapter was registered from {expect_real}"
        )
    try:
        # NOTE: O_NOFOLLOW: a link put in place after the check above fails to open instead of being read;
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused just below)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise LoRAPathError(f"{where}: cannot open {path.name} ({e.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as fh:
        opened = _opened_path(fd)
        if opened is not None and opened != str(real):  # a dir on the way was swapped after resolve()
            raise LoRAPathError(f"{where}: {path.name} moved while being opened")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoRAPathError(f"{where}: {path.name} is not a regular file")
        if st.st_size > cap:
            raise LoRAFormatError(
                f"{where}: {path.name} is {st.st_size} bytes, more than the {cap} loraserve reads; "
                f"{'re-save the config with PEFT' if path.name == CONFIG_NAME else 'raise max_adapter_bytes'}"
            )
        h, chunks, n = hashlib.sha256(), [], 0
        while True:
            check_cancel(cancel, where)
            chunk = fh.read(min(_CHUNK, cap + 1 - n))
            if not chunk:
                break
            n += len(chunk)
            if n > cap:  # it grew while being read
                raise LoRAFormatError(f"{where}: {path.name} grew past {cap} bytes while being read")
            h.update(chunk)
            chunks.append(chunk)
    return b"".join(chunks), str(real), h.hexdigest()


def read_adapter_files(
    path: str | Path,
    *,
    root: str | Path | None = None,
    expect: AdapterFiles | None = None,
    max_weights_bytes: int,
    cancel: threading.Event | None = None,
) -> tuple[bytes, bytes, str, AdapterFiles]:
    """(config bytes, weights bytes, weights file name, what was read) of the adapter dir ``path``.

    ``root``: the dir and the files must resolve under it. ``expect``: what the registration read; the
    same real paths and digests are required (LoRAChangedError otherwise). Raises a LoRAError subclass
    naming the adapter dir and the file."""
    given = _expand(path)
    if root is not None:
        real_dir = confine(given, root)
        root_real = _expand(root).resolve()
    else:
        try:
            real_dir = given.resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            raise LoRAAdapterNotFoundError(
                f"adapter dir {path} does not exist; check the lora_path"
            ) from None
        root_real = None
    where = f"adapter {path}"
    if expect is not None and str(real_dir) != expect.real_dir:
        raise LoRAChangedError(
            f"{where}: the dir now resolves to {real_dir}, but the adapter was registered from {expect.real_dir}"
        )
    if not (real_dir / CONFIG_NAME).exists():
        raise LoRAFormatError(
            f"{where}: {CONFIG_NAME} is missing; save the adapter with PEFT's save_pretrained"
        )
    weights_name = SAFETENSORS_NAME if (real_dir / SAFETENSORS_NAME).exists() else BIN_NAME
    if not (real_dir / weights_name).exists():
        raise LoRAFormatError(f"{where}: neither {SAFETENSORS_NAME} nor {BIN_NAME} exists")
    want = [real for real, _ in expect.files] if expect is not None else [None, None]
    out = []
    for i, name in enumerate((CONFIG_NAME, weights_name)):
        cap = MAX_CONFIG_BYTES if name == CONFIG_NAME else max_weights_bytes
        out.append(_read_file(real_dir / name, cap, root_real, want[i], cancel, where))
    read = AdapterFiles(str(real_dir), tuple((real, digest) for _, real, digest in out))
    if expect is not None:
        for (real, digest), (_, old) in zip(read.files, expect.files):
            if digest != old:
                raise LoRAChangedError(
                    f"{where}: {Path(real).name} changed on disk since the adapter was registered (sha256 "
                    f"{digest[:12]}..., registered {old[:12]}...); an adapter id is one set of weights: "
                    f"restore the file, or load the new weights as a new adapter"
                )
    return out[0][0], out[1][0], weights_name, read
