"""Programmatic dependent launch (kernels/pdl.py): the PTX check CI lane B applies to every
kernel, and the switch. The kernels themselves are compiled with the prologue and checked in
test_ptx_compile.py; what PDL buys is measured on the H200 (BENCHMARKS.md)."""
import os
import subprocess
import sys

import pytest

from pocketfm.kernels.pdl import check_prologue

ENABLED = "from pocketfm.kernels import pdl; print(pdl.ENABLED)"

HEAD = ".visible .entry k(\n\t.param .u64 k_param_0\n)\n{\n\tld.param.u64 \t%rd1, [k_param_0];\n"


def test_a_wait_before_the_first_global_access_passes():
    ptx = HEAD + ("\tgriddepcontrol.wait;\n\tld.global.nc.f32 \t%f1, [%rd1];\n"
                  "\tst.global.f32 [%rd1], %f1;\n")
    assert check_prologue(ptx) is None


@pytest.mark.parametrize("body,problem", [
    ("\tld.global.f32 \t%f1, [%rd1];\n\tgriddepcontrol.wait;\n", "before griddepcontrol.wait"),
    ("\tatom.global.add.u32 \t%r1, [%rd1], 1;\n\tgriddepcontrol.wait;\n", "atom.global"),
    ("\tst.global.f32 [%rd1], %f1;\n", "0 griddepcontrol.wait"),
    ("\tgriddepcontrol.wait;\n\tgriddepcontrol.wait;\n", "2 griddepcontrol.wait"),
])
def test_a_missing_late_or_doubled_wait_is_reported(body, problem):
    assert problem in check_prologue(HEAD + body)


@pytest.mark.parametrize("value,enabled", [("0", False), ("off", False), ("1", True)])
def test_pocketfm_pdl_switches_it_outside_the_simulator(value, enabled):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", POCKETFM_PDL=value)
    p = subprocess.run([sys.executable, "-c", ENABLED],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == str(enabled)


def test_the_simulator_never_uses_it():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", POCKETFM_PDL="1")
    p = subprocess.run([sys.executable, "-c", ENABLED],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "False", p.stderr[-2000:]


def _driver_answers() -> bool:
    try:
        from cuda.bindings import driver as drv

        return drv.cuInit(0)[0] == drv.CUresult.CUDA_SUCCESS
    except Exception:
        return False


def test_without_a_driver_it_assumes_the_sm90_target():
    """CI's compile lane has no GPU: the kernels are compiled (and checked) with the prologue
    for sm_90. On a GPU the driver's compute capability decides (below 9: off)."""
    from pocketfm.kernels import pdl

    if _driver_answers():
        pytest.skip("a GPU driver answers here: the capability decides")
    assert pdl.device_takes_it() is True


class _Config:  # what configure reads and writes of a cuda.core LaunchConfig
    is_cooperative = False
    programmatic_stream_serialization = False


class _Dispatcher:
    def __init__(self, fail=False):
        self.fail = fail

    def call(self, args, launch_config):
        from pocketfm.kernels import pdl

        pdl.configure(launch_config)
        if self.fail:
            raise RuntimeError("launch failed")
        return args


def test_only_marked_kernels_launch_with_the_attribute():
    """numba's own kernels (a device array's slice assignment) have no prologue: launched with
    the attribute they could overlap their predecessor, so only pocketfm's marked kernels get
    it, and a failing launch leaves nothing marked."""
    from pocketfm.kernels import pdl

    plain, cfg = _Config(), _Config()
    _Dispatcher().call((), plain)
    assert plain.programmatic_stream_serialization is False
    assert pdl.marked(_Dispatcher()).call((1,), cfg) == (1,)
    assert cfg.programmatic_stream_serialization is True
    coop = _Config()
    coop.is_cooperative = True
    pdl.marked(_Dispatcher()).call((), coop)
    assert coop.programmatic_stream_serialization is False
    with pytest.raises(RuntimeError):
        pdl.marked(_Dispatcher(fail=True)).call((), _Config())
    after = _Config()
    _Dispatcher().call((), after)
    assert after.programmatic_stream_serialization is False


def test_device_kernel_marks_its_kernels_outside_the_simulator():
    """device.kernel compiles the prologue in and marks the dispatcher (numba's launch
    configuration calls ``dispatcher.call``, the instance attribute marked() sets, which
    leave_out.skippable then wraps: bench --decode-without)."""
    code = ("from pocketfm.kernels import device, pdl\n"
            "def k(out):\n    out[0] = 1\n"
            "d = device.kernel(k)\n"
            "print(pdl.ENABLED, d.call.__name__, d.call.__wrapped__.__name__,"
            " d.py_func.__name__)\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", POCKETFM_PDL="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    if p.stdout.split()[0] == "False":
        pytest.skip("a GPU below sm_90 answers here")
    assert p.stdout.split() == ["True", "call_unless_left_out", "marked_call", "k"]
