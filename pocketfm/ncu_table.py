"""Nsight Compute's per-kernel CSV as a table: where one chunk's (or step's) GPU time goes, and
what changed against another build's CSV.

Input: the stdout of ``ncu --profile-from-start off --metrics gpu__time_duration.sum --csv
pocketfm bench ... --ncu-chunk`` (or ``--ncu-step``): one row per kernel launch, among
``==PROF==`` lines and the program's own output. Kernels are grouped by their name without
Numba's mangled suffix and argument types (``module::function``), or with ``by_grid`` by
name and grid size (one weight's GEMM from another's).
"""
from __future__ import annotations

import csv

from .errors import InputError

METRIC = "gpu__time_duration.sum"


def kernel_times(path: str, by_grid: bool = False) -> dict:
    """{kernel: (launches, ms)} from an ncu CSV; InputError (one line) if the file cannot be
    read or holds no row of METRIC."""
    try:
        with open(path, errors="replace") as f:
            lines = [line for line in f if line.startswith('"')]
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    times: dict = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != METRIC:
            continue
        name = row["Kernel Name"].split("[")[0].split("(")[0]
        if by_grid:
            name += " " + row.get("Grid Size", "")
        try:
            ns = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            raise InputError(f"{path}: kernel {name}: {METRIC} is not a number "
                             f"({row.get('Metric Value')!r})") from None
        n, ms = times.get(name, (0, 0.0))
        times[name] = (n + 1, ms + ns / 1e6)
    if not times:
        raise InputError(f"{path}: no {METRIC} rows (expected the CSV of `ncu --csv "
                         f"--metrics {METRIC} ...`)")
    return times


def table(times: dict, base: dict | None = None, top: int | None = None) -> list[str]:
    """Markdown lines: every kernel's launches and ms, largest first, the total last; with
    ``base`` (another build's kernel_times) its launches and ms beside them and the
    difference, ordered by the larger of the two."""
    base_or_none = base or {}

    def size(k):
        return max(times.get(k, (0, 0.0))[1], base_or_none.get(k, (0, 0.0))[1])

    names = sorted(set(times) | set(base_or_none), key=lambda k: (-size(k), k))
    if top:
        names = names[:top]
    total = sum(ms for _, ms in times.values())
    if base is None:
        out = ["| kernel | launches | ms | share |", "|---|---|---|---|"]
        for k in names:
            n, ms = times[k]
            out.append(f"| {k} | {n} | {ms:.2f} | {100 * ms / total:.1f}% |")
        out.append(f"| **total** | {sum(n for n, _ in times.values())} | **{total:.2f}** | |")
        return out
    btotal = sum(ms for _, ms in base.values())
    out = ["| kernel | base launches | base ms | launches | ms | difference |",
           "|---|---|---|---|---|---|"]
    for k in names:
        bn, bms = base.get(k, (0, 0.0))
        n, ms = times.get(k, (0, 0.0))
        out.append(f"| {k} | {bn} | {bms:.2f} | {n} | {ms:.2f} | {ms - bms:+.2f} |")
    out.append(f"| **total** | | **{btotal:.2f}** | | **{total:.2f}** | "
               f"**{total - btotal:+.2f}** |")
    return out
