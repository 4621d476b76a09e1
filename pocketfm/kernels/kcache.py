"""An on-disk cache of the compiled kernels, so that a second GPU process does not compile again.

Why: Numba compiles each kernel at its first launch, ~1-4 s in its front end and NVVM and
~0.3 s in ptxas; on V4-Flash's shapes the first prefill chunk took 56-93 s and the first decode
step 43-75 s (``prefill_first_chunk_s``, ``first_step_s``, H100 / H200, 2026-12-05). With the
cache warm, 0.87 s and 0.34 s, and a whole ``pocketfm bench`` process 28 s instead of 180
(H100, 2026-12-05 (h) in BENCHMARKS.md; engine-check's tokens and logits the same).

On by default, in ``$XDG_CACHE_HOME/pocketfm/kernels`` or ``~/.cache/pocketfm/kernels``;
``POCKETFM_KERNEL_CACHE=DIR`` puts it elsewhere, ``=off`` (or 0, no, false) turns it off.
``device.kernel`` gives each kernel it makes a ``KernelCache``. Nothing is made on disk until a
kernel is compiled and saved; then the directory is made and tried once a process (one stderr
line if it cannot be written, and the kernels are compiled as without a cache), and the cache
keeps the newest ``KEEP`` source hashes' directories (by last use), removing older ones' cache
files: each is ~45 MB, and every change of the sources or switches starts a new one.

What a cached kernel is keyed by (numba's own cache keys a kernel by its function's bytecode,
its serialised closure and its file's timestamp: a changed device function in another module,
or pdl.py's wrappers, which have no file and the same bytecode for every kernel of one arity,
would load a stale or a wrong kernel; and a closure holding an intrinsic serialises with a
fresh uuid in every process, so it would never load at all):
- the directory: a hash of every ``.py`` file of the pocketfm package, numba-cuda's, numba's
  and Python's versions and the ``POCKETFM_*`` and ``NUMBA_*`` environment (any change in the
  sources or those switches: a new, empty directory);
- within it: the kernel's own function (module, qualified name, bytecode, constants, closure
  values, followed into the functions they hold) and its jit options, with the signature, the
  compute capability and numba-cuda's version.
A kernel that cannot be saved or loaded (a value numba cannot serialise) is compiled as
without the cache; the first such failure is reported once on stderr. Processes may share the
cache at once (pytest's workers on a GPU): files are written whole under a temporary name, and
each compiled kernel's data file is named by its key (_KeyedFile), so a race loses at most an
index entry (compiled again), never hands a signature another's kernel.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import types

import numba
import numpy as np
from numba.core.types import Type as NumbaType

_OFF = ("0", "off", "false", "no", "none")
KEEP = 3  # source hashes' directories kept (the newest by last use)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pocketfm/
_warned: list = []


def cache_root() -> str | None:
    """The cache's directory from POCKETFM_KERNEL_CACHE (unset: the user's cache directory),
    or None (turned off)."""
    v = os.environ.get("POCKETFM_KERNEL_CACHE", "").strip()
    if v.lower() in _OFF:
        return None
    if v.lower() in ("", "1", "on", "true", "yes"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "pocketfm", "kernels")
    return os.path.abspath(os.path.expanduser(v))


def directory() -> str | None:
    """This process's cache directory (made when a kernel is first saved), or None (off)."""
    root = cache_root()
    return None if root is None else os.path.join(root, source_hash())


@functools.lru_cache(maxsize=None)
def source_hash(package: str = _PACKAGE) -> str:
    """16 hex digits over every .py file of ``package`` (paths and bytes), numba-cuda's, numba's
    and Python's versions and the POCKETFM_* and NUMBA_* environment variables."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, package).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    h.update(f"{_numba_version()} numba {numba.__version__} {sys.version}".encode())
    for k in sorted(k for k in os.environ if k.startswith(("POCKETFM_", "NUMBA_"))
                    and k != "POCKETFM_KERNEL_CACHE"):  # (where the cache is: not what is in it)
        h.update(f"{k}={os.environ[k]}\0".encode())
    return h.hexdigest()[:16]


def _numba_version() -> str:
    import numba_cuda

    return f"numba-cuda {numba_cuda.__version__}"


def function_identity(fn, options: dict) -> str:
    """A hash of a kernel's own function (module, qualified name, bytecode, constants, closure
    values, recursively) and its jit options; ValueError for a closure value it cannot
    describe the same way in every process."""
    h = hashlib.sha256(repr(sorted(options.items())).encode())
    _fingerprint(h, fn, set())
    return h.hexdigest()[:16]


def _fingerprint(h, v, seen: set) -> None:
    """Feed a process-independent description of ``v`` to hash ``h``. (numba's serialiser is
    not one: an intrinsic pickles with a fresh uuid in every process, so a kernel whose closure
    reaches one would never be found again.) Module-level names are not followed: the
    directory's source hash covers them."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(v).__name__}:{v!r}\0".encode())
    elif isinstance(v, (tuple, list)):
        h.update(f"{type(v).__name__}[{len(v)}\0".encode())
        for x in v:
            _fingerprint(h, x, seen)
    elif isinstance(v, np.ndarray):
        h.update(f"ndarray:{v.dtype.str}:{v.shape}\0".encode() + np.ascontiguousarray(v).tobytes())
    elif isinstance(v, np.generic):
        h.update(f"{v.dtype.str}:{v!r}\0".encode())
    elif hasattr(v, "py_func") and hasattr(v, "targetoptions"):  # a jitted (device) function
        h.update(f"jit:{sorted(v.targetoptions.items())!r}\0".encode())
        _fingerprint(h, v.py_func, seen)
    elif isinstance(v, types.FunctionType):
        h.update(f"fn:{v.__module__}.{v.__qualname__}\0".encode())
        if id(v) in seen:  # (recursion through closures)
            return
        seen.add(id(v))
        _hash_code(h, v.__code__)
        for c in v.__closure__ or ():
            _fingerprint(h, c.cell_contents, seen)
    elif isinstance(v, types.ModuleType):
        h.update(f"module:{v.__name__}\0".encode())
    elif isinstance(v, type):
        h.update(f"class:{v.__module__}.{v.__qualname__}\0".encode())
    elif isinstance(v, NumbaType):
        h.update(f"numba type:{v}\0".encode())
    elif isinstance(getattr(v, "_defn", None), types.FunctionType):  # an @intrinsic: its typer
        h.update(f"intrinsic:{getattr(v, '_name', '')}\0".encode())  # (and the PTX it closes
        _fingerprint(h, v._defn, seen)  # over)
    else:
        raise ValueError(f"cannot fingerprint a {type(v).__qualname__} in a kernel's closure")


def _hash_code(h, code) -> None:
    """Bytecode, names and constants of ``code``, nested functions' code included (by content:
    the repr of a code object holds its address, which differs between processes)."""
    h.update(code.co_code + repr(code.co_names).encode())
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            _hash_code(h, c)
        elif isinstance(c, frozenset):  # (set order follows string hashes, seeded per process)
            h.update(repr(sorted(map(repr, c))).encode())
        else:
            h.update(repr(c).encode())


def _warn_once(what: str, err: Exception) -> None:
    if not _warned:
        _warned.append(what)
        print(f"pocketfm: kernel cache: {what}: {type(err).__name__}: {err} (compiling instead; "
              f"further failures not shown)", file=sys.stderr)


def attach(disp, fn, options: dict) -> None:
    """Give dispatcher ``disp`` (compiled from ``fn``, or pdl.py's wrapper of it) the disk cache
    unless POCKETFM_KERNEL_CACHE turns it off."""
    path = directory()
    if path is None:
        return
    try:
        disp._cache = _kernel_cache_class()(disp.py_func, path, function_identity(fn, options))
    except Exception as e:  # a closure value it cannot describe
        _warn_once(f"{fn.__qualname__} not cached", e)


@functools.lru_cache(maxsize=None)
def writable(path: str) -> bool:
    """Make ``path`` (this process's cache directory) and try a file in it, once a process;
    then prune the directories of older source hashes. False (said once on stderr): the
    kernels are compiled and not saved."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        open(probe, "w").close()
        os.unlink(probe)
    except OSError as e:
        print(f"pocketfm: kernel cache: cannot write {path} ({e.strerror}); kernels are "
              f"compiled without a cache (POCKETFM_KERNEL_CACHE=DIR puts it elsewhere, =off "
              f"turns it off)", file=sys.stderr)
        return False
    used(path)
    prune(os.path.dirname(path), KEEP)
    return True


@functools.lru_cache(maxsize=None)
def used(path: str) -> None:
    """Mark ``path`` used now (its mtime: prune keeps the newest), once a process."""
    try:
        os.utime(path)
    except OSError:  # (not made yet, or read-only: nothing to keep it from)
        pass


def prune(root: str, keep: int) -> list:
    """Remove the cache files of all but the ``keep`` most recently used source hashes'
    directories under ``root``, and those directories if nothing else is in them; returns the
    directories pruned. Only 16-hex-digit directories and numba's .nbi / .nbc files are
    touched: a DIR the user shares with other files loses none of them."""
    try:
        names = [n for n in os.listdir(root) if len(n) == 16
                 and all(ch in "0123456789abcdef" for ch in n)
                 and os.path.isdir(os.path.join(root, n))]
        names.sort(key=lambda n: os.path.getmtime(os.path.join(root, n)), reverse=True)
    except OSError:
        return []
    pruned = []
    for n in names[keep:]:
        d = os.path.join(root, n)
        try:
            for f in os.listdir(d):
                if f.endswith((".nbi", ".nbc")):
                    os.unlink(os.path.join(d, f))
            os.rmdir(d)
        except OSError:  # (another process's, or a file that is not ours: left as it is)
            pass
        pruned.append(d)
    return pruned


@functools.lru_cache(maxsize=None)
def _kernel_cache_class():
    """KernelCache, made on first use (numba-cuda's caching classes load the CUDA target)."""
    from numba.cuda.core.caching import IndexDataCacheFile, _CacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

    class _Locator(_CacheLocator):
        def __init__(self, path, identity):
            self._path, self._identity = path, identity

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):  # the path holds the sources' hash already
            return os.path.basename(self._path)

        def get_disambiguator(self):
            return self._identity

        @classmethod
        def from_function(cls, py_func, py_file):
            # numba's CacheImpl asks each locator class for a locator of the function alone;
            # the one KernelCache made for this kernel is handed over here
            return _next.pop()

    _next: list = []

    class _Impl(CUDACacheImpl):
        _locator_classes = [_Locator]

        def get_filename_base(self, fullname, abiflags):
            """The kernel's name, made safe and short (pdl.py's wrappers are named after
            their file, ``<pdl prologue of ...>``), and its identity."""
            safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in fullname)
            return f"{safe[-80:]}-{self.locator.get_disambiguator()}"

    class _KeyedFile(IndexDataCacheFile):
        """numba's index and data files, each data file named after a hash of its key. (numba
        numbers them in order: two processes saving two signatures of one kernel at once, as
        pytest's workers on a GPU do, could both take number 1, and the index then points one
        signature at the other's kernel.) The data goes first, then the index entry; a lost
        index update (two writers) is a miss, compiled and saved again."""

        def save(self, key, data):
            name = self.data_name(key)
            self._save_data(name, data)
            overloads = self._load_index()
            overloads[key] = name
            self._save_index(overloads)

        def data_name(self, key):
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            return f"{self._index_name[:-len('.nbi')]}.{digest}.nbc"

    class KernelCache(CUDACache):
        """numba-cuda's kernel cache with this module's directory, key and data file names
        (module doc)."""
        _impl_class = _Impl
        File = _KeyedFile

        def __init__(self, py_func, path, identity):
            self._identity = identity
            _next.append(_Locator(path, identity))
            super().__init__(py_func)
            self._cache_file = _KeyedFile(self._cache_path, self._impl.filename_base,
                                          self._impl.locator.get_source_stamp())

        def _index_key(self, sig, codegen):
            """numba's key without its serialised closure (not the same in two processes:
            _fingerprint), with the kernel's identity instead."""
            key = (sig, codegen.magic_tuple(), _numba_version(), ("pocketfm", self._identity))
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key

        def load_overload(self, sig, target_context):
            used(self._cache_path)
            try:
                return super().load_overload(sig, target_context)
            except Exception as e:
                _warn_once(f"loading {self._name}", e)
                return None

        def save_overload(self, sig, data):
            if not writable(self._cache_path):
                return
            try:
                super().save_overload(sig, data)
            except Exception as e:
                _warn_once(f"saving {self._name}", e)

    return KernelCache
