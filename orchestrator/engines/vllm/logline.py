"""What a vLLM server log line is made of: colour codes, the process label, the header.

    (EngineCore_DP0 pid=42) WARNING 11-30 10:00:06 [cpu.py:9] \x1b[33mno AMX\x1b[0m
    ^ label                 ^ header                          ^ message, coloured

One home for the two readers of server logs: the audit's scanner (which attributes a
finding to its process and tells a traceback frame from its exception line) and the live
view (which shows the last line without its prefix: `message`). Standard library only: the audit
imports it and must stay light.
"""

from __future__ import annotations

import re

from orchestrator.common.mdtable import ANSI_RE

# vLLM prefixes every line of a child process: "(Worker_TP3 pid=1234) ",
# "(EngineCore_DP0 pid=…) ", "(VllmWorker rank=2 pid=…) ", "(APIServer pid=…) ",
# Ray adds ", ip=…". torch.distributed's elastic launcher prefixes "[rank3]: ".
LABEL_RE = re.compile(
    r"^\((?P<name>[A-Za-z][\w.-]*)(?: rank=(?P<rank>\d+))? pid=\d+(?:, ip=[\d.:a-fA-F]+)?\) ?"
    r"|^\[rank(?P<trank>\d+)\]: ?"
)
# vLLM's log header "ERROR 10-15 08:32:29 [core.py:708] " (optionally with milliseconds).
# `stamp` is the logging time, "%m-%d %H:%M:%S" local (orchestrator.engines.vllm.startup reads it).
HEADER_RE = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) +"
    r"(?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?) "
    r"\[[^\]]*\] ?"
)


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text) if "\x1b" in text else text


def message(line: str) -> str | None:
    """`line` as the live view quotes it: no colour codes, no process label, no header but a
    WARNING's or worse's level; None where only colour codes and blanks were there."""
    line = strip_ansi(line).strip()
    if not line:
        return None
    label = LABEL_RE.match(line)
    body = line[label.end() :] if label else line
    m = HEADER_RE.match(body)
    if m:
        level = "" if m.group("level") in ("DEBUG", "INFO") else f"{m.group('level')} "
        line = level + body[m.end() :]
    return line
