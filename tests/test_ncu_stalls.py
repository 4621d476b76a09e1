"""bin/ncu-stalls: Nsight Compute's per-instruction stall samples summed by reason, by how often
the code runs per warp, by stretch of SASS and by instruction."""
import os
import subprocess
import sys

from pocketfm.ncu_source import by_frequency, by_reason, read_source, report

BIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bin",
                   "ncu-stalls")
REASONS = ("long_sb", "wait", "math")
HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)",'
        '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed",'
        + ",".join(f'"stall_{r}"' for r in REASONS) + ","
        + ",".join(f'"stall_{r} (Not Issued)"' for r in REASONS) + "\n")


def source_csv(path, instrs, name="pocketfm::kernels::hmma::_gemm_q8_0_hmma[abi:v6,cw5]"):
    """An ncu source-page CSV: instrs are (sass, executed, {reason: samples})."""
    rows = []
    for i, (sass, executed, stalls) in enumerate(instrs):
        total = sum(stalls.values())
        cells = [f"0x7f00{16 * i:04x}", f"      {sass}", f"{total:,}", str(total), str(total),
                 f"{executed:,}"] + [str(stalls.get(r, 0)) for r in REASONS] * 2
        rows.append(",".join(f'"{c}"' for c in cells) + "\n")
    path.write_text(f'"Kernel Name","{name}(Array<float, (int)2, C>)"\n' + HEAD + "".join(rows))
    return str(path)


# a GEMM-like kernel of 100 warps: set-up once, staging 4 times, a loop 32 times, epilogue once
GEMM = ([("LDC R1, c[0x0][0x28]", 100, {"wait": 10})]
        + [("LDG.E.64 R4, desc[UR4][R2.64]", 400, {"long_sb": 300, "wait": 20})]
        + [("HMMA.16816.F32 R8, R12, R16, R8", 3200, {"math": 200, "wait": 400})] * 3
        + [("@!P0 FMUL R7, R15, R4", 100, {"long_sb": 50})]
        + [("EXIT", 0, {})])


def ncu_stalls(*args):
    p = subprocess.run([sys.executable, BIN, *args], capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_sums_by_reason_frequency_and_instruction(tmp_path):
    (k,) = read_source(source_csv(tmp_path / "q8.csv", GEMM))
    assert k.name == "pocketfm::kernels::hmma::_gemm_q8_0_hmma"
    assert k.samples == 10 + 320 + 3 * 600 + 50
    assert by_reason(k) == [("wait", 10 + 20 + 1200), ("math", 600), ("long_sb", 350)]
    # runs per warp: the loop (32) holds the most samples; the never-run EXIT is left out
    assert [(f, len(i)) for f, i in by_frequency(k)] == [(32, 3), (4, 1), (1, 2)]
    md = report(k, window=4, top=2)
    assert "| 32 | 3 | 1,800 | 82.6% | wait 67%, math 33% | HMMA×3 |" in md
    assert "| 0-3 | ≤ 32 | 1,530 | 70.2% | wait 54%, math 26% | HMMA×2 LDC×1 LDG×1 |" in md
    assert md[-2:] == ["| 2 | `HMMA.16816.F32 R8, R12, R16, R8` | 32 | 600 | 27.5% | "
                       "wait 67%, math 33% |",
                       "| 3 | `HMMA.16816.F32 R8, R12, R16, R8` | 32 | 600 | 27.5% | "
                       "wait 67%, math 33% |"]


def test_cli_prints_each_kernel_and_filters(tmp_path):
    path = source_csv(tmp_path / "q8.csv", GEMM)
    code, out, err = ncu_stalls(path, "--window", "8", "--top", "5")
    assert code == 0, err
    assert out.startswith("**pocketfm::kernels::hmma::_gemm_q8_0_hmma**: 7 SASS instructions, "
                          "2,180 stall samples")
    assert "| 5 | `@!P0 FMUL R7, R15, R4` | 1 | 50 | 2.3% | long_sb 100% |" in out
    code, out, err = ncu_stalls(path, "--kernel", "gemm_q8_0")
    assert code == 0 and "_gemm_q8_0_hmma" in out, err


def test_bad_input_is_one_line_exit_2(tmp_path):
    cases = [
        ([str(tmp_path / "missing.csv")], "missing.csv: cannot read"),
        ([str(tmp_path / "metrics.csv")], "no instruction rows with 'Warp Stall Sampling"),
        ([source_csv(tmp_path / "q8.csv", GEMM), "--kernel", "attention"],
         "no kernel named like 'attention'"),
        ([str(tmp_path / "q8.csv"), "--window", "0"], "--window must be >= 1"),
    ]
    (tmp_path / "metrics.csv").write_text('"ID","Kernel Name","Metric Name","Metric Value"\n'
                                          '"0","k","gpu__time_duration.sum","1,000"\n')
    for args, msg in cases:
        code, out, err = ncu_stalls(*args)
        assert code == 2 and out == "", (args, out)
        assert len(err.strip().splitlines()) == 1 and msg in err, (args, err)
