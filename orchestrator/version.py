"""`orchestrator --version`: the installed version, and the commit where it runs from a checkout."""

from __future__ import annotations

from orchestrator.common.probes import dist_version, git_commit

# The distribution that ships both packages (pyproject.toml's [project] name).
DISTRIBUTION = "fusedq"


def version_line() -> str:
    """``orchestrator 0.1.0 (commit e3a37d8, modified)``; the commit part only in a git tree."""
    out = f"orchestrator {dist_version(DISTRIBUTION) or 'unknown'}"
    git = git_commit()
    if git.get("commit"):
        out += f" (commit {git['commit'][:7]}{', modified' if git.get('dirty') else ''})"
    return out
