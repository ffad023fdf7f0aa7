"""Secret redaction: tokens, keys and passwords never reach a manifest, a result row, a copied
log, a report or `orchestrator audit`'s output.

One policy, in three shapes (each form is a row of tests/orchestrator/security/test_sec_redaction.py):

- names whose values are secrets (env variables, dict keys, options, ``key=value`` in text):
  ``*TOKEN`` (not ``*TOKENS``, ``*TOKENIZER``: counts and paths), ``*API_KEY``, ``*SECRET*``,
  ``*PASSWORD``/``PASSWD``, ``*CREDENTIAL*``, ``*AUTH*``, and anything ending in ``KEY`` or
  ``KEY_ID`` after a prefix (``S3_KEY``, ``PRIVATE_KEY``, ``AWS_ACCESS_KEY_ID``);
- argv: the value of a secret-named option, every value up to the next option (vLLM's
  ``--api-key`` takes several), its abbreviations (``--api-k``) included;
- free text: the password (and user) in ``scheme://user:pw@host`` for any scheme, empty user
  included (``redis://:pw@host``); ``Authorization: <scheme> <credentials>``; ``Bearer X``;
  ``--api-key K1 K2``; ``NAME=value`` / ``'name': value`` for a secret name (a quoted string,
  a bracketed list, or one word); Hugging Face (``hf_…``) and OpenAI (``sk-…``) tokens; and
  every value known to be secret (the run's env and args), wherever it appears.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestrator.common import safe_io

REDACTED = "***"
# Names whose values are secrets. "TOKEN" not followed by a letter: prompt_tokens /
# output_tokens / --max-tokens are counts and --tokenizer a path, and redacting them emptied
# every results row of its token counts. A name ending in KEY (or KEY_ID) needs something
# before it: a bare "key" is the GPU-state finding's nvidia-smi field, not a credential.
_SECRET_NAME = re.compile(
    r"TOKEN(?![A-Z])|API[_-]?KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH"
    r"|PRIVATE[_-]?KEY|ACCESS[_-]?KEY|(?<=[A-Z0-9])[_-]?KEY(?:[_-]?ID)?$",
    re.I,
)
# vLLM's secret-valued flags; argparse takes any unambiguous prefix of them.
_SECRET_FLAGS = ("--api-key", "--hf-token")
_MIN_SECRET_PREFIX = len("--api-k")
# A file name in a log header ("[authenticate.py:52]") is no key=value pair.
_SOURCE_FILE = re.compile(r"\.(py|pyx|c|cc|cpp|cu|h|hpp)$")
# A cheap test before the patterns: most log lines hold none of these and skip them all.
_HINT = re.compile(r"token|key|secret|passw|credential|auth|bearer|://|hf_|sk-", re.I)
# user:password@ (or user@, or :password@) after any scheme; the password may hold '@'.
_URL_CREDS = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?:[^\s/?#@:]*:[^\s/?#]*|[^\s/?#@:]+)@", re.I
)
# Authorization / Proxy-Authorization headers, plain or quoted (JSON, a repr).
_AUTHORIZATION = re.compile(
    r"(?P<head>authorization[\"']?\s*[:=]\s*[\"']?)"
    r"(?:(?P<scheme>basic|bearer|digest|token|negotiate|apikey)\s+)?(?P<cred>[^\s\"',;}]+)",
    re.I,
)
_HEADER = re.compile(r"(proxy-)?authorization", re.I)
_KEY_VALUE = re.compile(
    # Only names holding a secret word: a match consumes its value, and a plain name's
    # value may hold the next pair ("args: {'api_key': ...").
    r"(?P<key>\b[A-Za-z0-9_.-]*(?:token|key|secret|passw|credential|auth)[A-Za-z0-9_.-]*)"
    r"(?P<sep>[\"']?\s*[:=]\s*)"
    r"(?P<value>'[^'\n]*'|\"[^\"\n]*\"|\[[^\]\n]*\]|[^\s\"',;)}\]]+)",
    re.I,
)
# --api-key K1 K2 ... (every value up to the next option), abbreviations included.
_API_KEY_VALUES = re.compile(
    r"(--api(?:[-_]k(?:ey?)?)?[= ])([^\s\"',;)}\]]+(?:[ \t]+(?!-)[^\s\"',;)}\]]+)*)", re.I
)
_LINE_PIECE = 16 << 20
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


def _is_secret_option(name: str) -> bool:
    """A secret-named option, or an abbreviation vLLM's parser reads as one."""
    name = name.replace("_", "-")
    if is_secret_name(name):
        return True
    return len(name) >= _MIN_SECRET_PREFIX and any(f.startswith(name) for f in _SECRET_FLAGS)


def _key_value(m: re.Match[str]) -> str:
    key = m.group("key")
    # An Authorization header's value is its scheme, kept (_AUTHORIZATION took the rest).
    if not is_secret_name(key) or _SOURCE_FILE.search(key) or _HEADER.fullmatch(key):
        return m.group(0)
    return f"{key}{m.group('sep')}{REDACTED}"


def _authorization(m: re.Match[str]) -> str:
    scheme = f"{m.group('scheme')} " if m.group("scheme") else ""
    return f"{m.group('head')}{scheme}{REDACTED}"


def redact_text(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Redact every free-text form of the policy (module docstring) and known secret values."""
    for value in secrets:
        if value and len(value) >= 4:
            text = text.replace(value, REDACTED)
    if not _HINT.search(text):
        return text
    text = _URL_CREDS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _AUTHORIZATION.sub(_authorization, text)
    text = _API_KEY_VALUES.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    text = _KEY_VALUE.sub(_key_value, text)
    for pat in _INLINE:
        text = pat.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    return text


def _secret_options(argv: Iterable[str]) -> Iterator[tuple[str, str | None]]:
    """Each argument with the secret it carries: every value of a secret-named option up to
    the next option (`--api-key K1 K2`: K1 and K2 carry themselves), or its inline value
    (`--hf-token=X`)."""
    taking = False
    for arg in argv:
        if taking and not arg.startswith("-"):
            yield arg, arg
            continue
        taking = False
        if arg.startswith("-") and _is_secret_option(arg.split("=", 1)[0]):
            taking = "=" not in arg
            yield arg, (arg.split("=", 1)[1] if "=" in arg else None)
        else:
            yield arg, None


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """Redact the values following a secret-named option (`--api-key K1 K2`) and `--x-token=X`."""
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
    """Values given to secret-named options (`--api-key K1 K2`, `--hf-token=X`)."""
    return tuple(secret for _, secret in _secret_options(argv) if secret)


def redact_file(path: Path, secrets: tuple[str, ...] = ()) -> bool:
    """Redact a log in place, line by line (logs can be large), replacing it atomically.

    Lines keep their count and order, so line numbers recorded before (the audit's
    stop line) stay valid. Bytes that are not UTF-8 survive unchanged. Returns whether
    anything was redacted; an unchanged file is left untouched. A link in the log's place
    is refused (safe_io.UnsafeFileError): it would be read, and replaced by a copy.
    """
    path = Path(path)
    safe_io.check_not_linked(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    changed = False
    try:
        with safe_io.open_regular(path) as src, os.fdopen(fd, "wb") as dst:
            # Pieces of at most 16 MiB: a server that printed a line without end cannot
            # make the redaction hold it whole.
            for raw in iter(lambda: src.readline(_LINE_PIECE), b""):
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
