"""kcache.py: the on-disk kernel cache's directory, keys, pruning and, on a GPU, a save in one
process and a load in the next (skipped without one; the start-up time saved is measured on the
device: BENCHMARKS.md). The checks that build every kernel run in a subprocess without the
simulator, as CI lane B does: the simulator makes no dispatchers to cache."""
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


def _run(script, **env):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", **env)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _probe(**env):
    return _run(PROBE, **env)[0]


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
    assert os.listdir(tmp_path) == []  # nothing is made on disk before a kernel is saved

    assert _probe(POCKETFM_KERNEL_CACHE="off")["cache"][0] == "NullCache"
    # on by default (empty: as unset, test_cache_root_from_the_environment), in the user's
    # cache directory
    default = _probe(XDG_CACHE_HOME=str(tmp_path / "xdg"), POCKETFM_KERNEL_CACHE="")
    assert default["cache"][:2] == ["KernelCache",
                                    str(tmp_path / "xdg" / "pocketfm" / "kernels" / sources)]


def test_an_unwritable_cache_is_one_line_on_stderr_and_no_save(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would go")
    path = str(blocker / "0123456789abcdef")
    kcache.writable.cache_clear()
    try:
        assert kcache.writable(path) is False and kcache.writable(path) is False
    finally:
        kcache.writable.cache_clear()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pocketfm: kernel cache: cannot write {path}")
    assert "POCKETFM_KERNEL_CACHE=DIR" in lines[0] and blocker.read_text().startswith("a file")


def test_cache_root_from_the_environment(monkeypatch, tmp_path):
    for off in ("off", "0", "no", "OFF"):
        monkeypatch.setenv("POCKETFM_KERNEL_CACHE", off)
        assert kcache.cache_root() is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for on in ("on", "", "1"):  # unset or empty: on, in the user's cache directory
        monkeypatch.setenv("POCKETFM_KERNEL_CACHE", on)
        assert kcache.cache_root() == str(tmp_path / "pocketfm" / "kernels")
    monkeypatch.delenv("POCKETFM_KERNEL_CACHE")
    assert kcache.cache_root() == str(tmp_path / "pocketfm" / "kernels")
    assert kcache.directory() == str(tmp_path / "pocketfm" / "kernels" / kcache.source_hash())
    monkeypatch.setenv("POCKETFM_KERNEL_CACHE", "off")
    assert kcache.directory() is None
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


def test_prune_keeps_the_newest_directories_and_only_removes_cache_files(tmp_path):
    dirs = []
    for i in range(5):
        d = tmp_path / f"{i:016x}"
        d.mkdir()
        (d / "k-1.nbi").write_bytes(b"index")
        (d / "k-1.1.nbc").write_bytes(b"data")
        if i == 0:
            (d / "notes.txt").write_text("the user's, not ours")
        os.utime(d, (1000 + i, 1000 + i))  # directory i last used at time 1000 + i
        dirs.append(d)
    (tmp_path / "not-a-hash").mkdir()
    (tmp_path / "NOT0123456789ABC").mkdir()

    pruned = kcache.prune(str(tmp_path), keep=2)
    assert sorted(pruned) == sorted(str(d) for d in dirs[:3])
    assert [d.exists() for d in dirs] == [True, False, False, True, True]
    assert os.listdir(dirs[0]) == ["notes.txt"]  # its cache files gone, the user's file kept
    assert sorted(os.listdir(dirs[4])) == ["k-1.1.nbc", "k-1.nbi"]
    assert (tmp_path / "not-a-hash").is_dir() and (tmp_path / "NOT0123456789ABC").is_dir()
    assert kcache.prune(str(tmp_path / "missing"), keep=2) == []


def test_a_writable_cache_is_made_marked_used_and_pruned(tmp_path):
    old = []
    for i in range(kcache.KEEP + 1):
        d = tmp_path / f"{i:016x}"
        d.mkdir()
        os.utime(d, (1000 + i, 1000 + i))
        old.append(d)
    path = str(tmp_path / ("f" * 16))
    kcache.writable.cache_clear()
    kcache.used.cache_clear()
    try:
        assert kcache.writable(path) is True
    finally:
        kcache.writable.cache_clear()
        kcache.used.cache_clear()
    assert os.path.isdir(path) and os.listdir(path) == []  # the probe file is gone
    # this process's directory and the KEEP - 1 newest others stay
    assert [d.exists() for d in old] == [False, False] + [True] * (kcache.KEEP - 1)


# the same kernel in two processes sharing a cache: the first compiles and saves, the second
# loads (no compile) and computes the same
GPU_PROBE = """
import json, numpy as np
from numba import cuda
if not cuda.is_available():
    print(json.dumps({"gpu": False})); raise SystemExit
from pocketfm.kernels import norm_rope
x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
w = np.linspace(0.5, 1.5, 256, dtype=np.float32)
out = cuda.device_array_like(x)
norm_rope.rmsnorm(out, cuda.to_device(x), cuda.to_device(w), 1e-6, True)
ref = np.empty_like(x)
norm_rope.rmsnorm_ref(ref, x, w, 1e-6, True)
st = norm_rope._rmsnorm_block_rows.stats
print(json.dumps({"gpu": True, "hits": sum(st.cache_hits.values()),
                  "misses": sum(st.cache_misses.values()), "out": out.copy_to_host().tolist(),
                  "err": float(np.abs(out.copy_to_host() - ref).max())}))
"""


def test_a_second_process_loads_the_kernels_the_first_saved(tmp_path):
    first, _ = _run(GPU_PROBE, POCKETFM_KERNEL_CACHE=str(tmp_path))
    if not first["gpu"]:
        pytest.skip("no GPU: saving and loading a compiled kernel needs one")
    second, _ = _run(GPU_PROBE, POCKETFM_KERNEL_CACHE=str(tmp_path))
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (second["hits"], second["misses"]) == (1, 0)
    assert second["out"] == first["out"] and second["err"] < 1e-5
    (sources,) = os.listdir(tmp_path)
    # (named after the kernel: pdl.py's wrapper's file name, made safe, ends in it)
    assert any("_rmsnorm_block_rows-" in f and f.endswith(".nbi")
               for f in os.listdir(tmp_path / sources))


# numba names a kernel's data files 1, 2, ... in the order saved: two processes saving two
# signatures at once could both write number 1, and the index would then hand one signature
# the other's kernel. Here each data file is named by its key; a writer that read the index
# before another's save drops that entry (a miss later), never points it at the wrong data.
RACE = """
import json, sys
from pocketfm.kernels import kcache
File = kcache._kernel_cache_class().File
a = File(sys.argv[1], "k-0123", "stamp")
b = File(sys.argv[1], "k-0123", "stamp")
a.save(("sig A",), "kernel A")
stale = b._load_index()  # b read the index before a's save of sig B ...
a.save(("sig B",), "kernel B")
stale[("sig C",)] = b.data_name(("sig C",))
b._save_index(stale)  # ... and wrote it back with its own entry
b._save_data(b.data_name(("sig C",)), "kernel C")
print(json.dumps({"A": a.load(("sig A",)), "B": a.load(("sig B",)), "C": a.load(("sig C",)),
                  "names": sorted({a.data_name((s,)) for s in ("sig A", "sig B", "sig C")})}))
"""


def test_data_files_are_named_by_key_so_racing_writers_lose_entries_not_kernels(tmp_path):
    p = subprocess.run([sys.executable, "-c", RACE, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert (got["A"], got["B"], got["C"]) == ("kernel A", None, "kernel C")  # B: a miss
    assert len(got["names"]) == 3 and all(n.startswith("k-0123.") and n.endswith(".nbc")
                                          for n in got["names"])
    assert sorted(os.listdir(tmp_path)) == sorted(got["names"] + ["k-0123.nbi"])
