"""bin/engine-check (a GPU diagnostic): a bad --reference-dtype is refused before any work."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reference_dtype_refused(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bin", "engine-check"), "--cpu",
                          "--reference-dtype", "float16", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--reference-dtype" in last and "float16" in last, res.stderr
    assert not (tmp_path / "out").exists()  # refused before anything is written
