"""The one-round-trip property read off sm_90 SASS, where ptxas has had its say.

The PTX checks (``ptx_memory_order``, the CuTe load-order test) show that every global load
comes before any use *in the PTX*. ptxas reorders: on 2026-12-01 it was found to sink q loads
below the MXFP8 dequantisation (Gluon, BF16 out), to issue the weight loads only after
q_scale had arrived (CuTe's 1-row E4M3 variant), and the RoPE load only after q's first use
or q_scale's reciprocal (the register path). Each delays the last loads by an earlier one's
latency, which no PTX check can see; what that costs depends on what the delayed load hits
(a q load shared by a head's CTAs is an L2 hit), so each finding was measured on the H200.

What shows it: Hopper SASS carries, per instruction, the scoreboard a variable-latency
instruction (a load) releases when its data arrives ("write barrier"), the one it releases
once its source registers are read ("read barrier"), and the set of scoreboards the
instruction waits on first. A wait on a scoreboard that a global load set, placed before the
kernel's last global load, makes that last load wait a full memory latency for the earlier
one. ``early_waits`` lists those.

The control bits sit in the high 64-bit word of each 128-bit instruction (Volta and later;
Hopper the same): stall [105:108], yield [109], write barrier [110:112], read barrier
[113:115], wait mask [116:121] (7 in a barrier field means none). ``cuobjdump -sass`` prints
both words of each instruction as hex comments.

From a shell (Triton's bundled ptxas and cuobjdump, no GPU needed)::

    python -m fusedq_bench.sass KERNEL.ptx|KERNEL.cubin|KERNEL.sass [--arch sm_90a]

prints each early wait and exits 1 if there is one, 0 if none, 2 for a file it cannot read.
The PTX of a Triton kernel is in its cache entry (``~/.triton/cache``), the CuTe DSL's with
``CUTE_DSL_KEEP_PTX=1``; ``.sass`` is ``cuobjdump -sass`` output.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]+) \*/\s*$")
_HIGH_WORD = re.compile(r"^\s+/\* (0x[0-9a-f]+) \*/\s*$")
_GLOBAL_LOAD = re.compile(r"^(?:@!?U?P\w+\s+)?LDG\b")
NO_BARRIER = 7


@dataclasses.dataclass(frozen=True)
class Instruction:
    offset: int
    text: str
    write_barrier: int  # NO_BARRIER: none
    read_barrier: int
    wait_mask: int  # bit b: waits on scoreboard b

    @property
    def is_global_load(self) -> bool:
        return bool(_GLOBAL_LOAD.match(self.text))


def parse(sass: str) -> list[Instruction]:
    """The instructions of ``cuobjdump -sass`` output (one kernel), with their control bits."""
    lines = sass.splitlines()
    out: list[Instruction] = []
    for i, line in enumerate(lines):
        m = _INSTRUCTION.match(line)
        if not m or i + 1 >= len(lines):
            continue
        high = _HIGH_WORD.match(lines[i + 1])
        if not high:
            continue
        word = int(high.group(1), 16)
        out.append(
            Instruction(
                offset=int(m.group(1), 16),
                text=m.group(2).rstrip(" ;"),
                write_barrier=(word >> 46) & 7,
                read_barrier=(word >> 49) & 7,
                wait_mask=(word >> 52) & 0x3F,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class EarlyWait:
    at: int  # offset of the waiting instruction
    scoreboard: int
    load_at: int  # offset of the global load that set it
    text: str

    def __str__(self) -> str:
        return (
            f"/*{self.at:04x}*/ {self.text} waits on SB{self.scoreboard}, set by the global "
            f"load at /*{self.load_at:04x}*/, before the kernel's last global load"
        )


def early_waits(instructions: list[Instruction]) -> list[EarlyWait]:
    """Waits on a scoreboard a global load releases when its data arrives, before the
    kernel's last global load. (A load's read barrier, released once its address registers
    are read, costs a few cycles; it counts only where ptxas gave it the same scoreboard as a
    pending load's data, which the data's own entry already covers.)"""
    loads = [i for i, ins in enumerate(instructions) if ins.is_global_load]
    if not loads:
        return []
    pending: dict[int, int] = {}  # scoreboard -> offset of the load that set it
    found: list[EarlyWait] = []
    for ins in instructions[: loads[-1] + 1]:
        for board in range(6):
            if ins.wait_mask >> board & 1 and board in pending:
                found.append(EarlyWait(ins.offset, board, pending.pop(board), ins.text))
        if ins.is_global_load and ins.write_barrier != NO_BARRIER:
            pending[ins.write_barrier] = ins.offset
    return found


def triton_bin(tool: str) -> Path | None:
    """A CUDA tool Triton bundles (ptxas, cuobjdump, nvdisasm), or None."""
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    return path if path.exists() else None


def cubin_sass(cubin: Path) -> str:
    tool = triton_bin("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump: Triton's NVIDIA backend bundles none here")
    done = subprocess.run(
        [str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout


def ptx_sass(ptx: Path, arch: str = "sm_90a") -> str:
    """Assemble ``ptx`` with Triton's ptxas and disassemble the result."""
    tool = triton_bin("ptxas")
    if tool is None:
        raise FileNotFoundError("ptxas: Triton's NVIDIA backend bundles none here")
    cubin = ptx.with_suffix(".cubin")
    subprocess.run(
        [str(tool), f"-arch={arch}", "-O3", str(ptx), "-o", str(cubin)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    return cubin_sass(cubin)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fusedq_bench.sass",
        description="List the waits on a global load's data before a kernel's last global load.",
    )
    ap.add_argument("kernel", type=Path, help="a .ptx, .cubin, or cuobjdump -sass text (.sass)")
    ap.add_argument("--arch", default="sm_90a", help="ptxas target for a .ptx (default sm_90a)")
    args = ap.parse_args(argv)
    path: Path = args.kernel
    try:
        if path.suffix == ".ptx":
            sass = ptx_sass(path, args.arch)
        elif path.suffix == ".cubin":
            sass = cubin_sass(path)
        else:
            sass = path.read_text()
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else exc
        print(f"fusedq_bench.sass: {path}: {detail}", file=sys.stderr)
        return 2
    instructions = parse(sass)
    if not instructions:
        print(
            f"fusedq_bench.sass: {path}: no SASS instructions with control words found",
            file=sys.stderr,
        )
        return 2
    waits = early_waits(instructions)
    for wait in waits:
        print(wait)
    loads = sum(ins.is_global_load for ins in instructions)
    print(
        f"{path}: {len(instructions)} instructions, {loads} global loads, {len(waits)} early waits"
    )
    return 1 if waits else 0


if __name__ == "__main__":
    sys.exit(main())
