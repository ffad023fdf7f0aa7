"""Redaction of logs copied into a run, of secret-valued args, and of a matrix's secrets."""

from __future__ import annotations

from pathlib import Path

from orchestrator.common.redact import REDACTED, redact_file, secret_args
from orchestrator.config.load import load_matrix
from orchestrator.execution.case_run import _set_aside
from orchestrator.execution.runner import _Log, matrix_secrets


def test_secret_args() -> None:
    argv = ["--api-key", "k1xx", "--hf-token=t1xx", "--port", "8000", "--auth-token"]
    assert secret_args(argv) == ("k1xx", "t1xx")  # a trailing flag without value gives none


def test_redact_file_keeps_lines_bytes_and_mode(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    raw = (
        b"line 1 token=s3cr3tvalue here\n"
        b"\xff\xfe not utf-8 survives\n"
        b"Authorization: Bearer abc.def\n"
        b"last line without newline s3cr3tvalue"
    )
    log.write_bytes(raw)
    log.chmod(0o640)
    assert redact_file(log, ("s3cr3tvalue",))
    out = log.read_bytes()
    assert b"s3cr3tvalue" not in out and b"abc.def" not in out
    assert out.count(b"\n") == raw.count(b"\n")  # the audit's line numbers stay valid
    assert b"\xff\xfe not utf-8 survives\n" in out
    assert out.startswith(f"line 1 token={REDACTED} here\n".encode())
    assert oct(log.stat().st_mode & 0o777) == oct(0o640)
    assert [p.name for p in tmp_path.iterdir()] == ["server.log"]  # no temp file left


def test_redact_file_leaves_a_clean_file_alone(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("nothing to hide\n")
    inode = log.stat().st_ino
    assert not redact_file(log, ("s3cr3tvalue",))
    assert log.stat().st_ino == inode


def test_matrix_secrets_come_from_every_env_and_args_block(tmp_path: Path) -> None:
    m = tmp_path / "m.yaml"
    m.write_text(
        "name: m\n"
        "models: [{label: x, path: /p, num_heads: 8, env: {HF_TOKEN: modeltok}}]\n"
        "engine: {args: [--api-key, engkey1], env: {PLAIN: notsecret}}\n"
        "topologies: [{tp: 1, args: ['--hf-token=topotok']}]\n"
        "workloads: [{name: w, prompt_tokens: 1, output_tokens: 1}]\n"
        "variants: [{name: v, env: {VLLM_API_KEY: varkey1}}]\n"
    )
    found = matrix_secrets(load_matrix(m), environ={"MY_PASSWORD": "envpass", "HOME": "/root"})
    assert set(found) == {"envpass", "modeltok", "engkey1", "topotok", "varkey1"}


def test_driver_log_is_redacted(tmp_path: Path) -> None:
    log = _Log(tmp_path / "orchestrator.log", echo=False, secrets=("engkey1",))
    log("case x: FAILED: server said engkey1 and --api-key other1")
    text = (tmp_path / "orchestrator.log").read_text()
    assert "engkey1" not in text and "other1" not in text and text.count(REDACTED) == 2


def test_set_aside_moves_and_redacts_an_earlier_attempts_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert _set_aside(log, ("engkey1",)) is None
    log.write_text("attempt 1 engkey1\n")
    (tmp_path / "server-attempt1.log").write_text("older\n")
    moved = _set_aside(log, ("engkey1",))
    assert moved == tmp_path / "server-attempt2.log"
    assert not log.exists()
    assert moved.read_text() == f"attempt 1 {REDACTED}\n"


def test_token_counts_and_tokenizer_are_not_secrets() -> None:
    # Every results row once lost its token counts to "***": names are secret by TOKEN not
    # followed by a letter, so counts (tokens) and paths (tokenizer) stay.
    from orchestrator.common.redact import is_secret_name, redact, redact_argv, redact_text

    for name in ("prompt_tokens", "output_tokens", "max_tokens", "requested_output_tokens",
                 "--max-tokens", "tokenizer", "--tokenizer", "aggregate_tok_s"):  # fmt: skip
        assert not is_secret_name(name), name
    for name in ("HF_TOKEN", "hf-token", "token", "--hf-token", "HF_TOKEN_PATH", "auth_token",
                 "OPENAI_API_KEY", "--api-key", "DB_PASSWORD"):  # fmt: skip
        assert is_secret_name(name), name
    row = {"params": {"prompt_tokens": 16, "output_tokens": 32}, "env": {"HF_TOKEN": "hf_x"}}
    assert redact(row) == {"params": {"prompt_tokens": 16, "output_tokens": 32},
                           "env": {"HF_TOKEN": REDACTED}}  # fmt: skip
    assert redact_text("--max-tokens 32 --tokenizer /m --hf-token abcd") == (
        f"--max-tokens 32 --tokenizer /m --hf-token {REDACTED}"
    )
    assert redact_argv(["--max-tokens", "32", "--hf-token", "abcd"]) == [
        "--max-tokens", "32", "--hf-token", REDACTED,
    ]  # fmt: skip
