"""torch's huge-page advice for large CPU tensors (issue 29's step time, ``parallel/allocator.py``).

torch reads ``THP_MEM_ALLOC_ENABLE`` once, at a process's first CPU allocation, so whether a process
got huge pages depends on when ``import lightning_parallel`` ran: checked in fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parallel.parallel import allocator

PROBE = ("import json; from lightning_parallel.parallel.allocator import host_huge_pages_active, huge_pages_missed; "
         "import os; active = host_huge_pages_active(); "
         "print(json.dumps([os.environ.get('THP_MEM_ALLOC_ENABLE'), active, huge_pages_missed(active)]))")


def test_advice_is_set_once_and_leaves_the_users_choice_and_the_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    modes = tmp_path / "enabled"
    monkeypatch.setattr(allocator, "KERNEL_HUGE_PAGES", modes)
    monkeypatch.delenv(allocator.HUGE_PAGES_VARIABLE, raising=False)
    assert not allocator.advise_host_huge_pages()  # no such file: not Linux, or no THP in the kernel
    modes.write_text("always madvise [never]\n")
    assert not allocator.kernel_offers_huge_pages()
    assert not allocator.advise_host_huge_pages() and allocator.HUGE_PAGES_VARIABLE not in os.environ
    modes.write_text("always [madvise] never\n")
    assert allocator.kernel_offers_huge_pages()
    assert allocator.advise_host_huge_pages() and os.environ[allocator.HUGE_PAGES_VARIABLE] == "1"
    monkeypatch.setenv(allocator.HUGE_PAGES_VARIABLE, "0")
    assert not allocator.advise_host_huge_pages() and os.environ[allocator.HUGE_PAGES_VARIABLE] == "0"
    assert allocator.huge_pages_missed(active=False) is None  # the user turned them off: nothing to tell


@pytest.mark.skipif(not allocator.kernel_offers_huge_pages(), reason="needs Linux with transparent huge pages")
def test_import_order_decides_and_a_late_import_is_told() -> None:
    env = {k: v for k, v in os.environ.items() if k != allocator.HUGE_PAGES_VARIABLE}
    runs = {name: subprocess.Popen([sys.executable, "-c", first + PROBE], env=env | extra, stdout=subprocess.PIPE, text=True)
            for name, first, extra in (("first", "import lightning_parallel; ", {}),
                                       ("late", "import lightning.pytorch, lightning_parallel; ", {}),
                                       ("user off", "import lightning_parallel; ", {allocator.HUGE_PAGES_VARIABLE: "0"}))}
    out = {name: json.loads(run.communicate(timeout=120)[0].strip().splitlines()[-1]) for name, run in runs.items()}
    assert out["first"] == ["1", True, None]
    variable, active, missed = out["late"]  # Lightning's import allocated: torch had read the variable already
    assert variable == "1" and not active and "Import lightning_parallel before lightning" in missed
    assert out["user off"] == ["0", False, None]
