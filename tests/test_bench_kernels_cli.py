"""bin/bench-kernels (a GPU tool): --baseline is checked before any GPU work, and its table
sets each case beside the baseline's."""
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "bin", "bench-kernels")


def _tool():
    loader = importlib.machinery.SourceFileLoader("bench_kernels_tool", TOOL)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_a_bad_baseline_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"gpu": "x"}))  # no rows
    for path in (str(bad), str(tmp_path / "missing.json")):
        res = subprocess.run([sys.executable, TOOL, "--baseline", path], capture_output=True,
                             text=True, timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr
        assert lines[0].startswith(f"bench-kernels: --baseline {path}: expected a bench.json")


def test_compare_rows_matches_cases_by_family_and_name():
    base = [dict(family="hc", name="a", us=10.0), dict(family="hc", name="gone", us=5.0),
            dict(family="qat", name="a", us=4.0), dict(family="hc", name="broken", error="x")]
    rows = [dict(family="hc", name="a", us=5.0), dict(family="qat", name="a", us=6.0),
            dict(family="hc", name="new", us=1.0), dict(family="hc", name="err", error="y")]
    out = _tool().compare_rows(base, rows)
    assert out[2:] == ["| hc | a | 10.0 | 5.0 | 0.500 |", "| qat | a | 4.0 | 6.0 | 1.500 |",
                       "| hc | new | - | 1.0 | - |", "| hc | gone | 5.0 | - | - |"]


def test_an_unknown_family_is_refused_in_one_line():
    res = subprocess.run([sys.executable, TOOL, "--family", "hcc"], capture_output=True,
                         text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith("bench-kernels: --family hcc: expected one of kvpack, ")


def test_case_filter_matches_any_text_case_insensitively():
    wanted = _tool().case_wanted
    assert wanted("topk_chunk T=512 N=65536 k=512", None)
    assert wanted("topk_chunk T=512 N=65536 k=512", ["TOPK_CHUNK", "attention"])
    assert not wanted("indexer_scores tensor cores N=65536 HI=64", ["topk_chunk"])
