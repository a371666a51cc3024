"""dcp.async_save's staging copy: DCP's buffers, with huge pages asked for."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter
from kvckpt.staging import advise_huge_pages, local_tensors

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def smaps(t: torch.Tensor, field: str) -> list[int]:
    """``field`` of each mapping that holds part of ``t``'s memory, from /proc/self/smaps (an
    madvise on part of a mapping splits it, so there may be several)."""
    start, end = t.data_ptr(), t.data_ptr() + t.nbytes
    found, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == f"{field}:":
            found.append(int(line.split()[1]))
    return found


def anon_huge_kib(t: torch.Tensor) -> int:
    return sum(smaps(t, "AnonHugePages"))


def kernel_gives_huge_pages() -> bool:
    """Whether an madvised, touched 8 MiB region gets huge pages here and now."""
    if not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text():
        return False
    region = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    region.write(b"\1" * (8 << 20))
    return anon_huge_kib(torch.frombuffer(region, dtype=torch.uint8)) > 0


def test_local_tensors_walks_nested_state_dicts() -> None:
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    sd = {"x": a, "opt": {"state": [b, (c, 7)], "lr": 0.1}, "name": "m"}
    assert [t.numel() for t in local_tensors(sd)] == [1, 2, 3]


def test_staging_copy_asks_for_huge_pages(tmp_path: Path) -> None:
    """The staged copy of a large tensor lands on huge pages where the kernel offers them, and
    is bit-exact; the async save made from it loads back."""
    # 80 MiB: above glibc's largest mmap threshold (32 MiB), so the staging buffer is fresh
    # memory even in a long test run (a smaller one may reuse pages an earlier test touched)
    sd = {"big": torch.randn(20 << 20), "small": torch.arange(10), "nested": [torch.ones(3)]}
    writer = KVStorageWriter(f"lmdb://{tmp_path / 's'}", huge_pages=True)
    staged = writer.stage(sd)
    pairs = zip(local_tensors(sd), local_tensors(staged), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    assert staged["big"].data_ptr() != sd["big"].data_ptr()
    if sys.platform.startswith("linux"):
        assert advise_huge_pages({"t": torch.empty(8 << 20)}) > 0
    if kernel_gives_huge_pages():
        # The hint reached the staging buffer's mapping. (Whether its pages then are huge also
        # depends on the memory being fresh and on free 2 MiB blocks: late in a long test run
        # the allocator may hand out pages an earlier test touched.)
        assert 1 in smaps(staged["big"], "THPeligible")
    fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id="a")
    getattr(fut, "upload_completion", fut).result()
    out = {
        "big": torch.zeros(20 << 20),
        "small": torch.zeros(10, dtype=torch.long),
        "nested": [torch.zeros(3)],
    }
    dcp.load(out, storage_reader=KVStorageReader(f"lmdb://{tmp_path / 's'}"), checkpoint_id="a")
    pairs = zip(local_tensors(sd), local_tensors(out), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_advice_skips_what_it_cannot_use() -> None:
    """Small tensors and GPU tensors are left alone; only whole 2 MiB pages are advised."""
    assert advise_huge_pages({"t": torch.empty(1000)}) == 0
    n = advise_huge_pages({"t": torch.empty((5 << 20) // 4)})  # 5 MiB: 1 or 2 whole pages
    assert n in (2 << 20, 4 << 20)


def test_huge_pages_off_by_default_is_dcp_staging(tmp_path: Path) -> None:
    """Without huge_pages the staging buffer's mapping gets no hint. Checked in a fresh process:
    late in a long test run the allocator may place a buffer in memory an earlier test advised."""
    import subprocess

    if not kernel_gives_huge_pages() or "[always]" in THP.read_text():
        pytest.skip("needs THP in madvise mode")
    script = f"""
import torch
from kvckpt import KVStorageWriter
from tests.test_staging import smaps
staged = KVStorageWriter("lmdb://{tmp_path / "s"}").stage({{"big": torch.randn(20 << 20)}})
print(smaps(staged["big"], "THPeligible"))
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1" not in out.stdout.strip().splitlines()[-1], out.stdout
