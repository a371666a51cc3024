"""The benchmarks' state dicts: how they are made, split into parts, zeroed and compared
(the bottom of ``benchmarks/run.py``'s modules; ``job.py``, ``gpu.py`` and
``redis_ceiling.py`` use it too)."""

from __future__ import annotations

import torch

KIB, MIB = 1 << 10, 1 << 20


def make_state_dict(total_bytes: int) -> dict[str, torch.Tensor]:
    """~50-64 fp32 tensors from 4 KiB up to 128 MiB (or total/8), `total_bytes` in all."""
    largest = max(4 * KIB, min(128 * MIB, total_bytes // 8))
    sizes = []
    size = 4 * KIB
    while size <= largest:
        sizes.append(size)
        size *= 2
    repeat = max(1, round(total_bytes / sum(sizes)))
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{r}.t{i}": torch.rand(n // 4, generator=gen)
        for r in range(repeat)
        for i, n in enumerate(sizes)
    }


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def zeros_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    for t in out.values():
        t.zero_()  # touch the pages: a preallocated, warm destination
    return out


def zero(sd: dict[str, torch.Tensor]) -> None:
    for t in sd.values():
        t.zero_()


def check(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        if not torch.equal(a[k], b[k]):
            raise AssertionError(f"benchmark round trip differs at {k}")


def tensor_parts(sd: dict[str, torch.Tensor], part: int) -> list[tuple[bytes, memoryview]]:
    """``(key, bytes)`` of each ``part``-byte piece of each tensor, keyed ``raw/NAME/I``."""
    items = []
    for name, t in sd.items():
        view = t.reshape(-1).view(torch.uint8).numpy().data
        for i, start in enumerate(range(0, len(view), part)):
            items.append((f"raw/{name}/{i}".encode(), view[start : start + part]))
    return items
