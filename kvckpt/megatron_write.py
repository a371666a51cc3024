"""How one rank's part of a Megatron save is written apart from its planning
(``kvckpt.megatron.KVSaveShardedStrategy.async_save``): the writer that remembers the final plan,
the staged copy, and the write job Megatron runs on a thread, in a forked process or in a
persistent worker, whose results reach the process that commits.

Nothing here imports Megatron: the job is a plain picklable callable.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import uuid
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .errors import KVCheckpointError
from .keys import ItemLocation
from .writer import KVStorageWriter


class PlannedWriter(KVStorageWriter):
    """``KVStorageWriter`` plus the step Megatron's async planner ends with: it remembers the
    final plan and what each item will write (resolved, not yet copied)."""

    plan: SavePlan
    resolved: list[tuple[MetadataIndex, Any]]

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        self.plan = plan
        self.resolved = [(item.index, planner.resolve_data(item)) for item in plan.items]
        # write_data records this where it runs; here that may be another process, and the
        # commit (finish) still has to notice a store that restarted since planning.
        self._session = plan.storage_data.session


class Resolved:
    """The one planner call ``KVStorageWriter.write_data`` makes, answered from data resolved
    (and maybe staged) earlier in the process that planned."""

    def __init__(self, items: list[tuple[MetadataIndex, Any]]) -> None:
        self._data = dict(items)

    def resolve_data(self, item: WriteItem) -> Any:
        return self._data[item.index]


def stage(items: list[tuple[MetadataIndex, Any]]) -> list[tuple[MetadataIndex, Any]]:
    """Copies of what a save writes, taken before training goes on: the write then runs on a
    thread or in another process while the parameters change (on a GPU, this is the D2H copy)."""
    staged: list[tuple[MetadataIndex, Any]] = []
    for index, data in items:
        if isinstance(data, torch.Tensor):
            data = data.detach().to("cpu", copy=True)
        elif isinstance(data, io.BytesIO):
            data = data.getvalue()
        staged.append((index, data))
    return staged


class WriteJob:
    """The write of one rank's part of a save: Megatron's ``AsyncRequest.async_fn``.

    Megatron runs it in the saving process (``execute_sync``), in a forked process
    (``TemporalAsyncCaller``) or in a persistent worker it was pickled to. The results (sizes,
    checksums) must reach the process that commits: in the same process they stay on this
    object; from another process they come back in a private file (a pipe could fill up and
    block the writer, and a ``multiprocessing.Manager`` costs a new interpreter per rank).
    """

    def __init__(self, writer: PlannedWriter) -> None:
        self.writer = writer
        self.plan = writer.plan
        self.pid = os.getpid()
        self.results_path = os.path.join(
            tempfile.gettempdir(), f"kvckpt-megatron-{uuid.uuid4().hex}.msgpack"
        )
        self.outcome: list[WriteResult] | BaseException | None = None

    def __call__(
        self, rank: int, items: list[tuple[MetadataIndex, Any]], results_path: str
    ) -> None:
        # (rank, items, results_path): the argument shape Megatron's callers expect, where
        # ``items`` is replaced by ``preload_fn()``'s staged copy.
        outcome: list[WriteResult] | BaseException
        try:
            planner = Resolved(items)
            outcome = self.writer.write_data(self.plan, planner).value()  # type: ignore[arg-type]
        except BaseException as e:  # reported by finalize, on every rank
            outcome = e
        if os.getpid() == self.pid:
            self.outcome = outcome
            return
        if isinstance(outcome, BaseException):
            doc: dict[str, Any] = {"error": f"{type(outcome).__name__}: {outcome}"}
        else:
            doc = {"results": [[wr.size_in_bytes, wr.storage_data.to_fields()] for wr in outcome]}
        tmp = f"{results_path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(doc))
        os.replace(tmp, results_path)

    def results(self) -> list[WriteResult]:
        """This rank's write results, once the write has run (here or elsewhere)."""
        checkpoint_id = self.writer.checkpoint_id
        outcome = self.outcome
        if outcome is None:
            try:
                with open(self.results_path, "rb") as f:
                    doc = msgpack.unpackb(f.read())
            except FileNotFoundError:
                raise KVCheckpointError(
                    f"the write of checkpoint {checkpoint_id!r} to {self.writer.engine.url} did "
                    "not run, or its process died before it finished: run the AsyncRequest "
                    "(async_fn) before its finalize functions"
                ) from None
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(self.results_path)
            if "error" in doc:
                raise KVCheckpointError(
                    f"writing checkpoint {checkpoint_id!r} to {self.writer.engine.url} failed "
                    f"in the async process: {doc['error']}"
                )
            outcome = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=size,
                    storage_data=ItemLocation.from_fields(loc),
                )
                for item, (size, loc) in zip(self.plan.items, doc["results"], strict=True)
            ]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
