"""Host and device allocator settings for the processes a strategy owns: resident memory the OS sees.

**Host (glibc malloc).** A tensor's CPU storage comes from ``malloc``. glibc serves a request at
or above its *mmap threshold* (128 KiB at start) with a fresh ``mmap`` that ``free`` returns to
the system at once; smaller ones come from the heap and its per-thread arenas, whose freed memory
stays resident until the top of the heap is free (``M_TRIM_THRESHOLD``). The threshold is
*dynamic*: each ``free`` of an mmapped chunk larger than it raises it to that chunk's size (up to
32 MiB on 64-bit), and the trim threshold to twice that. Parallel training frees large buffers
every layer (FSDP2's per-unit all-gather outputs and reduce-scatter inputs, pipeline send and
receive buffers, activations): after the first of them, every later buffer up to 32 MiB comes from
the heap, and once freed stays resident, fragmented between live tensors. Measured on a 32-block
GPT (386 MiB of fp32 parameters P), 4 CPU ranks, ``zero3``: peak RSS growth per rank 4.2 P with
the default allocator, 0.72 P with the thresholds pinned (``benchmarks/bench_memory.py``).

Setting either threshold with ``mallopt`` turns the dynamic adjustment off (glibc's documented
behaviour; the same as ``MALLOC_MMAP_THRESHOLD_`` in the environment, which users do not set).
:func:`pin_host_allocator` pins both at 128 KiB, glibc's own starting value, in the calling process,
unless the user set either variable (their choice wins). Cost: a large buffer is a fresh ``mmap``
whose pages fault in on first touch, instead of recycled heap memory. The buffers the strategy
allocates every unit are therefore not allocated again: FSDP2's all-gather outputs come from a pool
(``parallel/data/host_buffers.py``) and gloo's internal copies are avoided
(``parallel/data/fsdp_host.py``), pipeline stages add each microbatch's weight gradient into
``.grad`` in its GEMM (``parallel/pipeline/grad_accumulation.py``). What is left is autograd's own
temporaries (activations, gradients); ``benchmarks/bench_memory.py`` prints the step-time ratio
against the code before any of this (``--compare-before``) and against the same code with the
dynamic threshold (``--compare-unpinned``). Where the C library is not glibc (macOS, musl) nothing
is done.

**Host huge pages.** A fresh ``mmap`` costs its page faults: one per 4 KiB page, each zeroed
(2.5 GB/s, one process, 12 MiB buffers). torch's CPU allocator can ask for transparent huge pages
instead: with ``THP_MEM_ALLOC_ENABLE=1`` in the environment, a tensor of 2 MiB or more is page-aligned
and ``madvise(MADV_HUGEPAGE)``'d, so one fault maps each whole 2 MiB-aligned range inside it (7.5
GB/s, same buffers). Those are the unsharded parameters, gradients and reduce-scatter inputs of
every FSDP2 unit, the buffers left after the pool (``zero3``'s step 1.13x -> 1.01-1.07x that before
issue 29's measures, ``docs/memory.md``). torch reads the variable once, at its first CPU allocation, so
:func:`advise_host_huge_pages` runs when ``lightning_parallel`` is imported, before it imports
Lightning (whose import allocates): it covers the importing process if nothing allocated before,
and always the ranks Lightning's launcher starts, which inherit the environment.
:func:`host_huge_pages_active` says whether this process got them (a 2 MiB tensor is page-aligned
only then). Not set where the kernel has no transparent huge pages or has them ``never``, nor when
the user set the variable (``THP_MEM_ALLOC_ENABLE=0`` turns it off). Huge pages map only whole
2 MiB-aligned ranges inside a tensor, so a tensor written whole is resident as before (one touched
here and there becomes resident 2 MiB at a time).

**Device (CUDA caching allocator).** ``expandable_segments:True`` lets the caching allocator grow
one mapped segment instead of keeping many fixed-size blocks, which cuts the fragmentation that
makes ``max_memory_reserved`` exceed ``max_memory_allocated`` when buffer sizes vary step to step
(FSDP2 units, pipeline microbatches). torchtitan sets it for every run
(``PYTORCH_ALLOC_CONF="expandable_segments:True"`` in its ``run_train.sh``); here
:func:`expandable_cuda_segments` sets it in the strategy's process before its first CUDA
allocation, unless the user configured the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import linecache
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter numbers (glibc ``malloc.h``)."""

HOST_THRESHOLD_BYTES = 128 * 1024
"""glibc's initial mmap threshold, held fixed instead of rising with the largest buffer freed."""

USER_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"
"""torch's switch (``c10/core/impl/alloc_cpu.cpp``): CPU tensors of 2 MiB or more page-aligned and huge-page-advised."""
HUGE_PAGE_BYTES = 2 * 1024 * 1024
PAGE_BYTES = 4096
KERNEL_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CUDA_ALLOC_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@lru_cache(maxsize=1)
def _glibc() -> Any | None:
    """The process's C library if it is glibc (has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def pin_host_allocator(threshold: int = HOST_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap and trim thresholds in this process (see the module doc); True if pinned.

    Not pinned (False): not glibc, or the user set ``MALLOC_*`` / ``GLIBC_TUNABLES`` themselves."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in USER_MALLOC_VARIABLES):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))


def advise_host_huge_pages() -> bool:
    """Ask torch for huge pages on large CPU tensors (see the module doc); True if the variable was set here.

    Called at ``import lightning_parallel``, before anything of ours allocates: torch reads the
    variable at its first CPU allocation, and child processes inherit it."""
    if HUGE_PAGES_VARIABLE in os.environ or not kernel_offers_huge_pages():
        return False
    os.environ[HUGE_PAGES_VARIABLE] = "1"
    return True


def kernel_offers_huge_pages() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` can give huge pages here: Linux with transparent huge
    pages in the kernel, not set to ``never``."""
    try:
        return "[never]" not in KERNEL_HUGE_PAGES.read_text()
    except OSError:  # not Linux, or a kernel without transparent huge pages
        return False


def host_huge_pages_active() -> bool:
    """Whether torch advises huge pages for this process's large CPU tensors. It then aligns them to
    the page (to ``madvise`` them) instead of 64 bytes; two probes held at once, so that 64-byte
    aligned heap memory passes by chance with odds of 1 in 4096."""
    probes = [torch.empty(HUGE_PAGE_BYTES + extra, dtype=torch.uint8) for extra in (0, PAGE_BYTES)]
    return all(probe.data_ptr() % PAGE_BYTES == 0 for probe in probes)


def huge_pages_missed(active: bool) -> str | None:
    """What to tell the user when this process asked for huge pages too late, else None; ``active``
    is :func:`host_huge_pages_active` (``configure_allocators`` has probed it already).

    The usual case: a script that imports Lightning before ``lightning_parallel`` (isort's order)
    runs rank 0 without them, while the ranks Lightning starts have them from the environment."""
    if os.environ.get(HUGE_PAGES_VARIABLE) != "1" or active:
        return None
    return (f"this process has no transparent huge pages for large CPU tensors: torch allocated before "
            f"`import lightning_parallel` set {HUGE_PAGES_VARIABLE}=1, and reads it only then. Import "
            f"lightning_parallel before lightning, or export {HUGE_PAGES_VARIABLE}=1 for the job: without them "
            f"each fresh CPU buffer of 2 MiB or more faults in 4 KiB at a time (zero3's CPU step about 10% slower, "
            f"docs/memory.md).")


def release_host_memory() -> bool:
    """Collect garbage and hand the heap's free pages back to the system (glibc ``malloc_trim``).

    For the moments a phase's temporaries have just died (after set-up, between measurements): small
    freed allocations stay resident in the heap even with the thresholds pinned. False where not glibc."""
    gc.collect()
    linecache.clearcache()  # source lines torch.export reads for its stack traces (MiBs after tracing a model)
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def expandable_cuda_segments() -> bool:
    """Turn on the CUDA caching allocator's expandable segments unless the user configured the
    allocator (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``); True if set here.

    The caching allocator reads the variable when it is first used, so this is called before the
    strategy's first CUDA allocation (``setup_environment``, before the process group exists); child
    processes inherit it. Only the variable is set: the runtime setter torch has is private
    (``torch._C._accelerator_setAllocatorSettings``) and not needed before that first allocation."""
    if not torch.cuda.is_available() or any(name in os.environ for name in CUDA_ALLOC_VARIABLES):
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def configure_allocators(device_type: str) -> dict[str, bool]:
    """What a strategy calls once per process at set-up: the host allocator always (CPU tensors and
    a GPU job's host staging both live there), the CUDA one on CUDA. Returns what was changed."""
    return {"host_thresholds_pinned": pin_host_allocator(), "host_huge_pages": host_huge_pages_active(),
            "cuda_expandable_segments": device_type == "cuda" and expandable_cuda_segments()}
