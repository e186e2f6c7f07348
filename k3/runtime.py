"""Process-level settings that make PyTorch's CPU paths fast on Linux, and the machine's measured matmul
throughput (`matmul_gflops`, which `k3 train` prints and the benchmarks set their figures beside), and
its memory (`available_memory`), against which sizes that cannot fit are refused before allocating
(`refuse_if_over_memory`).

`keep_freed_memory()`: PyTorch's CPU allocator hands every tensor to malloc. glibc serves blocks of a
megabyte or more with fresh pages (mmap, or a heap it trims back to the OS on every free), so each new
temporary of that size is page-faulted in again, 256 faults per MB. The chunked mixers create dozens
of such temporaries per slab; on a small CPU the faults can cost more than the arithmetic
(docs/benchmarks.md). Raising glibc's mmap and trim thresholds makes malloc keep and reuse freed memory
instead — what PyTorch's CPU tuning guide gets by preloading jemalloc or tcmalloc.

The `k3` command calls it at start (set K3_KEEP_FREED_MEMORY=0 to opt out: 0/1, true/false, on/off and
yes/no are read, anything else refused naming the variable); library users may call it themselves. It
changes the whole process's malloc policy, so the library never calls it on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import sys
import time

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from (and go back to) the heap, which is never trimmed


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep freed memory for reuse instead of returning it to the OS.

    Returns True when the setting was applied, False where it does not apply (not Linux/glibc) or was
    refused by the environment variable K3_KEEP_FREED_MEMORY=0 (or false, off, no); a value that is no
    such switch is a ValueError naming it. Safe to call more than once."""
    if not env_switch("K3_KEEP_FREED_MEMORY", default=True) or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))


SWITCH_VALUES = {
    "1": True,
    "true": True,
    "on": True,
    "yes": True,
    "0": False,
    "false": False,
    "off": False,
    "no": False,
}


def env_switch(name: str, default: bool) -> bool:
    """The on/off environment variable `name` (1/0, true/false, on/off, yes/no, any case; unset or empty:
    `default`); any other value is a ValueError naming the variable, not a silent "on"."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in SWITCH_VALUES:
        raise ValueError(
            f"the environment variable {name} must be 1 or 0 (or true/false, on/off, yes/no), got {os.environ[name]!r}"
        )
    return SWITCH_VALUES[value]


def best_time(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Fastest of `repeats` runs of fn() after `warmup` runs, in seconds, without autograd (the minimum
    is the least noisy estimate on a shared machine)."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(n: int = 1024, batch: int | None = None, size: int = 64, repeats: int = 5) -> float:
    """Measured float32 matmul throughput in GFLOP/s on torch's current threads: one n x n x n GEMM, or
    `batch` size^3 GEMMs when given; the fastest of `repeats` runs after one warm-up."""
    if batch is None:
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n**3
    else:
        a, b = torch.randn(batch, size, size), torch.randn(batch, size, size)
        flops = 2 * batch * size**3
    return flops / best_time(lambda: a @ b, repeats=repeats) / 1e9


def machine_speed_words(device: torch.device) -> str:
    """What `k3 train`'s header says of the machine it trains on: the CPU's float32 matmul (1024^3) GFLOP/s
    on torch's threads, or for a GPU its name, memory and own float32 and bfloat16 matmul speeds (4096^3:
    a 1024^3 GEMM is too small to fill one), so that runs on different machines compare."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"this machine's float32 matmul (1024^3): {matmul_gflops():.0f} GFLOP/s"
    props = torch.cuda.get_device_properties(device)
    speeds = []
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(4096, 4096, device=device, dtype=dtype)
        b = torch.randn(4096, 4096, device=device, dtype=dtype)

        def run():
            a @ b
            torch.cuda.synchronize(device)

        speeds.append(2 * 4096**3 / best_time(run, repeats=5) / 1e12)
    return (
        f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB; its matmul (4096^3): float32 "
        f"{speeds[0]:.1f} TFLOP/s, bfloat16 {speeds[1]:.1f} TFLOP/s"
    )


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would build its kernels with: $CXX, else
    g++, c++ or clang++ on the PATH; None if there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def check_compiler(device="cpu", what: str = "compile") -> None:
    """The one-line error for compiling for a CPU without a C++ compiler (inductor builds C++ kernels)."""
    import torch

    if torch.device(device).type == "cpu" and cxx_compiler() is None:
        raise ValueError(
            f"{what}: torch.compile builds C++ kernels for the CPU and no C++ compiler was found "
            f"(install g++ or set $CXX), or run without compiling"
        )


def available_memory() -> int | None:
    """The memory this process can have now, in bytes: Linux's MemAvailable (free memory and caches it
    can drop), else the machine's RAM, capped by a cgroup (container) limit; None where the system does
    not say."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) on Linux: the kernel sends `sig` to this process when the thread that
    started it exits (whatever this process is doing, even inside a long C call). Whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_launcher() -> bool:
    """Under torchrun (TORCHELASTIC_RUN_ID set), end this worker with SIGTERM when its launcher dies,
    `kill -9` included, instead of training on as an orphan: torchrun's agent starts its workers from its
    main thread, which lives as long as the agent. A launcher already gone (this process re-parented to
    init) ends it at once. Whether the signal is set (Linux only)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not parent_death_signal(signal.SIGTERM):
        return False
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def refuse_if_over_memory(what: str, nbytes: int, fix: str) -> None:
    """ValueError when `nbytes`, the estimated memory of `what`, is more than this machine has: refused
    before anything is allocated, instead of an allocator's abort or a machine that swaps to a halt."""
    total = available_memory()
    if total is not None and nbytes > total:
        raise ValueError(
            f"{what} needs about {nbytes / 2**30:,.1f} GiB ({nbytes:,} bytes), more than the "
            f"{total / 2**30:,.1f} GiB of memory available on this machine; {fix}"
        )


DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """The device `name` stands for (`k3 train` and `k3 generate --device`): "auto" picks a CUDA GPU, then
    Apple's MPS, then the CPU; a device this machine's PyTorch cannot use is a ValueError naming `flag`."""
    if name not in DEVICES:
        raise ValueError(f"{flag} must be one of {', '.join(DEVICES)}, got {name!r}")
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if cuda else "mps" if mps else "cpu")
    if name == "cuda" and not cuda:
        raise ValueError(
            f"{flag} cuda: this PyTorch sees no CUDA GPU (torch.cuda.is_available() is False: no GPU, "
            f"no driver, or a CPU-only build of torch {torch.__version__}); use {flag} cpu or auto"
        )
    if name == "mps" and not mps:
        raise ValueError(
            f"{flag} mps: Apple's MPS is not available here (torch.backends.mps.is_available() is "
            f"False: it needs a Mac with Apple silicon and macOS 12.3+); use {flag} cpu or auto"
        )
    return torch.device(name)
