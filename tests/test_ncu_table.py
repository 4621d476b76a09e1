"""bin/ncu-table: Nsight Compute's per-launch CSV summed per kernel, and two builds compared."""
import os
import subprocess
import sys

BIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bin",
                   "ncu-table")
HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"\n')


def ncu_csv(path, launches):
    """An ncu --csv file: program output and ==PROF== lines around one row per launch."""
    rows = [f'"{i}","1","python3","h","{name}[v1,cw5](Array<float, 2, C>)","1","13",'
            f'"(128, 1, 1)","{grid}","0","9.0","Command line profiler metrics",'
            f'"gpu__time_duration.sum","ns","{ns:,}"\n'
            for i, (name, grid, ns) in enumerate(launches)]
    path.write_text("==PROF== Connected to process 1\nflash: prefill 2,048 tokens\n" + HEAD +
                    "".join(rows) + "==PROF== Disconnected from process 1\n")
    return str(path)


def ncu_table(*args):
    p = subprocess.run([sys.executable, BIN, *args], capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_sums_per_kernel_and_compares_builds(tmp_path):
    new = ncu_csv(tmp_path / "new.csv", [("indexer::topk", "(512, 1, 1)", 2_000_000),
                                         ("indexer::topk", "(171, 1, 1)", 1_500_000),
                                         ("hmma::gemm", "(64, 8, 1)", 1_000_000)])
    old = ncu_csv(tmp_path / "old.csv", [("indexer::topk", "(512, 1, 1)", 500_000),
                                         ("norm::rms", "(2048, 1, 1)", 250_000)])
    code, out, err = ncu_table(new)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[2] == "| indexer::topk | 2 | 3.50 | 77.8% |"  # the two launches summed
    assert lines[3] == "| hmma::gemm | 1 | 1.00 | 22.2% |"
    assert lines[-1] == "| **total** | 3 | **4.50** | |"
    code, out, err = ncu_table(new, "--base", old)
    lines = out.strip().splitlines()
    assert code == 0 and "| indexer::topk | 1 | 0.50 | 2 | 3.50 | +3.00 |" in lines, out
    assert "| norm::rms | 1 | 0.25 | 0 | 0.00 | -0.25 |" in lines  # gone in the new build
    assert lines[-1] == "| **total** | | **0.75** | | **4.50** | **+3.75** |"
    code, out, _ = ncu_table(new, "--by-grid", "--top", "1")
    assert code == 0 and out.strip().splitlines()[2].startswith("| indexer::topk (512, 1, 1) |")


def test_bad_input_is_one_line_exit_2(tmp_path):
    good = ncu_csv(tmp_path / "good.csv", [("a::k", "(1, 1, 1)", 1000)])
    (tmp_path / "log.txt").write_text("==PROF== Connected\nno rows here\n")
    bad_value = tmp_path / "bad.csv"
    bad_value.write_text(open(good).read().replace('"1,000"', '"n/a"'))
    for args, want in (([str(tmp_path / "missing.csv")], "missing.csv: cannot read"),
                       ([str(tmp_path / "log.txt")], "log.txt: no gpu__time_duration.sum rows"),
                       ([str(bad_value)], "kernel a::k: gpu__time_duration.sum is not a number"),
                       ([good, "--base", str(tmp_path / "log.txt")], "log.txt: no gpu__time")):
        code, out, err = ncu_table(*args)
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and want in lines[0], err
