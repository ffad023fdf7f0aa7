"""What the audit reads (orchestrator.audit.sources): log files (rotated, gzip, truncated,
missing), the kernel log since a time, and nvidia-smi's GPU state."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from audit_cases import FIXTURES, REPO, FakeRunner, run_audit, signature_ids

from orchestrator import audit
from orchestrator.audit import AuditInputError, parse_since, read_gpu_state, read_kernel_log
from orchestrator.audit.sources import _filter_since


def test_gzip_and_rotated_logs_in_a_directory(tmp_path):
    d = tmp_path / "case"
    d.mkdir()
    line = b"RuntimeError: CUDA error: misaligned address\n"
    (d / "server.log").write_bytes(b"INFO ok\n")
    (d / "server.log.1").write_bytes(b"INFO a\n" + line)
    with gzip.open(d / "server.log.2.gz", "wb") as fh:
        fh.write(b"INFO b\nINFO c\n" + line)
    (d / "results.json").write_bytes(line)  # not a log: never walked
    result = run_audit(d)
    names = [Path(f.path).name for f in result.searched.files]
    assert names == ["server.log", "server.log.1", "server.log.2.gz"]
    assert [f.compressed for f in result.searched.files] == [False, False, True]
    assert {(Path(f.file).name, f.line) for f in result.findings} == {
        ("server.log.1", 2),
        ("server.log.2.gz", 3),
    }


def test_gzip_is_detected_by_content_not_name(tmp_path):
    p = tmp_path / "worker.log.1"
    p.write_bytes(gzip.compress(b"INFO x\nFatal Python error: Segmentation fault\n"))
    (f,) = run_audit(p).findings
    assert (f.signature, f.line) == ("segfault", 2)


def test_rotations_sort_naturally(tmp_path):
    for n in (10, 2, 1):
        (tmp_path / f"server.log.{n}").write_text("INFO\n")
    (tmp_path / "server.log").write_text("INFO\n")
    names = [p.name for p in audit.collect_log_files([tmp_path])]
    assert names == ["server.log", "server.log.1", "server.log.2", "server.log.10"]


def test_truncated_gzip_keeps_what_it_held_and_says_so(tmp_path):
    data = gzip.compress(
        b"INFO a\nRuntimeError: CUDA error: misaligned address\n" + b"INFO pad\n" * 50000
    )
    p = tmp_path / "server.log.2.gz"
    p.write_bytes(data[: len(data) // 2])
    result = run_audit(p)
    sigs = [f.signature for f in result.findings]
    assert sigs == ["cuda-misaligned-address", "unreadable-log"]
    assert "could not read to the end" in result.findings[-1].text


def test_missing_path_is_an_input_error(tmp_path):
    with pytest.raises(AuditInputError, match=r"nope\.log: no such file or directory"):
        run_audit(tmp_path / "nope.log")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2026-11-29T14:00:00Z", datetime(2026, 11, 29, 14, tzinfo=timezone.utc)),
        ("2026-11-29T15:00:00+01:00", datetime(2026, 11, 29, 14, tzinfo=timezone.utc)),
        ("2026-11-29 14:00", None),  # naive: local time
    ],
)
def test_parse_since(text, expected):
    dt = parse_since(text)
    assert dt.tzinfo is not None
    if expected is not None:
        assert dt == expected


NO_JOURNAL = (0, "-- No entries --\n", "No journal files were found.\n")


DMESG_EPERM = (1, "", "dmesg: read kernel buffer failed: Operation not permitted\n")


SINCE = datetime(2026, 11, 29, 14, 0, tzinfo=timezone.utc)


def test_kernel_log_unreadable_is_never_a_silent_pass(tmp_path):
    runner = FakeRunner(journalctl=NO_JOURNAL, dmesg=DMESG_EPERM)
    result = run_audit(
        FIXTURES / "vllm_tp4_clean.log", since=SINCE, include_kernel_log=True, kernel_runner=runner
    )
    assert not result.searched.kernel_log.audited
    caveat = result.verdict.caveats[0]
    assert caveat.startswith("kernel log not audited: journalctl: no journal files were found")
    assert "dmesg: read kernel buffer failed: Operation not permitted" in caveat
    assert "kernel log not audited" in str(result.verdict)
    assert (
        "The kernel log was not audited (journalctl: no journal files" in result.summary_sentence()
    )


def test_kernel_log_from_dmesg_since_a_time_finds_the_silent_mtp_xid():
    dmesg = (0, (FIXTURES / "dmesg_xid31_mtp.txt").read_text(), "")
    runner = FakeRunner(dmesg=dmesg)  # journalctl not installed
    result = run_audit(
        FIXTURES / "vllm_tp4_clean.log", since=SINCE, include_kernel_log=True, kernel_runner=runner
    )
    ks = result.searched.kernel_log
    assert (
        ks.audited and ks.source == "dmesg" and ks.lines == 3
    )  # the 13:55 Xid 79 is before --since
    assert signature_ids(result) == {("xid", "fatal"), ("mmu-fault", "fatal")}
    assert {f.file for f in result.findings} == {"kernel log (dmesg)"}
    assert result.findings[0].fields == {"pci": "0000:65:00", "xid": "31"}
    assert "and the kernel log (dmesg, 3 lines)" in result.summary_sentence()


def test_kernel_log_prefers_journalctl_and_passes_since_in_utc():
    line = "2026-11-29T14:02:11+0000 node-3 kernel: NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n"
    runner = FakeRunner(journalctl=(0, line, ""))
    klog = read_kernel_log(SINCE, runner=runner)
    assert klog.status.source == "journalctl -k" and klog.lines == [line.strip()]
    assert runner.calls[0][-2:] == ["--since", "2026-11-29 14:00:00 UTC"]


def test_kernel_log_nothing_installed():
    klog = read_kernel_log(None, runner=FakeRunner())
    assert not klog.status.audited
    assert klog.status.reason == "journalctl: not installed; dmesg: not installed"


def test_kernel_log_on_this_machine_reports_what_happened():
    """The real tools: here journalctl has no journal files, and dmesg needs privileges."""
    klog = read_kernel_log(datetime.now(timezone.utc))
    if klog.status.audited:
        assert klog.status.source in ("dmesg", "journalctl -k")
    else:
        assert klog.status.reason and "dmesg" in klog.status.reason


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root + setpriv")
def test_kernel_log_unreadable_for_an_unprivileged_user_on_this_machine():
    """Drop to nobody: dmesg_restrict refuses the ring buffer, so the verdict must say so."""
    code = (
        "from orchestrator.audit import read_kernel_log;"
        "s = read_kernel_log(None).status; print(s.audited); print(s.reason)"
    )
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if "Permission denied" in proc.stderr:
        pytest.skip(f"nobody cannot run the venv python here: {proc.stderr[-200:]}")
    audited, reason = proc.stdout.splitlines()[:2]
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1":
        assert audited == "False"
        assert "dmesg" in reason and "not permitted" in reason


def test_dmesg_since_filter_keeps_continuation_lines():
    lines = [
        "2026-11-29T13:59:59,999999+00:00 old",
        "2026-11-29T14:00:00,000001+00:00 new",
        "  continuation of new",
    ]
    assert _filter_since(lines, SINCE) == lines[1:]


def _smi(name: str) -> FakeRunner:
    return FakeRunner(**{"nvidia-smi": (0, (FIXTURES / name).read_text(), "")})


def test_gpu_state_clean_h200_output():
    findings, status = read_gpu_state(runner=_smi("nvidia_smi_h200_clean.txt"))
    assert findings == [] and status.audited and status.lines == 1


def test_gpu_state_pending_remap_and_uncorrectable_ecc():
    findings, _ = read_gpu_state(runner=_smi("nvidia_smi_h200_pending_remap.txt"))
    got = {(f.signature, f.fields["key"], f.severity) for f in findings}
    assert got == {
        (
            "gpu-ecc-volatile-uncorrectable",
            "ECC Errors/Volatile/DRAM Uncorrectable",
            "quarantine-node",
        ),
        ("gpu-row-remap-pending", "Remapped Rows/Pending", "quarantine-node"),
    }
    assert {f.rank for f in findings} == {"GPU 00000000:00:06.0"}


def test_gpu_state_without_nvidia_smi_says_not_checked():
    result = run_audit(
        FIXTURES / "vllm_tp4_clean.log", include_gpu_state=True, gpu_runner=FakeRunner()
    )
    assert result.verdict.clean
    assert "GPU ECC state not checked: nvidia-smi not found" in result.verdict.caveats
    assert "GPU ECC state was not checked (nvidia-smi not found)." in result.summary_sentence()


def test_gpu_state_nvidia_smi_failure_is_a_reason():
    runner = FakeRunner(
        **{
            "nvidia-smi": (
                9,
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
                "",
            )
        }
    )
    _, status = read_gpu_state(runner=runner)
    assert not status.audited and "couldn't communicate" in status.reason
