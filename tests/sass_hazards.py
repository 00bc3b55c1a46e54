"""Registers touched while a wgmma still uses them, and wgmma descriptors read from uniform
registers no path has written, found in a kernel's SASS.

A Hopper wgmma (SASS ``QGMMA``/``HGMMA``) runs asynchronously: until a
``WARPGROUP.DEPBAR.LE gsb0, N`` retires its commit group, nothing may read or write its
accumulator, nor write the registers of an A operand it takes from registers. Triton cannot
list an 8-bit A operand among ``warpgroup_mma_wait``'s deps, so the kernels rely on ptxas's
placement; this walks every path of the SASS (branches and loops included) and reports what
breaks the rule. Commit groups close at a wgmma marked ``gsb0`` and retire in order.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_MMA = re.compile(r"^[QH]GMMA\.64x(\d+)x")
# Commit groups tracked apart; beyond, the oldest two are merged (retired with the later).
_MAX_GROUPS = 8
# Opcodes whose first operand is not a register they write.
_NO_DEST = ("ST", "SYNCS", "BAR", "UTMA", "BRA", "EXIT", "RED", "WARPGROUP", "FENCE", "MEMBAR",
            "BSYNC", "BSSY", "NOP", "WARPSYNC", "RET", "CALL", "ATOM")
_PREDICATES_ONLY = ("ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3")


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str | None
    op: str
    operands: tuple[str, ...]
    text: str


def parse(listing: str) -> list[Instruction]:
    """cuobjdump -sass text as instructions, in address order."""
    out = []
    for match in _INSTRUCTION.finditer(listing):
        text = match.group(2).strip()
        predicate, body = None, text
        if found := re.match(r"^(@!?U?P\w+)\s+(.*)$", text):
            predicate, body = found.groups()
        op, _, args = body.partition(" ")
        operands = tuple(a.strip() for a in args.split(",")) if args.strip() else ()
        out.append(Instruction(int(match.group(1), 16), predicate, op, operands, text))
    return out


def _successors(code: list[Instruction]) -> list[list[int]]:
    index = {ins.address: i for i, ins in enumerate(code)}
    succ = []
    for i, ins in enumerate(code):
        after = [i + 1] if i + 1 < len(code) else []
        if ins.op.startswith("BRA"):
            target = ins.operands[-1] if ins.operands else ""
            jump = [index[int(target, 16)]] if target.startswith("0x") and \
                int(target, 16) in index else []
            succ.append(jump + (after if ins.predicate or not jump else []))
        elif ins.op == "EXIT":
            succ.append(after if ins.predicate else [])
        else:
            succ.append(after)
    return succ


def _registers(token: str, width: int) -> set[int]:
    return {int(r) + k for r in re.findall(r"\bR(\d+)\b", token) for k in range(width)}


def _width(op: str) -> int:
    if ".128" in op:
        return 4
    return 2 if ".64" in op or "WIDE" in op or (op.startswith("CS2R") and ".32" not in op) else 1


def _touches(ins: Instruction) -> tuple[set[int], set[int]]:
    """(registers written, registers read) by a non-wgmma instruction. A predicate written
    beside the register (``SHFL.BFLY PT, R1, ...``, ``LOP3.LUT P0, R1, ...``) comes first;
    the compares write predicates only."""
    operands, written = list(ins.operands), set()
    width = _width(ins.op)
    if not ins.op.startswith(_NO_DEST + _PREDICATES_ONLY):
        while operands and re.match(r"^!?U?P(T|\d+)$", operands[0]):
            operands.pop(0)
        if operands and re.match(r"^R\d+", operands[0]):
            written = _registers(operands.pop(0), width)
    read = set()
    for token in operands:
        read |= _registers(token, width if ins.op.startswith("ST") else 1)
    return written, read


def hazards(listing: str) -> tuple[int, int, list[str]]:
    """(wgmmas, those with an A operand in registers, instructions that touch an in-flight
    wgmma's accumulator or write its register A operand)."""
    code = parse(listing)
    succ = _successors(code)
    found: set[str] = set()
    seen: set = set()
    # State: the closed commit groups in flight, oldest first, and the open one; a group is
    # (accumulator registers, A registers).
    work: list = [(0, ((), None))] if code else []
    while work:
        i, state = work.pop()
        if (i, state) in seen:
            continue
        seen.add((i, state))
        closed, open_ = state
        ins = code[i]
        if mma := _MMA.match(ins.op):
            # 64 x N fp32 over 128 threads; a result into RZ (ptxas discards it) holds none
            acc = frozenset(_registers(ins.operands[0], int(mma.group(1)) // 2))
            a_regs = frozenset(_registers(ins.operands[1], 4))  # a descriptor holds none
            prev = open_ or (frozenset(), frozenset())
            open_ = (prev[0] | acc, prev[1] | a_regs)
            if "gsb0" in ins.operands:
                closed, open_ = (*closed, open_), None
                if len(closed) > _MAX_GROUPS:  # a loop that never waits: keep the walk finite
                    oldest, second = closed[:2]
                    closed = ((oldest[0] | second[0], oldest[1] | second[1]), *closed[2:])
        elif ins.op.startswith("WARPGROUP.DEPBAR"):
            keep = int(ins.operands[-1], 16)
            closed = closed[len(closed) - keep:] if 0 < keep < len(closed) else \
                (() if keep == 0 else closed)
        elif flight := [*closed, *([open_] if open_ else [])]:
            written, read = _touches(ins)
            accs = frozenset().union(*(g[0] for g in flight))
            a_regs = frozenset().union(*(g[1] for g in flight))
            if (written | read) & accs or written & a_regs:
                found.add(f"{ins.address:#x}: {ins.text}")
        work += [(j, (closed, open_)) for j in succ[i]]
    mmas = [ins for ins in code if _MMA.match(ins.op)]
    with_a = sum(bool(_registers(ins.operands[1], 1)) for ins in mmas)
    return len(mmas), with_a, sorted(found)


# Opcodes that write the uniform register named first (``.64``: and the next one).
_UNIFORM_WRITERS = ("U", "R2UR", "S2UR", "VOTEU")


def _uniform_writes(ins: Instruction) -> frozenset[int]:
    if ins.predicate or not ins.operands or not ins.op.startswith(_UNIFORM_WRITERS):
        return frozenset()
    found = re.match(r"^UR(\d+)$", ins.operands[0])
    if not found:
        return frozenset()
    first = int(found.group(1))
    return frozenset(range(first, first + (2 if ".64" in ins.op else 1)))


def undefined_descriptors(listing: str) -> list[str]:
    """wgmmas whose shared-memory descriptors (``gdesc[URn]``: A's and B's in URn..URn+3, or
    B's alone in URn, URn+1) come from uniform registers that some path from the kernel's
    entry never writes (predicated writes do not count). ptxas 12.8 (triton 3.6's) compiled
    a wgmma on one branch with the descriptor another branch had set up (the seesaw's WG1,
    session 15): right or wrong by what the SM's previous block left there."""
    code = parse(listing)
    succ = _successors(code)
    written: list[frozenset[int] | None] = [None] * len(code)  # on every path here
    if code:
        written[0] = frozenset()
    work = [0] if code else []
    while work:
        i = work.pop()
        after = written[i] | _uniform_writes(code[i])
        for j in succ[i]:
            met = after if written[j] is None else written[j] & after
            if met != written[j]:
                written[j] = met
                work.append(j)
    found = []
    for ins, have in zip(code, written, strict=True):
        desc = re.search(r"gdesc\[UR(\d+)\]", ins.text)
        if not _MMA.match(ins.op) or desc is None or have is None:
            continue
        first = int(desc.group(1))
        width = 4 if len(ins.operands) > 1 and ins.operands[1].startswith("gdesc") else 2
        if set(range(first, first + width)) - have:
            found.append(f"{ins.address:#x}: {ins.text}")
    return found


def mma_loops(listing: str) -> list[list[Instruction]]:
    """Each innermost loop that issues wgmmas (a backward branch's range holding a GMMA, no
    EXIT and no other such loop), its instructions in address order."""
    code = parse(listing)
    loops = []
    for i, ins in enumerate(code):
        target = ins.operands[-1] if ins.op.startswith("BRA") and ins.operands else ""
        if target.startswith("0x") and int(target, 16) < ins.address:
            body = [c for c in code[:i + 1] if c.address >= int(target, 16)]
            # (A wait's retry stub after the code jumps back across an EXIT: not a loop.)
            exits = any(c.op == "EXIT" and not c.predicate for c in body)
            if any(_MMA.match(c.op) for c in body) and not exits:
                loops.append((body[0].address, ins.address, body))
    return [body for lo, hi, body in loops
            if not any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi)
                       for lo2, hi2, _ in loops)]


def mma_loop_spills(listing: str) -> list[tuple[int, int, int]]:
    """Each innermost wgmma loop (``mma_loops``) as (first address, local loads, local
    stores) in it: spills there are paid every trip, between the MMAs."""
    return [(body[0].address, sum(c.op.startswith("LDL") for c in body),
             sum(c.op.startswith("STL") for c in body)) for body in mma_loops(listing)]


def listing(compiled) -> str:
    """A triton CompiledKernel's SASS (cuobjdump of triton's wheel)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(tool), "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
