"""CI lane B: every kernel compiles for sm_90 (separate process, no simulator).

Two processes, so that CI's two pytest workers share the ~10 minutes: the modules of ``FIRST``,
then every other one (so a new module cannot be left out)."""
import os
import subprocess
import sys

import pytest

FIRST = "gemv,attention,indexer,embed_sample,compressor,norm_rope,retriever,kvgather"


@pytest.mark.parametrize("which", [["--only", FIRST], ["--skip", FIRST]],
                         ids=["first", "the_rest"])
def test_every_kernel_compiles_for_sm90(which):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    p = subprocess.run([sys.executable, "-m", "pocketfm.kernels.ptx_check", *which], env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode == 3 and not os.environ.get("CI"):
        pytest.skip("no NVVM here (pip install nvidia-nvvm nvidia-cuda-nvrtc); CI requires it")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    print(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--only", "gemv,bogus"], ["--skip"]])
def test_ptx_check_rejects_unknown_module_names(args):
    """A misspelt module (or a flag without its value) is a one-line error, exit 2, before any
    compiling (so this runs without NVVM too)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    p = subprocess.run([sys.executable, "-m", "pocketfm.kernels.ptx_check", *args], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "module names" in lines[0] and "Traceback" not in p.stderr
