"""One redaction policy for every secret form a run can meet, applied to everything a run
writes and everything `orchestrator audit` prints. The table is the policy's checklist:
each form, as free text (a log line), and where it has one, as argv and as an env block."""

from __future__ import annotations

import json

import pytest
from security_helpers import run_cli

from orchestrator.common.redact import (
    REDACTED,
    redact,
    redact_argv,
    redact_file,
    redact_text,
    secret_args,
    secret_values,
)

# (form, free text holding it, the secret parts that must go, text that must stay)
FORMS = [
    ("every --api-key value", "vllm serve /m --api-key K1secret K2secret --port 8000",
     ["K1secret", "K2secret"], ["--port 8000"]),
    ("--api-key=", "--api-key=K1secret", ["K1secret"], []),
    ("vLLM's non-default args", "non-default args: {'api_key': ['K1secret', 'K2secret'], 'port': 1}",
     ["K1secret", "K2secret"], ["'port': 1"]),
    ("Namespace repr", "Namespace(api_key=['K1secret', 'K2secret'], port=8000)",
     ["K1secret", "K2secret"], ["port=8000"]),
    ("*_KEY env", "S3_KEY=s3secretvalue", ["s3secretvalue"], ["S3_KEY="]),
    ("PRIVATE_KEY env", "export PRIVATE_KEY='pkSecretValue'", ["pkSecretValue"], []),
    ("*KEY_ID env", "AWS_ACCESS_KEY_ID=AKIAEXAMPLE123 AWS_SECRET_ACCESS_KEY=wJalrSecret",
     ["AKIAEXAMPLE123", "wJalrSecret"], []),
    ("redis://:pw@host", "cache at redis://:redisPassw0rd@cache:6379/0",
     ["redisPassw0rd"], ["@cache:6379/0"]),
    ("scheme://user:pw@host", "postgresql://admin:pgPassw0rd@db/x and amqp://u:mqPassw0rd@mq",
     ["pgPassw0rd", "mqPassw0rd"], ["@db/x"]),
    ("scheme+ext://", "mongodb+srv://user:mgPassw0rd@cluster0", ["mgPassw0rd"], ["@cluster0"]),
    ("Authorization: Basic", "Authorization: Basic dXNlcjpwYXNzd29yZA==",
     ["dXNlcjpwYXNzd29yZA=="], ["Authorization:"]),
    ("Authorization in JSON", '{"authorization": "Basic dXNlcjpwYXNzd29yZA=="}',
     ["dXNlcjpwYXNzd29yZA=="], []),
    ("Authorization: Bearer", "authorization: bearer eyJhbGciOiJIUzI1NiJ9.x.y",
     ["eyJhbGciOiJIUzI1NiJ9"], []),
    ("Bearer alone", "sent Bearer tok_abcdef123456", ["tok_abcdef123456"], []),
    ("HF token", "token hf_abcdefghijklmnopqrstuvwx in use", ["hf_abcdefghijklmnopqrstuvwx"], []),
    ("OpenAI key", "key sk-abcdefghijklmnopqrstuvwx", ["sk-abcdefghijklmnopqrstuvwx"], []),
    ("--hf-token", "--hf-token hftokenvalue1", ["hftokenvalue1"], []),
    ("HF_TOKEN env", "HF_TOKEN=hftokenvalue2", ["hftokenvalue2"], []),
]  # fmt: skip

NOT_SECRETS = [
    "prompt_tokens=128 output_tokens=16 --max-tokens 8",
    "--tokenizer /models/tok --ssl-keyfile /etc/key.pem",
    "http://127.0.0.1:8000/v1/models",
    "Basic usage: see README",
]


@pytest.mark.parametrize("form,text,secrets,kept", FORMS, ids=[f[0] for f in FORMS])
def test_free_text(form, text, secrets, kept):
    out = redact_text(text)
    for s in secrets:
        assert s not in out, (form, out)
    for k in kept:
        assert k in out, (form, out)
    assert REDACTED in out


@pytest.mark.parametrize("text", NOT_SECRETS)
def test_what_is_not_a_secret_stays(text):
    assert redact_text(text) == text


def test_every_value_of_a_multi_valued_api_key_in_argv():
    argv = ["vllm", "serve", "/m", "--api-key", "K1secret", "K2secret", "--port", "8000"]
    assert redact_argv(argv) == ["vllm", "serve", "/m", "--api-key", REDACTED, REDACTED,
                                 "--port", "8000"]  # fmt: skip
    assert secret_args(argv) == ("K1secret", "K2secret")


@pytest.mark.parametrize(
    "name", ["S3_KEY", "PRIVATE_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SSH_KEY_ID"]
)
def test_key_named_env_variables(name):
    env = {name: "valueSecret1", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert redact({"env": env})["env"] == {**env, name: REDACTED}
    assert secret_values(env) == ("valueSecret1",)


def test_key_fields_that_are_not_secrets_stay():
    # The GPU-state finding's fields: a "key" is the nvidia-smi key, not a credential.
    fields = {"gpu": "0000:1b:00.0", "key": "ECC/Volatile/DRAM Uncorrectable", "value": "3"}
    assert redact({"fields": fields})["fields"] == fields


def test_redact_file_catches_every_form(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(text + "\n" for _, text, _, _ in FORMS))
    redact_file(log)
    out = log.read_text()
    for form, _, secrets, _ in FORMS:
        for s in secrets:
            assert s not in out, form
    assert out.count("\n") == len(FORMS)


def test_orchestrator_audit_prints_no_secret(tmp_path):
    """At e3a37d8, keys, Bearer tokens and URL passwords around a fault line were printed
    by `orchestrator audit` as they were."""
    log = tmp_path / "server.log"
    log.write_text(
        "INFO connecting to redis://:redisPassw0rd@cache:6379/0\n"
        "INFO headers Authorization: Basic dXNlcjpwYXNzd29yZA==\n"
        "ERROR CUDA error: an illegal memory access was encountered (key sk-abcdefghijklmnopqrstuvwx)\n"
        "INFO retry with Bearer tok_abcdef123456 and --api-key K1secret K2secret\n"
        "INFO S3_KEY=s3secretvalue\n"
    )
    secrets = ["redisPassw0rd", "dXNlcjpwYXNzd29yZA==", "sk-abcdefghijklmnopqrstuvwx",
               "tok_abcdef123456", "K1secret", "K2secret", "s3secretvalue"]  # fmt: skip
    text = run_cli("audit", str(log))
    as_json = run_cli("audit", str(log), "--json")
    assert text.returncode == 1 and as_json.returncode == 1, text.stderr
    assert "illegal" in text.stdout and json.loads(as_json.stdout)["findings"]
    for s in secrets:
        assert s not in text.stdout + text.stderr, s
        assert s not in as_json.stdout, s
