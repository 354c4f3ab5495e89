"""The memory budget: what loaded model copies cost, measured, admitted and given back.

On a small device memory runs out before compute does. Every instance's cost is
measured when it is created, on its own worker thread: the growth of the process's
resident memory while the engine loads and its warm-up runs, plus the growth of
its GPU memory where NVML can see one.

For those figures to mean anything, and for an unloaded model's memory to really
go back to the OS, the allocator (glibc) is steered: while an instance is built,
blocks of 128 KiB and more get their own mappings (weights: freed, they are
unmapped at once) and freed heap pages are handed back (``malloc_trim``) before
and after; otherwise a new model would fill holes an unloaded one left and
appear to cost nothing, and fragments would keep the process big. While serving,
big blocks come from the heap as glibc's own heuristics would have them (up to
32 MiB), because a fresh mapping per request costs page faults (on the test VM
a 4.8 MiB batch took 3.7 ms instead of 0.25 ms). On other C libraries all of
this is skipped and the figures are rougher.

The budget counts model memory only (the sum of the measured costs of the loaded
copies), not the server's own baseline. Ownership: :class:`MemoryBudget` belongs
to the model lifecycle and is only touched on the event loop; a copy's charge is
held under an owner token from admission until that copy has unloaded.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from appliance.backends.base import release_memory
from appliance.errors import ApplianceError, Code

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 2**20


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes held in process (CPU) memory and in GPU memory."""

    cpu: int = 0
    gpu: int = 0

    @property
    def total(self) -> int:
        return self.cpu + self.gpu

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.cpu + other.cpu, self.gpu + other.gpu)

    def at_least(self, other: Usage) -> Usage:
        return Usage(max(self.cpu, other.cpu), max(self.gpu, other.gpu))

    def json(self) -> list[dict[str, Any]]:
        """Triton's ``memory_usage`` list (statistics)."""
        rows = [{"type": "CPU", "id": 0, "byte_size": self.cpu}]
        if self.gpu:
            rows.append({"type": "GPU", "id": 0, "byte_size": self.gpu})
        return rows


NOTHING = Usage()


def fmt(n: int | None) -> str:
    return "unlimited" if n is None else f"{n / MiB:.1f} MiB"


# ---- probes -----------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    # glibc only: musl and macOS lack malloc_trim
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    libc.malloc.restype = ctypes.c_void_p  # (a pointer, not ctypes' default int)
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


_LIBC = _glibc()
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LOADING_MMAP = 128 * 1024  # glibc's own starting value
_SERVING_MMAP = 32 * MiB  # what glibc's dynamic threshold grows to at most on 64-bit
_SERVING_TRIM = 2 * _SERVING_MMAP  # as glibc pairs them; trimming is explicit (trim())


_STEERING = threading.Lock()  # the allocator's thresholds are changed under it
_loading = False  # the thresholds are the loading ones


def trim() -> None:
    """Return freed heap pages to the OS (blocking; run it on a worker thread)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def trim_thread_heap() -> None:
    """Return the free top of the calling thread's own heap to the OS.

    glibc gives a busy thread an arena of its own (an instance's thread: its batches'
    concatenated inputs and the engine's buffers live there), and ``malloc_trim``
    trims the main heap's top only; another heap's top is trimmed when a block of at
    least 64 KiB is freed on it while the top is over the trim threshold, which is
    high while serving. So: the threshold lowered for one such free, on this thread."""
    if _LIBC is None:
        return
    with _STEERING:
        _LIBC.mallopt(_M_TRIM_THRESHOLD, _LOADING_MMAP)
        try:
            block = _LIBC.malloc(2 * _LOADING_MMAP)  # below the mmap threshold: this heap
            _LIBC.free(block)
        finally:
            _LIBC.mallopt(_M_TRIM_THRESHOLD, _LOADING_MMAP if _loading else _SERVING_TRIM)


def hand_back(backend: object) -> None:
    """After a burst, on an instance's thread between batches: the engine's working
    memory (:func:`appliance.backends.base.release_memory`), then the thread's heap."""
    release_memory(backend)
    trim_thread_heap()


def _allocator(loading: bool) -> None:
    global _loading
    if _LIBC is not None:
        with _STEERING:
            _loading = loading
            _LIBC.mallopt(_M_MMAP_THRESHOLD, _LOADING_MMAP if loading else _SERVING_MMAP)
            _LIBC.mallopt(_M_TRIM_THRESHOLD, _LOADING_MMAP if loading else _SERVING_TRIM)


class _Nvml:
    """This process's GPU memory through NVML, when pynvml and a GPU are there."""

    def __init__(self) -> None:
        self._pynvml: Any = None
        self._tried = False

    def used(self) -> int:
        if not self._tried:
            self._tried = True
            try:
                import pynvml  # optional: nvidia-ml-py

                pynvml.nvmlInit()
                self._pynvml = pynvml
            except Exception:  # no package, no driver, no GPU: GPU memory reads 0
                self._pynvml = None
        nvml = self._pynvml
        if nvml is None:
            return 0
        total = 0
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == os.getpid() and proc.usedGpuMemory:
                        total += int(proc.usedGpuMemory)
        except Exception:
            return 0
        return total


_NVML = _Nvml()


def measure(fn: Callable[..., T], *args: Any) -> tuple[T, Usage]:
    """Call ``fn(*args)`` and return its result with the memory growth it caused.

    Blocking: run it on the worker thread that owns what ``fn`` builds. The figure
    is process-wide, so concurrent allocations elsewhere blur it; the lifecycle
    measures one instance at a time (:meth:`MemoryBudget.measuring`).
    """
    _allocator(loading=True)
    # no garbage collection while measuring: a collection that frees what an earlier
    # copy left in reference cycles (a swapped-out session, a stopped server) would be
    # subtracted from this copy's cost, which then measures near zero
    collecting = gc.isenabled()
    gc.disable()
    try:
        trim()
        cpu, gpu = rss_bytes(), _NVML.used()
        result = fn(*args)
        trim()  # what fn freed again (parsed protobufs, copies) is not its cost
        return result, Usage(max(0, rss_bytes() - cpu), max(0, _NVML.used() - gpu))
    finally:
        if collecting:
            gc.enable()
        _allocator(loading=False)


# ---- the budget ---------------------------------------------------------------------------


class BudgetRefused(ApplianceError):
    """A load the memory budget cannot hold (INVALID_ARG; nothing serving changed)."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.INVALID_ARG, message)


class MemoryBudget:
    """Charges of loaded model copies against an optional global limit.

    Each copy's charge is held under an owner token (any hashable object) with its
    model name; :meth:`release` gives it back once the copy has unloaded. The
    measured cost of each model version is remembered to estimate the next load.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._charges: dict[object, tuple[str, Usage]] = {}
        self._costs: dict[tuple[str, int], tuple[Usage, Usage, int]] = {}
        self._lock: asyncio.Lock | None = None

    def measuring(self) -> asyncio.Lock:
        """Held while instances are created and measured: RSS is process-wide, so two
        loads measuring at once would each count the other's memory."""
        if self._lock is None:  # created on first use, inside the running loop
            self._lock = asyncio.Lock()
        return self._lock

    @property
    def used(self) -> int:
        return sum(u.total for _, u in self._charges.values())

    def free(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def model_usage(self, model: str) -> int:
        return sum(u.total for m, u in self._charges.values() if m == model)

    def charge(self, owner: object, model: str, usage: Usage) -> None:
        """Add ``usage`` to ``owner``'s charge (admission adds instance by instance)."""
        _, held = self._charges.get(owner, (model, Usage()))
        self._charges[owner] = (model, held + usage)

    def release(self, owner: object) -> None:
        self._charges.pop(owner, None)

    def remember(self, model: str, version: int, first: Usage, extra: Usage, count: int) -> None:
        """The measured cost of a copy: its first instance, each further one, how many."""
        self._costs[(model, version)] = (first, extra, count)

    def estimate(self, model: str, version: int) -> tuple[Usage, Usage, int] | None:
        """The last measured cost of ``model`` ``version``, else of its newest version."""
        known = self._costs.get((model, version))
        if known is None:
            others = sorted(v for m, v in self._costs if m == model)
            known = self._costs[(model, others[-1])] if others else None
        return known

    def swap_shortfall(self, model: str, versions: list[int], instance_count: int) -> str:
        """Why the budget cannot hold a new copy of ``model`` next to the old one ("" if
        it can), estimated from what the model's copies measured before."""
        free = self.free()
        if free is None:
            return ""
        needed = 0
        for v in versions:
            known = self.estimate(model, v)
            if known is not None:
                first, extra, count = known
                needed += first.total + extra.total * (min(count, instance_count) - 1)
        if needed <= free:
            return ""
        return (
            f"model '{model}': the new copy needs about {fmt(needed)} (as measured "
            f"before), but the memory budget is {fmt(self.limit)} with "
            f"{fmt(self.used)} in use, {fmt(max(0, free))} free"
        )

    def report(self) -> dict[str, Any]:
        return {"limit": self.limit, "used": self.used}


class Admission:
    """One copy's claim on the budget while its instances are created.

    ``cap`` is the model's own limit for one copy (``parameters.memory_limit``).
    Each admitted instance is charged to the budget at once, so a concurrent load
    of another model sees it. On failure the caller releases ``owner``.
    """

    def __init__(self, budget: MemoryBudget, model: str, cap: int | None) -> None:
        self.budget = budget
        self.model = model
        self.cap = cap
        self.owner = object()
        self.held = Usage()

    def room(self) -> int | None:
        free = self.budget.free()
        if self.cap is not None:
            left = self.cap - self.held.total
            free = left if free is None else min(free, left)
        return free

    def fits(self, cost: int) -> bool:
        room = self.room()
        return room is None or cost <= room

    def add(self, usage: Usage) -> None:
        self.held = self.held + usage
        self.budget.charge(self.owner, self.model, usage)

    def refusal(self, what: str, needed: int) -> str:
        """The error text when ``what`` (costing ``needed``) does not fit."""
        b = self.budget
        parts = []
        if b.limit is not None:
            parts.append(
                f"the memory budget is {fmt(b.limit)}, {fmt(b.used)} in use, "
                f"{fmt(max(0, b.limit - b.used))} free"
            )
        if self.cap is not None:
            parts.append(
                f"the model's own limit (parameters.memory_limit) is {fmt(self.cap)}"
                + (f", {fmt(self.held.total)} already admitted" if self.held.total else "")
            )
        return f"model '{self.model}': {what} needs {fmt(needed)}, but " + " and ".join(parts)
