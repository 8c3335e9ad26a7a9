"""C++ kernels for the CPU, compiled on first use with the machine's C++ compiler and cached on disk.

The sources ship in this package. The kernels (`cpu_kernels()`, called through ctypes) need only torch's headers
(ATen/Parallel.h, for torch's own intra-op threads). A second library (`cpu_ops()`: cpu_ops.cpp) needs torch's full
headers and registers the CPU implementations of `torch_shift::packed_linear` and, once a forward is compiled on the
CPU, `torch_shift::attention` (`register_native_attention`) with PyTorch's dispatcher. The first use of either builds
both, one compiler per source, the sources they share compiled once: about 20 s on 2 cores.
Both are cached under `$XDG_CACHE_HOME/torch_shift/kernels` (default `~/.cache`), keyed by their sources,
torch's version, the compiler and this CPU's instruction set, so a machine builds them once. Ranks started together
build them once between them (a file lock). Where no compiler works, `cpu_kernels()` returns None and says why once,
and the callers keep their pure-PyTorch paths (and the operators their Python implementations); where only one
library fails to build, the other still serves.

For GPUs: `triton_linear` (a few rows' matmuls in Triton, imported only where a GPU runs them).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)  # the CLI shows its INFO lines; a library user's logging decides

_SOURCES = ("cpu_attention.cpp", "cpu_linear.cpp", "cpu_elementwise.cpp", "cpu_suffix.cpp")
_HEADERS = ("cpu_common.h", "cpu_no_contract.h", "cpu_threads.h")  # part of the build's key, as the sources
# operator implementations registered with PyTorch's dispatcher: a library of their own, as they need torch's full
# headers (a failure to build them loses only them); the GEMV and attention kernels linked in again
_OPS_SOURCES = ("cpu_ops.cpp", "cpu_linear.cpp", "cpu_attention.cpp", "cpu_elementwise.cpp", "cpu_decoder.cpp",
                "cpu_suffix.cpp")
_LIBRARIES = {"libtorch_shift_cpu.so": _SOURCES, "libtorch_shift_ops.so": _OPS_SOURCES}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

i64, f32, f64, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_void_p


class CpuKernels:
    """The compiled library's entry points (see cpu_attention.cpp for their arguments)."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self.paged_attention = lib.ts_paged_attention
        self.paged_attention.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr,
                                         ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, ptr]
        self.paged_attention.restype = ctypes.c_int
        self.attention_amx = lib.ts_attention_amx
        self.attention_amx.argtypes = [ctypes.c_int]
        self.attention_amx.restype = ctypes.c_int
        self.write_kv = lib.ts_write_kv
        self.write_kv.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64,
                                  i64]
        self.write_kv.restype = ctypes.c_int
        self.packed_gemv = lib.ts_packed_gemv
        self.packed_gemv.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64]
        self.packed_gemv.restype = ctypes.c_int
        self.packed_gemv_dtypes = lib.ts_packed_gemv_dtypes()
        self.gemv_amx = lib.ts_gemv_amx  # this library's own switch: gemv_on_tile_unit sets every library's
        self.gemv_amx.argtypes = [ctypes.c_int]
        self.gemv_amx.restype = ctypes.c_int
        self.blocked_linear = lib.ts_blocked_linear
        self.blocked_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
        self.blocked_linear.restype = ctypes.c_int
        lib.ts_blocked_gemv_rows.restype = i64
        self.blocked_gemv_rows = lib.ts_blocked_gemv_rows()  # the rows up to which the blocks run the GEMV
        self.library = lib
        self.rms_norm = lib.ts_rms_norm
        self.rms_norm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, i64, i64, ptr, f32, i64, ptr]
        self.rms_norm.restype = ctypes.c_int
        self.add_rms_norm = lib.ts_add_rms_norm
        self.add_rms_norm.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, ptr, f32, i64, ptr, ptr]
        self.add_rms_norm.restype = ctypes.c_int
        self.rotary = lib.ts_rotary
        self.rotary.argtypes = [ctypes.c_int, ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr]
        self.rotary.restype = ctypes.c_int
        self.argmax = lib.ts_argmax
        self.argmax.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
        self.argmax.restype = ctypes.c_int
        self.sample_rows = lib.ts_sample_rows
        self.sample_rows.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr]
        self.sample_rows.restype = ctypes.c_int
        self.suffix_draft = lib.ts_suffix_draft
        self.suffix_draft.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, f64, f64, f64, ptr, ptr,
                                      ptr]
        self.suffix_draft.restype = i64
        self.suffix_draft_global = lib.ts_suffix_draft_global
        self.suffix_draft_global.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, f64, f64, f64, ptr, ptr, ptr]
        self.suffix_draft_global.restype = i64
        self.pair_index_new = lib.ts_pair_index_new
        self.pair_index_new.argtypes = []
        self.pair_index_new.restype = ptr
        self.pair_index_delete = lib.ts_pair_index_delete
        self.pair_index_delete.argtypes = [ptr]
        self.pair_index_delete.restype = None
        self.pair_index_add = lib.ts_pair_index_add
        self.pair_index_add.argtypes = [ptr, ptr, i64, i64]
        self.pair_index_add.restype = None
        self.pair_index_clear = lib.ts_pair_index_clear
        self.pair_index_clear.argtypes = [ptr]
        self.pair_index_clear.restype = None

    @staticmethod
    def dtype_code(dtype: torch.dtype) -> int | None:
        return _DTYPE_CODES.get(dtype)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), the Triton kernels' padded tile sizes, as triton.next_power_of_2, which
    Triton 3.9 wraps as a JIT-callable constexpr function: 4-5 us a call, four calls a layer of every eager step, half
    the Triton attention's Python there."""
    return 1 << (n - 1).bit_length()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_shift" / "kernels"


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else c++, g++ or clang++ on PATH; None if none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@lru_cache(maxsize=4)
def _cxx_standard(cxx: str | None) -> str:
    """C++20 where the compiler knows it, else C++17. PyTorch 2.14's headers need C++20 (`requires` clauses in
    ATen/core/TensorBase.h); 2.11's build under either, and torch.utils.cpp_extension itself passes C++20 from 2.13."""
    if cxx is None:
        return "c++17"
    probe = subprocess.run([cxx, "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True,
                           text=True, timeout=60)
    return "c++20" if probe.returncode == 0 else "c++17"


def _compile_flags(native: bool, cxx: str | None = None) -> list[str]:
    """`cxx`: the compiler they are for (default: `compiler()`), whose C++ standard they name."""
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    # -fopenmp: at::parallel_for runs on torch's own OpenMP threads (the library loads torch's libgomp)
    return ["-O3", *(["-march=native"] if native else []), f"-std={_cxx_standard(cxx or compiler())}", "-fPIC",
            "-fopenmp", "-fno-math-errno", "-Wno-psabi", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(Path(torch.__file__).parent / "include")]


def _link_flags() -> list[str]:
    lib = Path(torch.__file__).parent / "lib"
    return ["-shared", "-fopenmp", "-L", str(lib), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


@dataclass(frozen=True)
class BuildFailure:
    """Why a source did not compile or a library did not link. `lasting`: the compiler's or linker's own diagnosis,
    the same on every try with the same sources, flags and compiler (`_build` caches it), unlike a timeout or a kill."""

    message: str
    lasting: bool


def _start(command: list[str]) -> subprocess.Popen | BuildFailure:
    try:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return BuildFailure(f"{Path(command[0]).name} did not start: {e}", lasting=False)


def _wait(command: list[str], process: subprocess.Popen | BuildFailure) -> BuildFailure | None:
    """`command`'s process (`_start`'s) run to its end: None where it succeeded."""
    if isinstance(process, BuildFailure):
        return process
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        return BuildFailure(f"{Path(command[0]).name} ran past 300 s", lasting=False)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode == 0:
        return None
    message = stderr.strip()[-2000:]
    # a compiler killed by a signal (the OOM killer) has a negative status and often nothing to say
    return BuildFailure(message or f"{Path(command[0]).name} exited with status {process.returncode}",
                        lasting=process.returncode > 0 and bool(message))


def _compile(cxx: str, sources: list[Path], out_dir: Path, native: bool,
             extra_flags: tuple[str, ...] = ()) -> dict[Path, BuildFailure | None]:
    """Every source compiled at once into `out_dir/<stem>.o` (one compiler per source: the build takes the longest
    source's time or the sources' total over the cores, not their sum); each source's failure, None where it compiled.
    `extra_flags`: after the usual ones (a test builds for another instruction set with them)."""
    commands = {source: [cxx, *_compile_flags(native, cxx), *extra_flags, "-c", str(source),
                         "-o", str(out_dir / f"{source.stem}.o")] for source in sources}
    started = {source: _start(command) for source, command in commands.items()}
    try:
        return {source: _wait(commands[source], process) for source, process in started.items()}
    finally:  # (an interrupted build leaves no compiler running)
        for process in started.values():
            if isinstance(process, subprocess.Popen) and process.poll() is None:
                process.kill()
                process.wait()


def _link(cxx: str, compiled: dict[Path, BuildFailure | None], sources: list[Path],
          output: Path) -> BuildFailure | None:
    """The library at `output` from `sources`' objects, which `_compile` wrote beside it (`compiled`: its result):
    None, or the first source's failure to compile, or why it did not link."""
    failure = next((compiled[source] for source in sources if compiled[source] is not None), None)
    if failure is not None:
        return failure
    command = [cxx, *(str(output.with_name(f"{source.stem}.o")) for source in sources), *_link_flags(),
               "-o", str(output)]
    return _wait(command, _start(command))


def _compile_and_link(cxx: str, sources: list[Path], output: Path, native: bool,
                      extra_flags: tuple[str, ...] = ()) -> str | None:
    """One library at `output` from `sources` (`_compile`, then `_link`): None, or the first error."""
    failure = _link(cxx, _compile(cxx, sources, output.parent, native, extra_flags), sources, output)
    return None if failure is None else failure.message


def _build(sources_dir: Path) -> dict[str, Path | str]:
    """Each library of `_LIBRARIES`: its path, or why it did not build. Both build from one set of compilers at once:
    the sources they share compile once, and the first run waits about half as long as for one library after the
    other (20 against 37 s on 2 cores). A lasting failure (the compiler's or linker's diagnosis) is cached beside the
    libraries as `<name>.error`, so that every later run does not build it again; a timeout or a kill is retried."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for source in sorted({s for sources in _LIBRARIES.values() for s in sources}) + list(_HEADERS):
        digest.update((sources_dir / source).read_bytes())
    flags = " ".join(_compile_flags(native=True, cxx=cxx) + _link_flags())
    for part in (torch.__version__, version, flags, _cpu_flags(), sys.platform, platform.machine(), *_LIBRARIES):
        digest.update(part.encode())
    target_dir = cache_dir() / digest.hexdigest()[:20]

    def cached(name: str) -> Path | str | None:
        """The library's path, its cached failure, or None where neither is there."""
        error = target_dir / f"{name}.error"
        if (target_dir / name).exists():
            return target_dir / name
        return f"{error.read_text()}\n(cached in {error}: delete it to build again)" if error.exists() else None

    def done() -> dict[str, Path | str] | None:
        built = {name: cached(name) for name in _LIBRARIES}
        return None if None in built.values() else built

    if (built := done()) is not None:
        return built
    target_dir.mkdir(parents=True, exist_ok=True)
    failures: dict[str, BuildFailure] = {}
    with open(target_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks started together: one builds, the others wait for it
        if (built := done()) is not None:
            return built
        missing = {name: sources for name, sources in _LIBRARIES.items() if cached(name) is None}
        attempted = list(missing)
        # the first run on a machine waits for this (about 20 s on 2 cores): say so, or it looks hung; a warning, so
        # that Python prints it where the user configured no logging (`LLM()` in a notebook)
        logger.warning("building %s with %s, once for this machine (cached in %s) ...", " and ".join(attempted),
                       Path(cxx).name, cache_dir())
        started = time.monotonic()
        for native in (True, False):  # -march=native where the compiler knows this CPU
            with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
                objects = Path(tmp)
                needed = sorted({s for sources in missing.values() for s in sources})
                compiled = _compile(cxx, [sources_dir / s for s in needed], objects, native)
                for name, sources in list(missing.items()):
                    failure = _link(cxx, compiled, [sources_dir / s for s in sources], objects / name)
                    if failure is None:
                        os.replace(objects / name, target_dir / name)  # atomic: a reader never sees half a library
                        del missing[name]
                        failures.pop(name, None)
                    else:
                        failures[name] = failure
            if not missing:
                break
        for name, failure in failures.items():
            if failure.lasting:
                (target_dir / f"{name}.error").write_text(failure.message)
        if built_now := [name for name in attempted if name not in failures]:
            logger.info("built %s in %.0f s", " and ".join(built_now), time.monotonic() - started)
    return {name: failures[name].message if name in failures else cached(name) for name in _LIBRARIES}


@lru_cache(maxsize=1)
def _libraries() -> dict[str, Path | str]:
    return _build(Path(__file__).parent)


def _library(name: str) -> Path:
    """The built library `name`, building both on first use; RuntimeError with the compiler's error where it failed."""
    built = _libraries()[name]
    if isinstance(built, str):
        raise RuntimeError(f"{Path(compiler() or 'the compiler').name} failed to build {name}:\n{built}")
    return built


@lru_cache(maxsize=1)
def cpu_kernels() -> CpuKernels | None:
    """The CPU kernels of this process (built on first use), or None where they cannot be built."""
    try:
        return CpuKernels(_library("libtorch_shift_cpu.so"))
    except Exception as e:  # noqa: BLE001 - any failure leaves the pure-PyTorch paths in place
        warnings.warn(f"torch_shift's CPU kernels are unavailable ({e}); on the CPU attention falls back to SDPA "
                      "over gathered blocks and the other kernels to PyTorch, and suffix decoding drafts in Python: "
                      "all slower", RuntimeWarning, stacklevel=2)
        return None


_ops_library: ctypes.CDLL | None = None  # kept loaded: its registrations live in PyTorch's dispatcher


@lru_cache(maxsize=1)
def cpu_ops() -> bool:
    """Load torch_shift's C++ operator implementations for the CPU (cpu_ops.cpp: `torch_shift::packed_linear`, and
    `torch_shift::attention` once `register_native_attention` registers it),
    building them on first use; False where they cannot be built (the operators' Python implementations serve, and
    `torch.ops.torch_shift_cpu` stays empty). Call it after torch_shift.models.linear defined the operator."""
    global _ops_library
    if cpu_kernels() is None:  # no compiler, or the kernels themselves do not build: said once already
        return False
    try:
        _ops_library = ctypes.CDLL(str(_library("libtorch_shift_ops.so")))
        return True
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python implementations in place
        warnings.warn(f"torch_shift's CPU operators are unavailable ({e}); packed linear layers and compiled "
                      "forwards' attention run through Python, which is slower", RuntimeWarning, stacklevel=2)
        return False


def gemv_on_tile_unit(enable: int = -1) -> bool:
    """Whether bfloat16 packed for AMX runs the GEMV on the tile unit (the default) or in AVX512-BF16 dot products
    (kernels/cpu_linear.cpp), in both libraries that hold the GEMV: the kernels' (`PackedWeight._gemv`) and the
    operators' (`torch_shift::packed_linear`, the C++ decoder). `enable` 1 or 0 sets it (to compare the two; weights
    packed afterwards take the GEMV's row limit of the path on), -1 leaves it. False where the CPU, the compiler or
    Linux does not give the kernel the tile unit."""
    kernels = cpu_kernels()
    if kernels is None:
        return False
    ops_switch = _ops_gemv_amx()
    if ops_switch is not None:
        ops_switch(enable)
    return bool(kernels.gemv_amx(enable))


@lru_cache(maxsize=1)
def _ops_gemv_amx() -> Callable[[int], int] | None:
    """The operator library's ts_gemv_amx (None where that library does not build)."""
    if not cpu_ops():
        return None
    switch = _ops_library.ts_gemv_amx
    switch.argtypes, switch.restype = [ctypes.c_int], ctypes.c_int
    return switch


@lru_cache(maxsize=1)
def huge_page_scope() -> Callable[[int], int] | None:
    """The operator library's ts_huge_page_scope (cpu_ops.cpp; `torch_shift.memory.huge_page_allocations` calls it),
    or None where that library does not build."""
    if not cpu_ops():
        return None
    scope = _ops_library.ts_huge_page_scope
    scope.argtypes, scope.restype = [ctypes.c_int], ctypes.c_int
    return scope


@lru_cache(maxsize=1)
def _gemv_pool() -> tuple[Callable[[int], int], Callable[[], int], Callable[[], None]] | None:
    """The decode pool's entry points (arm, workers, stop) in the library the packed weights call: the operator library
    where it builds, else the kernels'; None where neither does."""
    if cpu_ops():
        library = _ops_library
    elif cpu_kernels() is not None:
        library = cpu_kernels().library
    else:
        return None
    arm, workers, stop = library.ts_gemv_pool_arm, library.ts_gemv_pool_workers, library.ts_gemv_pool_stop
    arm.argtypes, arm.restype = [ctypes.c_int], ctypes.c_int
    workers.argtypes, workers.restype = [], ctypes.c_int
    stop.argtypes, stop.restype = [], None
    return arm, workers, stop


def arm_gemv_pool(workers: int) -> int:
    """Let `workers` threads of the GEMV kernel's decode pool (cpu_linear.cpp) run the GEMVs with the calling thread,
    and prefetch the weights that come next while it runs the rest of a step; 0: none (they sleep; the GEMVs split
    over torch's threads again). Only for steps whose matmuls all run the GEMV, with torch's threads at one while
    armed (torch_shift.engine.decode_pool). Returns the workers armed (0 where the kernels are unavailable)."""
    pool = _gemv_pool()
    return 0 if pool is None else pool[0](workers)


def _loaded_gemv_pool() -> tuple[Callable[[int], int], Callable[[], int], Callable[[], None]] | None:
    """`_gemv_pool()` where this process has looked for the libraries already; None, with nothing built, where it
    has not, as then no pool can be armed (an engine on a GPU asks at every step and arms none: it builds no C++)."""
    return _gemv_pool() if _libraries.cache_info().currsize else None


def stop_gemv_pool() -> None:
    """End the decode pool's threads (arming starts new ones)."""
    pool = _loaded_gemv_pool()
    if pool is not None:
        pool[2]()


def gemv_pool_workers() -> int:
    """The decode pool's workers armed now (0 in a child forked from an armed process, or where no library was
    loaded)."""
    pool = _loaded_gemv_pool()
    return 0 if pool is None else pool[1]()


class NativeAttention:
    """The C++ implementation of `torch_shift::attention` on the CPU (cpu_ops.cpp): `install` gives it a step's
    paged attention (CpuPagedAttention.install_native), `install_ulysses` Ulysses' all-to-alls around it
    (UlyssesAttention.install_native), `uninstall` sends its calls back to Python."""

    def __init__(self, library: ctypes.CDLL):
        self.install = library.ts_install_paged_step
        self.install.argtypes = [ctypes.c_int, *[i64] * 17]
        self.install.restype = None
        self.uninstall = library.ts_uninstall_paged_step  # and Ulysses'
        self.uninstall.argtypes = []
        self.uninstall.restype = None
        # (communicator, SP, SP rank, counts, kv_send_index, its length, each head chunk's cache's K and V bases
        # or nulls): after `install`, Ulysses' all-to-alls around it, or where this rank holds every token and reads
        # every chunk's cache, its attention into each (UlyssesAttention.install_native)
        self.install_ulysses = library.ts_install_ulysses
        self.install_ulysses.argtypes = [i64, i64, i64, ptr, ptr, i64, ptr, ptr]
        self.install_ulysses.restype = None
        library.ts_register_attention.restype = ctypes.c_int
        if library.ts_register_attention() != 0:
            raise RuntimeError("PyTorch refused the C++ implementation of torch_shift::attention")


_native_attention: NativeAttention | None = None


class DecoderKernels:
    """The C++ decoder's entry points in the operator library (cpu_decoder.cpp; torch_shift.models.native_decoder)."""

    def __init__(self, library: ctypes.CDLL, silu_lanes: int):
        self.silu_lanes = silu_lanes  # bits: the widths of PyTorch's vectorised exp it can reproduce (16, 8)
        self.create = library.ts_decoder_create
        self.create.argtypes, self.create.restype = [ptr, ptr, i64, f32], ptr
        self.destroy = library.ts_decoder_destroy
        self.destroy.argtypes, self.destroy.restype = [ptr], None
        self.step = library.ts_decoder_step
        self.step.argtypes, self.step.restype = [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, ptr], ctypes.c_int
        self.steps = library.ts_decoder_steps
        self.steps.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, ptr,
                               ptr, i64, ctypes.c_int, ptr]
        self.steps.restype = ctypes.c_int
        self.attend = library.ts_decoder_attend
        self.attend.argtypes, self.attend.restype = [ptr], ctypes.c_int
        self.launch = library.ts_decoder_launch
        self.launch.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr]
        self.launch.restype = i64
        self.wait = library.ts_decoder_wait  # ctypes lets go of the GIL while it waits
        self.wait.argtypes, self.wait.restype = [ptr, i64], ctypes.c_int
        self.silu_mul = library.ts_decoder_silu_mul
        self.silu_mul.argtypes, self.silu_mul.restype = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, ptr], ctypes.c_int
        self.note_silu_lanes = library.ts_note_silu_lanes  # for the C++ torch_shift::cpu_silu_mul
        self.note_silu_lanes.argtypes, self.note_silu_lanes.restype = [ctypes.c_int, i64, ctypes.c_int], None
        self._collective_error = library.ts_collective_error  # why a step's all-reduce or all-to-all failed
        self._collective_error.argtypes, self._collective_error.restype = [], ctypes.c_char_p

    def collective_error(self) -> str:
        return self._collective_error().decode(errors="replace")


@lru_cache(maxsize=1)
def decoder_kernels() -> DecoderKernels | None:
    """The C++ decoder, or None where the operator library does not build or this CPU or torch cannot run it."""
    if not cpu_ops():
        return None
    _ops_library.ts_decoder_available.restype = ctypes.c_int
    silu_lanes = _ops_library.ts_decoder_available()
    return DecoderKernels(_ops_library, silu_lanes) if silu_lanes else None


def register_native_attention() -> bool:
    """Register the C++ implementation of `torch_shift::attention` for the CPU (once torch_shift.compilation has
    defined the operator and `torch_shift::attention_python`); False where the operator library does not build."""
    global _native_attention
    if _native_attention is None and cpu_ops():
        try:
            _native_attention = NativeAttention(_ops_library)
        except RuntimeError as e:
            warnings.warn(f"{e}: compiled forwards attend through Python, which is slower", RuntimeWarning,
                          stacklevel=2)
            return False
    return _native_attention is not None


# the operator library's registrations made (True) or refused by PyTorch (False), by its function's name
_registrations: dict[str, bool] = {}


def _register_once(function: str, refused: str, *args: int) -> bool:
    """Call the operator library's `function(*args)`, which registers C++ implementations of torch_shift's operators
    for the CPU (0: PyTorch took them), once per process; False where the library does not build or PyTorch refused
    them (warned once: `refused` says what then runs in Python)."""
    if function not in _registrations and cpu_ops():
        register = getattr(_ops_library, function)
        register.argtypes, register.restype = [ctypes.c_int] * len(args), ctypes.c_int
        _registrations[function] = register(*args) == 0
        if not _registrations[function]:
            warnings.warn(f"PyTorch refused torch_shift's C++ {refused}, which is slower", RuntimeWarning, stacklevel=3)
    return _registrations.get(function, False)


def register_native_elementwise(sum_lanes: int) -> bool:
    """Register the C++ implementations of `torch_shift::cpu_rms_norm`, `cpu_add_rms_norm`, `cpu_rotary` and
    `cpu_silu_mul` for the CPU (cpu_ops.cpp; once torch_shift.models.fused has defined them and their `_python`
    twins), RMSNorm summing in vectors of `sum_lanes` floats (0: RMSNorm stays in Python); False where the operator
    library does not build."""
    return _register_once("ts_register_elementwise", "elementwise operators: compiled forwards run them through "
                          "Python", sum_lanes)


def register_native_moe() -> bool:
    """Register the C++ implementation of `torch_shift::sparse_moe` for the CPU (cpu_ops.cpp; once
    torch_shift.models.moe has defined it and its `_python` twin, which serves experts that are not packed); False
    where the operator library does not build."""
    return _register_once("ts_register_moe", "torch_shift::sparse_moe: mixtures of experts route and run their "
                          "experts through Python")


def register_native_all_reduce(communicator_id: int, segment: int, rank: int, world_size: int, slot_bytes: int,
                               header_bytes: int, row_words: int, first_parity_word: int, parity_words: int,
                               counters: int, signatures: tuple[int, int, int, int, int, int]) -> bool:
    """Serve `torch_shift::shm_all_reduce` of communicator `communicator_id` in C++ on the CPU (cpu_ops.cpp),
    Ulysses' all-to-alls of a compiled forward (install_ulysses) and the C++ decoder's collectives, from its segment's
    layout (torch_shift.parallel.shm), the address of its [step, collectives] counters and its `signatures`
    (all_reduce's, all_to_all's, then all_gather's, in float32 and bfloat16); False where the operator library does
    not build."""
    if not _register_once("ts_register_all_reduce", "torch_shift::shm_all_reduce: compiled forwards run it through "
                          "Python"):
        return False
    lib = _ops_library
    lib.ts_shm_register.argtypes, lib.ts_shm_register.restype = [i64] * 16, None
    lib.ts_shm_unregister.argtypes, lib.ts_shm_unregister.restype = [i64], None
    lib.ts_shm_register(communicator_id, segment, rank, world_size, slot_bytes, header_bytes, row_words,
                        first_parity_word, parity_words, counters, *signatures)
    return True


def unregister_native_all_reduce(communicator_id: int) -> None:
    """Calls of communicator `communicator_id` go to Python from now on (it closed, or failed); after a
    registration (register_native_all_reduce)."""
    _ops_library.ts_shm_unregister(communicator_id)


def native_attention() -> NativeAttention | None:
    """The registered C++ attention implementation, or None (nothing compiled on the CPU yet, or no library)."""
    return _native_attention
