"""The DCP adapter's reader: ``KVStorageReader``.

On load it copies each stored value straight from the engine's buffer into the planner's
destination tensor (narrowing it when the load reshards), and loads non-tensor objects under
``torch.load(weights_only=True)`` rules (``kvckpt.safe_load``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import events
from .adapter import KVStorageBase, byte_tensor, byte_view, new_save_id, valid_checkpoint_id
from .catalog import (
    read_lease,
)
from .engines.base import Engine
from .errors import (
    CheckpointNotFoundError,
    DataError,
    IntegrityError,
    KVCheckpointError,
    MetadataError,
    ShapeMismatchError,
)
from .format import CheckpointRecord, checksum, decode_metadata, gc_paused, new_checksum
from .keys import ItemLocation, meta_key, meta_prefix, parse_meta_key, part_ranges
from .safe_load import check_weights_only
from .stores import open_store

logger = logging.getLogger(__name__)

_DEFAULT_BATCH_BYTES = 256 << 20
#: Seconds of a read lease (``KVStorageReader(lease=)``).
_DEFAULT_LEASE = 60.0
_HOST_ALIGN = 64


class KVStorageReader(KVStorageBase, StorageReader):
    """DCP ``StorageReader`` that loads from a key-value store.

    Args:
        store: a store URL or an engine. A reader never creates a store: an LMDB path with no
            store there is a ``StoreNotFoundError``.
        checkpoint_id: the checkpoint to load when ``dcp.load`` gets no ``checkpoint_id``.
        weights_only: load non-tensor objects under ``torch.load(weights_only=True)`` rules
            (the default), so a store that others can write to cannot run code in this
            process. Pass False only for a store you trust with objects that need it.
        verify: check each value against the checksum its save recorded, wherever the save
            recorded them (the default, None or True); False loads without checking. Whether a
            save records checksums is the writer's choice (``KVStorageWriter(checksums=)``: on
            by default for every built-in engine).
        batch_bytes: how many bytes to request from the engine per batch (bounds memory).
        save_id: load only this save of the checkpoint id (``read_record().save_id``) and fail
            clearly if the id was re-saved since: for loads made of several reads that must
            all see one save.
        lease: seconds a load holds its read lease on the checkpoint id without renewing it
            (it renews between batches). While one is held, retention (``keep_last``, ``gc``,
            ``delete_checkpoint``) and re-saves of the id remove the metadata at once but leave
            the data in place until the load is done; a reader that crashed holds it no longer
            than this. False (or URL option ``read_lease=0``) reads without one, as a load does
            anyway where the store refuses the lease's small write (a replica, a full Redis, a
            user limited to reads, a read-only LMDB directory): a value that retention deletes
            mid-read then fails the load with an error naming the checkpoint (load again).
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: str | os.PathLike | None = None,
        weights_only: bool = True,
        verify: bool | None = None,
        batch_bytes: int = _DEFAULT_BATCH_BYTES,
        lease: float | bool = 60.0,
        save_id: str | None = None,
    ) -> None:
        super().__init__()
        self.engine = open_store(store, create=False)
        self.checkpoint_id = valid_checkpoint_id(checkpoint_id)
        self.save_id = save_id
        self.weights_only = weights_only
        self.verify = verify is not False
        self.batch_bytes = batch_bytes
        self._host: torch.Tensor | None = None  # host staging for GPU-bound reads
        self.lease: float = _DEFAULT_LEASE if lease is True else float(lease)
        self.load_id = new_save_id()
        self._record: CheckpointRecord | None = None
        self._lease: contextlib.AbstractContextManager[Callable[[], None]] | None = None
        self._renew_lease: Callable[[], None] | None = None
        self._global_error: Exception | None = None  # see _report_unreadable
        #: how a refused object's error tells the user to opt out: an API built on this reader
        #: (``KVLoadShardedStrategy``) names its own parameter
        self.weights_only_opt_out = "KVStorageReader(..., weights_only=False)"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = valid_checkpoint_id(checkpoint_id)
        self.load_id = new_save_id()
        self._record = None
        self._global_error = None
        self._release_lease()

    def read_record(self, rank: int | None = None) -> CheckpointRecord:
        """The checkpoint's decoded metadata (kvckpt's fields and DCP's ``Metadata``)."""
        checkpoint_id = self._require_id()
        raw = self.engine.get(meta_key(self.engine.prefix, checkpoint_id, rank))
        if raw is None:
            raise CheckpointNotFoundError(self._not_found(checkpoint_id, rank))
        where = f"checkpoint {checkpoint_id!r} in {self.engine.url}"
        record = decode_metadata(raw, where=where)
        if record.checkpoint_id != checkpoint_id:
            raise MetadataError(
                f"metadata stored for {where} names checkpoint {record.checkpoint_id!r}: the "
                "value was copied or overwritten under the wrong key"
            )
        if self.save_id is not None and record.save_id != self.save_id:
            raise KVCheckpointError(
                f"{where} was re-saved: it now holds save {record.save_id}, not save "
                f"{self.save_id} that this load was pinned to (save_id=). Nothing was loaded; "
                "load again."
            )
        return record

    def _not_found(self, checkpoint_id: str, rank: int | None) -> str:
        found: set[str] = set()
        for key in self.engine.scan(meta_prefix(self.engine.prefix)):
            parsed = parse_meta_key(self.engine.prefix, key)
            if parsed is not None:
                found.add(parsed[0])
        what = f"checkpoint {checkpoint_id!r}" + ("" if rank is None else f" (rank {rank})")
        if not found:
            return f"{what} not found in {self.engine.url}: the store has no checkpoints"
        names = sorted(found)
        shown = ", ".join(repr(n) for n in names[:50])
        more = f" and {len(names) - 50} more" if len(names) > 50 else ""
        return f"{what} not found in {self.engine.url}; checkpoints there: {shown}{more}"

    # -- DCP StorageReader --------------------------------------------------------------------

    def _take_lease(self) -> None:
        self._release_lease()
        lease = read_lease(self.engine, self._require_id(), self.lease)
        self._renew_lease = lease.__enter__()
        self._lease = lease

    def _release_lease(self) -> None:
        lease, self._lease, self._renew_lease = self._lease, None, None
        if lease is not None:
            lease.__exit__(None, None, None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # The lease comes first: whatever save the metadata then names keeps its data until
        # this load is done, even if retention or a re-save retires it meanwhile.
        self._take_lease()
        rank = kwargs.get("rank")
        try:
            self._record = self.read_record(rank)
        except Exception as e:
            self._release_lease()
            self._report_unreadable(e, rank)
            raise
        except BaseException:
            self._release_lease()
            raise
        metadata = self._record.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _report_unreadable(self, error: Exception, rank: int | None) -> None:
        """Log why a checkpoint cannot be loaded, once DCP has tried both of its ways.

        DCP calls ``read_metadata()`` and, when that fails, ``read_metadata(rank=r)`` for a
        rank-local checkpoint. torch before 2.13 swallows both errors and raises a bare
        "metadata is None", so this log line is then the only place the user learns why. The
        global read's error is the one that explains a missing or unreadable checkpoint; a
        failure of the global read alone is not logged, since a rank-local checkpoint then loads.
        """
        if rank is None:
            self._global_error = error
            return
        cause = self._global_error or error
        logger.warning("kvckpt cannot load from %s: %s", self.engine.url, cause)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._record is None or self._record.metadata is not metadata:
            raise KVCheckpointError("set_up_storage_reader got metadata this reader did not read")
        self._check_shapes(metadata, _calling_load_planner())

    def _check_shapes(self, metadata: Metadata, planner: LoadPlanner | None) -> None:
        """Fail with one clear error when the state dict's tensors have other shapes than the
        checkpoint's, before DCP's planner fails on the first of them without naming the
        checkpoint or the store.

        Only for planners that keep DCP's default plan (``DefaultLoadPlanner`` and subclasses
        that do not override ``create_local_plan``), which refuse any such mismatch: a planner
        with a plan of its own may accept one (Megatron's ``MCoreLoadPlanner`` does, for the
        tensors it is told to).
        """
        if planner is None or not isinstance(planner, DefaultLoadPlanner):
            return
        if type(planner).create_local_plan is not DefaultLoadPlanner.create_local_plan:
            return
        state_dict = getattr(planner, "state_dict", None)
        if not isinstance(state_dict, dict):
            return
        mismatched: list[tuple[str, torch.Size, Any]] = []
        for fqn, obj in state_dict.items():
            md = metadata.state_dict_metadata.get(fqn)
            size = getattr(obj, "size", None)
            if isinstance(md, TensorStorageMetadata) and callable(size) and md.size != size():
                mismatched.append((fqn, md.size, size()))
        if not mismatched:
            return
        self._release_lease()
        fqn, saved, wanted = mismatched[0]
        others = len(mismatched) - 1
        more = f" (and {others} more tensor{'s' if others > 1 else ''})" if others else ""
        raise ShapeMismatchError(
            f"checkpoint {self.checkpoint_id!r} in {self.engine.url} does not fit the state dict "
            f"it is loaded into: {fqn!r} is {list(saved)} in the checkpoint and "
            f"{list(wanted)} in the state dict{more}. It was saved from another model, or by "
            f"another job using the same namespace (prefix {self.engine.prefix!r}): give each "
            "job a namespace of its own with ?prefix=NAME in the store URL. Nothing was loaded."
        )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Each rank reads the metadata itself; a re-save of the id committed between two
        # ranks' reads would have them load different saves. The coordinator compares.
        # (Rank-local checkpoints hold one save per rank by design.)
        if self._record is None or self._record.rank is not None:
            return plan
        return dataclasses.replace(plan, storage_data=self._record.save_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        found = sorted({p.storage_data for p in plans if isinstance(p.storage_data, str)})
        if len(found) > 1:
            raise KVCheckpointError(
                f"checkpoint {self.checkpoint_id!r} in {self.engine.url} was re-saved while "
                f"this load started: the ranks found different saves ({', '.join(found)}), "
                "and loading them would mix two checkpoints. Nothing was loaded; load again."
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        record = self._record
        if record is None:
            raise KVCheckpointError("read_data called before read_metadata")
        phase = events.Phase("restore", "read", record.checkpoint_id, self.engine.url)
        try:
            with gc_paused():
                self._read_all(record, plan, planner)
        finally:
            self._host = None
            self._release_lease()
        indexes = {req.storage_index for req in plan.items}
        phase.end(sum(loc.nbytes for i, loc in record.locations.items() if i in indexes))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, record: CheckpointRecord, plan: LoadPlan, planner: LoadPlanner) -> None:
        groups: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            groups.setdefault(req.storage_index, []).append(req)
        batch: list[_ItemRead] = []
        size = 0
        for index, reqs in groups.items():
            loc = record.locations.get(index)
            if loc is None:
                raise DataError(
                    f"checkpoint {record.checkpoint_id!r} in {self.engine.url} has no item "
                    f"{index.fqn!r} at offset {list(index.offset or [])}"
                )
            batch.append(_ItemRead(self, record, index, loc, reqs, planner))
            size += loc.nbytes
            if size >= self.batch_bytes:
                self._read_batch(batch)
                batch, size = [], 0
                if self._renew_lease is not None:
                    self._renew_lease()
        if batch:
            self._read_batch(batch)

    def _host_buffer(self, items: list[_ItemRead]) -> None:
        """Give each GPU-bound direct read a slice of one host buffer, reused across batches
        (pinned where the GPU is CUDA, so the copy to the device runs at full speed)."""
        offsets, size = [], 0
        for item in items:
            offsets.append(size)
            size += -(-item.loc.nbytes // _HOST_ALIGN) * _HOST_ALIGN  # aligned for any dtype
        host = self._host
        if host is None or host.numel() < size:
            self._host = host = None  # free the old one first
            pin = torch.cuda.is_available() and any(item.target.is_cuda for item in items)
            try:
                host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError:  # pinned memory is limited; pageable memory still works
                host = torch.empty(size, dtype=torch.uint8)
            self._host = host
        for item, start in zip(items, offsets, strict=True):
            item.host = host[start : start + item.loc.nbytes]
            item.dest = byte_view(item.host)

    def _read_batch(self, batch: list[_ItemRead]) -> None:
        record = self._record
        assert record is not None
        via_host = [item for item in batch if item.via_host]
        if via_host:
            self._host_buffer(via_host)
        direct = [item for item in batch if item.dest is not None]
        staged = [item for item in batch if item.dest is None]
        if direct:
            # Values go from the engine straight into the destination tensors' memory.
            keys: list[str] = []
            buffers: list[memoryview] = []
            sums: list[int | None] = []
            for item in direct:
                assert item.dest is not None
                item_keys = item.loc.keys(self.engine.prefix, record.checkpoint_id, record.save_id)
                for p, (key, (start, stop)) in enumerate(zip(item_keys, item.ranges, strict=True)):
                    keys.append(key)
                    buffers.append(item.dest[start:stop])
                    sums.append(item.loc.checksums[p] if item.loc.checksums else None)
            read_checked(
                self.engine,
                record.checkpoint_id,
                keys,
                buffers,
                sums,
                lambda i: key_fqn(direct, keys[i]),
                verify=self.verify,
            )
            for item in direct:
                item.commit()
        if staged:
            fetch_parts(
                self.engine,
                record,
                [(item.index, item.loc) for item in staged],
                lambda i, start, view: staged[i].add_part(start, view),
                verify=self.verify,
            )


def _calling_load_planner() -> LoadPlanner | None:
    """The planner of the ``dcp.load`` that called ``set_up_storage_reader``, or None.

    DCP hands a storage reader the metadata but not the state dict. It sets the planner up with
    the state dict just before ``set_up_storage_reader`` and keeps it in a local variable
    ``planner`` of the calling frame (``_load_state_dict``'s ``local_step`` in torch 2.13). Where
    a torch version keeps it elsewhere, this returns None and DCP's own check remains.
    """
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return None
        planner = frame.f_locals.get("planner")
        if isinstance(planner, LoadPlanner):
            return planner
        frame = frame.f_back
    return None


def key_fqn(items: list[_ItemRead], key: str) -> str:
    """The fqn a data key belongs to (for error messages only)."""
    rank, name = key.split("/")[-3:-1]
    for item in items:
        loc = item.loc
        if (str(loc.rank), str(loc.plan_position) if loc.name is None else loc.name) == (
            rank,
            name,
        ):
            return item.index.fqn
    return "?"


def _of(fqn: str | None) -> str:
    return "" if fqn is None else f" of {fqn!r}"


def damaged(
    engine: Engine, checkpoint_id: str, key: str, fqn: str | None, got: int | None, want: int
) -> DataError:
    """A missing or wrongly sized value (``fqn``: the item it belongs to, where known)."""
    problem = (
        "is missing (deleted, evicted or expired)"
        if got is None
        else f"holds {got} bytes, expected {want}"
    )
    return DataError(
        f"checkpoint {checkpoint_id!r} in {engine.url} is damaged: key {key!r}{_of(fqn)} {problem}"
    )


def corrupted(engine: Engine, checkpoint_id: str, key: str, fqn: str | None) -> IntegrityError:
    """A value that does not match its recorded checksum."""
    return IntegrityError(
        f"checkpoint {checkpoint_id!r} in {engine.url} is corrupted: key {key!r}{_of(fqn)} "
        "does not match the checksum recorded when it was saved"
    )


def read_checked(
    engine: Engine,
    checkpoint_id: str,
    keys: Sequence[str],
    buffers: Sequence[memoryview],
    sums: Sequence[int | None],
    fqn: Callable[[int], str | None],
    *,
    verify: bool = True,
) -> None:
    """Read each value of ``keys`` into its buffer (``Engine.get_into``) and check it: present
    with its buffer's size (else ``DataError``) and, with ``verify``, equal to its checksum in
    ``sums`` where one is recorded (else ``IntegrityError``). ``fqn(i)`` names the item of
    value ``i`` in the error. The engine hashes each value as it lands (``Engine.get_into``
    says why), so checking costs no second pass over the bytes."""
    verifying = verify and any(x is not None for x in sums)
    digests: dict[int, int | None] = {}
    if verifying:
        sizes = engine.get_into(keys, buffers, on_value=digests.__setitem__, hasher=new_checksum)
    else:
        sizes = engine.get_into(keys, buffers)
    for i, (key, buffer, size) in enumerate(zip(keys, buffers, sizes, strict=True)):
        if size != buffer.nbytes:
            raise damaged(engine, checkpoint_id, key, fqn(i), size, buffer.nbytes)
        if verifying and sums[i] is not None:
            digest = digests.get(i)
            if digest is None:  # an engine that does not hash while reading
                digest = checksum(buffer)
            if digest != sums[i]:
                raise corrupted(engine, checkpoint_id, key, fqn(i))


def fetch_parts(
    engine: Engine,
    record: CheckpointRecord,
    items: Sequence[tuple[MetadataIndex, ItemLocation]],
    on_part: Callable[[int, int, memoryview], None],
    *,
    verify: bool = False,
) -> None:
    """Fetch every part of ``items`` in one engine batch, checking each exists with the size
    the metadata promises; ``on_part(item position, byte offset, view)`` gets each part (the
    view is valid only during the call)."""
    keys: list[str] = []
    slots: list[tuple[int, int, int, int | None]] = []
    for i, (_, loc) in enumerate(items):
        item_keys = loc.keys(engine.prefix, record.checkpoint_id, record.save_id)
        ranges = part_ranges(loc.nbytes, loc.part_bytes)
        for p, (key, (start, stop)) in enumerate(zip(item_keys, ranges, strict=True)):
            keys.append(key)
            slots.append((i, start, stop, loc.checksums[p] if loc.checksums else None))

    def consume(k: int, view: memoryview | None) -> None:
        i, start, stop, expected = slots[k]
        if view is None or view.nbytes != stop - start:
            raise damaged(
                engine,
                record.checkpoint_id,
                keys[k],
                items[i][0].fqn,
                None if view is None else view.nbytes,
                stop - start,
            )
        if verify and expected is not None and checksum(view) != expected:
            raise corrupted(engine, record.checkpoint_id, keys[k], items[i][0].fqn)
        on_part(i, start, view)

    engine.get_many(keys, consume)


class _ItemRead:
    """One stored item and the read requests it serves.

    When one request wants the whole stored chunk and its destination is a contiguous CPU
    tensor of the same dtype (a load without resharding), ``dest`` is that tensor's memory and
    the engine reads the value straight into it. Otherwise the value is staged (zero-copy from
    LMDB's map where possible) and narrowed into each destination.
    """

    def __init__(
        self,
        reader: KVStorageReader,
        record: CheckpointRecord,
        index: MetadataIndex,
        loc: ItemLocation,
        reqs: list[ReadItem],
        planner: LoadPlanner,
    ) -> None:
        self.reader, self.record, self.index, self.loc = reader, record, index, loc
        self.reqs, self.planner = reqs, planner
        self.ranges = part_ranges(loc.nbytes, loc.part_bytes)
        self.remaining = len(self.ranges)
        self.buffer: torch.Tensor | None = None  # assembly of a multi-part staged item
        self.dest: memoryview | None = None
        #: a direct read bound for another device (a GPU) lands here first (``_read_batch``)
        self.via_host = False
        self.host: torch.Tensor | None = None
        if index.offset is not None and len(reqs) == 1:
            self._try_direct()

    def _try_direct(self) -> None:
        req = self.reqs[0]
        dtype, sizes = self.record.chunk(self.index)
        if any(req.storage_offsets) or list(req.lengths) != sizes:
            return
        target = self.planner.resolve_tensor(req)
        if target.requires_grad:
            target = target.detach()
        if not (
            target.dtype == dtype
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
            and list(target.shape) == sizes
        ):
            return
        if target.is_cpu:
            self.target = target
            self.dest = byte_view(target)
        elif target.device.type != "meta" and not self.reader.engine.zero_copy_reads:
            # A GPU tensor: the value is read through the engine's fast path into host memory
            # and copied to the device once. (A zero-copy engine's staged path already copies
            # straight from the store's memory to the device.)
            self.target = target
            self.via_host = True

    def commit(self) -> None:
        if self.host is not None:
            self.target.copy_(self.host.view(self.target.dtype).reshape(self.target.shape))
            self.host = None
        self.planner.commit_tensor(self.reqs[0], self.target)

    def add_part(self, start: int, view: memoryview) -> None:
        self.remaining -= 1
        if len(self.ranges) == 1:
            self._apply(view)
            return
        if view.nbytes:
            if self.buffer is None:
                self.buffer = torch.empty(self.loc.nbytes, dtype=torch.uint8)
            self.buffer[start : start + view.nbytes].copy_(byte_tensor(view))
        if self.remaining == 0:
            assert self.buffer is not None
            self._apply(byte_view(self.buffer))

    def apply(self, view: memoryview) -> None:
        """Load the stored item's whole value ``view`` into every request it serves."""
        self._apply(view)

    def _apply(self, view: memoryview) -> None:
        if self.index.offset is None:
            self._load_object(view)
            return
        dtype, sizes = self.record.chunk(self.index)
        if view.nbytes:
            src = byte_tensor(view).view(dtype).reshape(sizes)
        else:
            src = torch.empty(sizes, dtype=dtype)
        for req in self.reqs:
            part = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
            target = self.planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise ShapeMismatchError(
                    f"{req.storage_index.fqn!r}: the load plan wants shape {list(target.size())} "
                    f"but the checkpoint holds {list(part.size())}"
                )
            target.copy_(part)
            self.planner.commit_tensor(req, target)

    def _load_object(self, view: memoryview) -> None:
        data = bytes(view)
        if self.reader.weights_only:
            check_weights_only(
                data,
                f"object {self.index.fqn!r} in checkpoint {self.record.checkpoint_id!r} "
                f"({self.reader.engine.url})",
                self.reader.weights_only_opt_out,
            )
        for req in self.reqs:
            if req.type != LoadItemType.BYTE_IO:
                raise DataError(f"{self.index.fqn!r} is stored as an object, not a tensor")
            self.planner.load_bytes(req, io.BytesIO(data))
