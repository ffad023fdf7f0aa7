"""Secret redaction: tokens and API keys never reach a manifest, a copied log or a report."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

REDACTED = "***"
# Environment or option names whose values are secrets (HF_TOKEN, OPENAI_API_KEY, --api-key, ...).
# "TOKEN" not followed by a letter: prompt_tokens / output_tokens / --max-tokens are counts and
# --tokenizer a path, and redacting them emptied every results row of its token counts.
_SECRET_NAME = re.compile(
    r"(TOKEN(?![A-Z])|API[_-]?KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.I
)
# user:password@ inside URLs.
_URL_CREDS = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<creds>[^/@\s:]+(?::[^/@\s]*)?)@", re.I
)
# --api-key VALUE / --api-key=VALUE / Bearer VALUE / hf_xxx tokens in free text.
_INLINE = [
    re.compile(
        r"(--[A-Za-z0-9-]*(?:token(?![A-Za-z])|api-key|secret|password)[A-Za-z0-9-]*[= ])(\S+)",
        re.I,
    ),
    re.compile(r"(Bearer\s+)(\S+)", re.I),
    re.compile(r"()(hf_[A-Za-z0-9]{20,})"),
    re.compile(r"()(sk-[A-Za-z0-9_-]{20,})"),
]


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_text(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Redact credentials in URLs, inline option values, bearer tokens and known secret values."""
    for value in secrets:
        if value and len(value) >= 4:
            text = text.replace(value, REDACTED)
    text = _URL_CREDS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    for pat in _INLINE:
        text = pat.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    return text


def _secret_options(argv: Iterable[str]) -> Iterator[tuple[str, str | None]]:
    """Each argument with the secret it carries: the value of a secret-named option, whether
    given as the next argument (`--api-key X`: X carries X) or inline (`--hf-token=X`)."""
    take_next = False
    for arg in argv:
        if take_next:
            take_next = False
            yield arg, arg
        elif arg.startswith("-") and is_secret_name(arg.split("=", 1)[0]):
            take_next = "=" not in arg
            yield arg, (arg.split("=", 1)[1] if "=" in arg else None)
        else:
            yield arg, None


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """Redact the value following a secret-named option (`--api-key X`) and `--x-token=X`."""
    out: list[str] = []
    for arg, secret in _secret_options(argv):
        if secret is None:
            out.append(redact_text(arg))
        elif secret == arg:
            out.append(REDACTED)
        else:
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
    return out


def redact(obj: Any, secrets: tuple[str, ...] = ()) -> Any:
    """Deep-redact a JSON-like object: secret-named keys lose their values, strings are scrubbed."""
    if isinstance(obj, Mapping):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and is_secret_name(k) and v not in (None, "")
                else redact(v, secrets)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        items = [redact(v, secrets) for v in obj]
        if all(isinstance(v, str) for v in obj):
            items = redact_argv([str(v) for v in items])
        return items
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    return obj


def secret_values(env: Mapping[str, str]) -> tuple[str, ...]:
    """Values of secret-named variables, to scrub wherever they appear verbatim."""
    return tuple(v for k, v in env.items() if is_secret_name(k) and v)


def secret_args(argv: Iterable[str]) -> tuple[str, ...]:
    """Values given to secret-named options (`--api-key X`, `--hf-token=X`)."""
    return tuple(secret for _, secret in _secret_options(argv) if secret)


def redact_file(path: Path, secrets: tuple[str, ...] = ()) -> bool:
    """Redact a log in place, line by line (logs can be large), replacing it atomically.

    Lines keep their count and order, so line numbers recorded before (the audit's
    stop line) stay valid. Bytes that are not UTF-8 survive unchanged. Returns whether
    anything was redacted; an unchanged file is left untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    changed = False
    try:
        with path.open("rb") as src, os.fdopen(fd, "wb") as dst:
            for raw in src:
                line = raw.decode("utf-8", errors="surrogateescape")
                clean = redact_text(line, secrets)
                changed |= clean != line
                dst.write(clean.encode("utf-8", errors="surrogateescape"))
            dst.flush()
            os.fsync(dst.fileno())
        if changed:
            os.chmod(tmp, path.stat().st_mode & 0o7777)  # mkstemp made it 0600
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return changed
