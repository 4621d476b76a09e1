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


def _nvjitlink_or_skip():
    from pocketfm.kernels.ptx_check import nvjitlink_missing

    missing = nvjitlink_missing()
    if missing and os.environ.get("CI"):
        raise AssertionError(f"CI needs nvJitLink: {missing}")
    if missing:
        pytest.skip(f"no nvJitLink here ({missing}); CI requires it")


PTX_HEAD = ".version 8.0\n.target sm_90\n.address_size 64\n\n.visible .entry k()\n{\n"


def test_assembling_catches_ptx_that_ptxas_refuses():
    """NVVM once emitted a branch to a label it never defined (2026-12-02): compile_ptx passed
    it, the GPU's loader did not. ptx_check assembles every kernel's PTX to catch that."""
    from pocketfm.kernels.ptx_check import _assemble

    _nvjitlink_or_skip()
    assert _assemble(PTX_HEAD + "$L__ok:\n\tbra.uni $L__ok;\n\tret;\n}\n", "good") is None
    problem = _assemble(PTX_HEAD + "\tbra.uni $L__BB0_129;\n\tret;\n}\n", "bad")
    assert problem.startswith("ptxas:") and "L__BB0_129" in problem, problem


def test_assembling_checks_a_register_budget():
    """A kernel with a register budget (its module's REGISTER_BUDGETS) fails ptx_check when the
    assembled kernel uses more: hc's u block relies on fitting 64 to get 1,024 threads."""
    from pocketfm.kernels import hc
    from pocketfm.kernels.ptx_check import _assemble, register_budget

    _nvjitlink_or_skip()
    ptx = (".version 8.0\n.target sm_90\n.address_size 64\n\n.visible .entry k(.param .u64 p)\n{\n"
           "\t.reg .b64 %rd<3>;\n\t.reg .b32 %r<3>;\n\tld.param.u64 %rd1, [p];\n"
           "\tcvta.to.global.u64 %rd2, %rd1;\n\tld.global.u32 %r1, [%rd2];\n"
           "\tadd.s32 %r2, %r1, 1;\n\tst.global.u32 [%rd2], %r2;\n\tret;\n}\n")
    assert _assemble(ptx, "small", (255, "any")) is None
    problem = _assemble(ptx, "small", (0, "none at all"))
    assert problem.startswith("uses ") and problem.endswith("its budget is 0 (none at all)")
    assert register_budget(hc._hc_pre_finish_u)[0] == 64
    assert register_budget(hc._hc_pre_finish_post) is None
