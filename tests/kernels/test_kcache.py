"""kcache.py: the on-disk kernel cache's directory and keys (the GPU's save / load is measured
on the device: BENCHMARKS.md). The checks that build every kernel run in a subprocess without
the simulator, as CI lane B does: the simulator makes no dispatchers to cache."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pocketfm.kernels import kcache

# every kernel's identity, and the cache device.kernel attached, from a process without the
# simulator
PROBE = """
import json, sys
from pocketfm.kernels import kcache, ptx_check
kernels = {id(k): k for _, k, _ in ptx_check.all_signatures()}
out = {"ids": sorted(kcache.function_identity(k.source_fn, k.targetoptions)
                     for k in kernels.values()),
       "names": sorted(k.source_fn.__qualname__ for k in kernels.values())}
from pocketfm.kernels import hmma
from pocketfm.quants import GGMLType
c = hmma._KERNELS[GGMLType.Q8_0]._cache
out["cache"] = [type(c).__name__, getattr(c, "cache_path", None), kcache.source_hash(),
                getattr(getattr(c, "_impl", None), "filename_base", None)]
print(json.dumps(out))
"""


def _probe(**env):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **env)
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_kernel_has_its_own_identity_the_same_in_every_process(tmp_path):
    a = _probe(PYTHONHASHSEED="1", POCKETFM_KERNEL_CACHE=str(tmp_path))
    b = _probe(PYTHONHASHSEED="2", POCKETFM_KERNEL_CACHE=str(tmp_path))
    # distinct kernels never share a key (factories build several kernels of one name: their
    # closures tell them apart), and a second process finds the first one's keys
    assert len(a["ids"]) == len(set(a["ids"])) == len(a["names"]) > 100
    assert a["ids"] == b["ids"]
    kind, path, sources, base = a["cache"]
    assert kind == "KernelCache" and path == str(tmp_path / sources) and b["cache"] == a["cache"]
    assert base.endswith("_gemm_q8_0_hmma-" + base[-16:]) and len(base) <= 97  # name-identity
    assert _probe()["cache"][0] == "NullCache"  # opt-in: no POCKETFM_KERNEL_CACHE, no cache


def test_an_unwritable_cache_is_one_line_on_stderr_and_no_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would go")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", POCKETFM_KERNEL_CACHE=str(blocker))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["cache"][0] == "NullCache"
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"POCKETFM_KERNEL_CACHE={blocker}: cannot write" in lines[0]


def test_cache_root_from_the_environment(monkeypatch, tmp_path):
    for off in ("", "off", "0", "no"):
        monkeypatch.setenv("POCKETFM_KERNEL_CACHE", off)
        assert kcache.cache_root() is None
    monkeypatch.setenv("POCKETFM_KERNEL_CACHE", "on")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kcache.cache_root() == str(tmp_path / "pocketfm" / "kernels")
    monkeypatch.setenv("POCKETFM_KERNEL_CACHE", str(tmp_path / "k"))
    assert kcache.cache_root() == str(tmp_path / "k")


def test_source_hash_follows_every_file_and_switch(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "sub" / "b.py").write_text("def f(): return 2\n")
    (pkg / "notes.txt").write_text("not source")
    kcache.source_hash.cache_clear()
    h0 = kcache.source_hash(str(pkg))
    (pkg / "notes.txt").write_text("still not source")
    kcache.source_hash.cache_clear()
    assert kcache.source_hash(str(pkg)) == h0
    (pkg / "sub" / "b.py").write_text("def f(): return 3\n")  # a callee in another module
    kcache.source_hash.cache_clear()
    h1 = kcache.source_hash(str(pkg))
    assert h1 != h0
    monkeypatch.setenv("POCKETFM_PDL", "0")
    kcache.source_hash.cache_clear()
    assert kcache.source_hash(str(pkg)) != h1
    kcache.source_hash.cache_clear()


def _maker(scale, table):
    def k(out):
        out[0] = scale * table[0]
    return k


def test_identity_follows_code_closure_and_options():
    base = kcache.function_identity(_maker(2, np.ones(3)), {"lineinfo": True})
    assert base == kcache.function_identity(_maker(2, np.ones(3)), {"lineinfo": True})
    assert base != kcache.function_identity(_maker(3, np.ones(3)), {"lineinfo": True})
    assert base != kcache.function_identity(_maker(2, np.zeros(3)), {"lineinfo": True})
    assert base != kcache.function_identity(_maker(2, np.ones(3)), {"lineinfo": False})

    # a nested function's code is described by content: two compilations of one source (two
    # code objects, at two addresses) are one kernel
    src = "def k(out):\n    f = lambda v: v + 1\n    out[0] = f(1)\n"

    def build():
        ns = {"__name__": "probe"}
        exec(compile(src, "<probe>", "exec"), ns)
        return ns["k"]
    assert kcache.function_identity(build(), {}) == kcache.function_identity(build(), {})

    class Opaque:
        pass
    with pytest.raises(ValueError, match="cannot fingerprint a .*Opaque"):
        kcache.function_identity(_maker(Opaque(), np.ones(3)), {})
