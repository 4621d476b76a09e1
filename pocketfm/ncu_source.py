"""Nsight Compute's source page summed: where one kernel's warps stall, by reason, by how often
the code runs, by stretch of SASS, and by instruction.

Input: ``ncu --import R.ncu-rep --page source --print-source sass --csv`` of a report taken with
the SourceCounters section (``ncu --section SourceCounters -k regex:NAME -c 1 -o R ...``): for
each kernel a ``"Kernel Name"`` line, a header, then one row per SASS instruction with its warp
stall samples (all reasons, and one ``stall_*`` column per reason) and how often it executed.

A stall sample is a warp found not issuing; it is not an idle SM when another warp issues
instead, so a share of samples bounds, not measures, what removing a stall can gain
(BENCHMARKS.md 2026-12-05 (g): the x staging's 20% of the Q8_0 GEMM's samples, staged
asynchronously, gained nothing; the epilogue's 24%, made cheap, 12% of the kernel's time).

How often an instruction ran per warp (its executions over the kernel's first instruction's,
which every warp runs once) tells the code apart without source lines: in a GEMM, once a warp is
the set-up and the epilogue, once per K chunk the staging, once per K step the loop.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field

from .errors import InputError

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instr:
    index: int
    sass: str
    samples: float
    executed: float
    stalls: dict = field(default_factory=dict)  # reason -> samples

    @property
    def opcode(self) -> str:
        """The opcode without its modifiers and predicate ("HMMA", "LDG", ...)."""
        words = self.sass.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else ""


@dataclass
class Kernel:
    name: str
    instrs: list

    @property
    def samples(self) -> float:
        return sum(i.samples for i in self.instrs)

    def per_warp(self, i: Instr) -> float:
        """How often instruction i ran per warp."""
        first = self.instrs[0].executed
        return i.executed / first if first else 0.0


def _number(v: str) -> float:
    v = v.replace(",", "").strip()
    return float(v) if v not in ("", "-") else 0.0


def read_source(path: str) -> list[Kernel]:
    """The kernels of an ncu source-page CSV; InputError (one line) if the file cannot be read
    or holds no instruction rows with stall samples."""
    try:
        with open(path, newline="", errors="replace") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    kernels, header, name = [], None, "?"
    for row in rows:
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, header = (row[1] if len(row) > 1 else "?"), None
            continue
        if row[0] == "Address":
            header = {h: i for i, h in enumerate(row)}
            if SAMPLES not in header or EXECUTED not in header:
                break
            kernels.append(Kernel(name.split("[")[0].split("(")[0], []))
            continue
        if header is None or len(row) != len(header):
            continue
        k = kernels[-1]
        try:
            k.instrs.append(Instr(len(k.instrs), row[header["Source"]].strip(),
                                  _number(row[header[SAMPLES]]), _number(row[header[EXECUTED]]),
                                  {h[6:]: _number(row[i]) for h, i in header.items()
                                   if h.startswith("stall_") and "(Not Issued)" not in h}))
        except ValueError:
            raise InputError(f"{path}: instruction {len(k.instrs)} of {k.name}: a count is no "
                             f"number") from None
    kernels = [k for k in kernels if k.instrs]
    if not kernels:
        raise InputError(f"{path}: no instruction rows with '{SAMPLES}' (expected `ncu --import "
                         f"R.ncu-rep --page source --print-source sass --csv` of a report with "
                         f"--section SourceCounters)")
    return kernels


def by_reason(k: Kernel) -> list[tuple[str, float]]:
    """(reason, samples), largest first."""
    return sorted(((r, v) for r, v in _summed(k.instrs).items() if v > 0), key=lambda rv: -rv[1])


def _leading(stalls: dict, n: int = 2) -> str:
    top = sorted(((v, r) for r, v in stalls.items() if v > 0), reverse=True)[:n]
    total = sum(stalls.values()) or 1.0
    return ", ".join(f"{r} {100 * v / total:.0f}%" for v, r in top)


def _opcodes(instrs: list, n: int = 4) -> str:
    count: dict = {}
    for i in instrs:
        count[i.opcode] = count.get(i.opcode, 0) + 1
    return " ".join(f"{op}×{c}" for op, c in sorted(count.items(), key=lambda oc: -oc[1])[:n])


def _summed(instrs: list) -> dict:
    s: dict = {}
    for i in instrs:
        for r, v in i.stalls.items():
            s[r] = s.get(r, 0.0) + v
    return s


def by_frequency(k: Kernel) -> list[tuple[float, list]]:
    """(executions per warp, its instructions), most samples first; never-run code left out."""
    groups: dict = {}
    for i in k.instrs:
        if i.executed:
            groups.setdefault(round(k.per_warp(i), 2), []).append(i)
    return sorted(groups.items(), key=lambda g: -sum(i.samples for i in g[1]))


def windows(k: Kernel, size: int) -> list[list]:
    """The SASS in stretches of ``size`` instructions, in address order."""
    return [k.instrs[a:a + size] for a in range(0, len(k.instrs), size)]


def report(k: Kernel, window: int = 64, top: int = 12, min_share: float = 0.01) -> list[str]:
    """Markdown lines: the kernel's samples by reason, by executions per warp, by stretch of
    SASS (those holding at least ``min_share`` of the samples) and its top instructions."""
    total = k.samples or 1.0

    def pct(v):
        return f"{100 * v / total:.1f}%"

    out = [f"**{k.name}**: {len(k.instrs)} SASS instructions, {k.samples:,.0f} stall samples",
           "", "| stall reason | samples | share |", "|---|---|---|"]
    out += [f"| {r} | {v:,.0f} | {pct(v)} |" for r, v in by_reason(k)]
    out += ["", "| runs per warp | instructions | samples | share | leading stalls | opcodes |",
            "|---|---|---|---|---|---|"]
    for f, instrs in by_frequency(k):
        s = sum(i.samples for i in instrs)
        if s >= min_share * total:
            out.append(f"| {f:g} | {len(instrs)} | {s:,.0f} | {pct(s)} | "
                       f"{_leading(_summed(instrs))} | {_opcodes(instrs)} |")
    out += ["", f"| instructions ({window} a row) | runs per warp | samples | share | "
            "leading stalls | opcodes |", "|---|---|---|---|---|---|"]
    for w in windows(k, window):
        s = sum(i.samples for i in w)
        if s >= min_share * total:
            most = max(k.per_warp(i) for i in w)
            out.append(f"| {w[0].index}-{w[-1].index} | ≤ {most:g} | {s:,.0f} | {pct(s)} | "
                       f"{_leading(_summed(w))} | {_opcodes(w)} |")
    out += ["", "| # | instruction | runs per warp | samples | share | leading stalls |",
            "|---|---|---|---|---|---|"]
    for i in sorted(k.instrs, key=lambda i: -i.samples)[:top]:
        if i.samples:
            out.append(f"| {i.index} | `{i.sass[:60]}` | {k.per_warp(i):g} | {i.samples:,.0f} | "
                       f"{pct(i.samples)} | {_leading(i.stalls)} |")
    return out
