"""The key schema of docs/FORMAT.md: where a checkpoint's metadata, data and spares live in a
store, the names of items in their data keys, and how an item's bytes split into parts.

Pure string and arithmetic work, no torch: the command line's listing, inspecting and deleting
use it without importing torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import xxhash

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex


def meta_prefix(prefix: str) -> str:
    return f"{{{prefix}}}/meta/"


def meta_key(prefix: str, checkpoint_id: str, rank: int | None = None) -> str:
    key = f"{{{prefix}}}/meta/{checkpoint_id}"
    return key if rank is None else f"{key}/rank/{rank}"


def parse_meta_key(prefix: str, key: str) -> tuple[str, int | None] | None:
    """(checkpoint id, rank or None) for a metadata key, None for any other key."""
    head = meta_prefix(prefix)
    if not key.startswith(head):
        return None
    rest = key[len(head) :].split("/")
    if len(rest) == 1:
        return rest[0], None
    if len(rest) == 3 and rest[1] == "rank" and rest[2].isdigit():
        return rest[0], int(rest[2])
    return None


def data_prefix(prefix: str, checkpoint_id: str | None = None, save_id: str | None = None) -> str:
    key = f"{prefix}/data/"
    if checkpoint_id is not None:
        key += f"{checkpoint_id}/"
        if save_id is not None:
            key += f"{save_id}/"
    return key


def spare_prefix(prefix: str) -> str:
    return f"{prefix}/spare/"


def spare_key(prefix: str, data_key: str) -> str:
    """Where retention keeps a deleted checkpoint's value, or a writer makes one ahead, for the
    next save to overwrite in place (engines with ``reuses_values``):
    ``<prefix>/spare/<rank>/<item name>/<part>``
    (format 1: ``<n>``, the item's place in the rank's plan), the last three fields of its data
    key, which the same state dict gives the same size every save."""
    return spare_prefix(prefix) + "/".join(data_key.rsplit("/", 3)[-3:])


#: The longest item name in a data key (format 2): with the longest prefix and checkpoint id,
#: a million ranks and ``format.MAX_PARTS`` parts, a data key stays within LMDB's 511-byte keys.
MAX_ITEM_NAME = 120
#: Characters an item name (format 2) consists of: RFC 3986's unreserved characters, which
#: percent-encoding leaves as they are, and ``%`` (escapes), ``@`` (before the offsets), ``,``
#: (between offsets) and ``+`` (before the hash of a long name), which it never leaves.
ITEM_NAME = re.compile(rf"[A-Za-z0-9._~%@,+-]{{0,{MAX_ITEM_NAME}}}")
_UNRESERVED = re.compile(r"[A-Za-z0-9._~-]*")


def item_name(fqn: str, offsets: tuple[int, ...] | None) -> str:
    """An item's name in its data keys (format 2): its fqn percent-encoded as UTF-8 (every
    character but ``A-Z a-z 0-9 . _ ~ -``, so ``/``, Redis glob and hash-tag characters,
    whitespace and non-ASCII never appear raw), then for a tensor item ``@`` and its chunk
    offsets joined by ``,``. A name longer than ``MAX_ITEM_NAME`` keeps its first characters
    (never cutting an escape) and ends in ``+`` and the 16 hex digits of the XXH3-64 of the
    whole name. Two items of one rank's plan never share a name: escaping is one-to-one and
    ``+`` never appears in an unhashed name (the writer checks, too)."""
    name = fqn if _UNRESERVED.fullmatch(fqn) else quote(fqn, safe="")
    if offsets is not None:
        name += "@" + ",".join(map(str, offsets))
    if len(name) <= MAX_ITEM_NAME:
        return name
    head = name[: MAX_ITEM_NAME - 17]
    cut = head.rfind("%", len(head) - 2)  # an escape is three characters: never split one
    if cut >= 0:
        head = head[:cut]
    return f"{head}+{xxhash.xxh3_64_hexdigest(name.encode())}"


def index_name(index: MetadataIndex) -> str:
    """``item_name`` of a DCP ``MetadataIndex`` (an object item has no offsets). Not cached:
    computing a name is cheap, and a cache of a state dict's 100,000s of names would slow
    every later metadata decode in the same process (``benchmarks/many_items.py``)."""
    return item_name(index.fqn, index.offset)


def part_ranges(nbytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of an item's parts; an empty item has one empty part."""
    if nbytes <= part_bytes:
        return [(0, nbytes)]
    count = -(-nbytes // part_bytes)
    return [(i * part_bytes, min((i + 1) * part_bytes, nbytes)) for i in range(count)]


@dataclass(frozen=True)
class ItemLocation:
    """Where one write item's bytes live: DCP's per-item ``storage_data`` for kvckpt."""

    rank: int
    #: The item's position in its rank's save plan (the order reads go in; format 1's keys).
    plan_position: int
    nbytes: int
    part_bytes: int
    #: xxh3_64 of each part's bytes, or None if the save recorded no checksums.
    checksums: tuple[int, ...] | None = None
    #: The item's name in its data keys (``item_name``); None in format 1, which keys by ``n``.
    name: str | None = None

    def to_fields(self) -> dict[str, Any]:
        """This location as plain values (for msgpack); ``from_fields`` reads them back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ItemLocation:
        sums = fields.get("checksums")
        return cls(**{**fields, "checksums": None if sums is None else tuple(sums)})

    def split(
        self, view: memoryview, prefix: str, checkpoint_id: str, save_id: str
    ) -> Iterator[tuple[str, memoryview]]:
        """(key, bytes) of each part of this item's value ``view``, ready to write."""
        keys = self.keys(prefix, checkpoint_id, save_id)
        for key, (start, stop) in zip(keys, part_ranges(self.nbytes, self.part_bytes), strict=True):
            yield key, view[start:stop]

    def keys(self, prefix: str, checkpoint_id: str, save_id: str) -> list[str]:
        return item_keys(
            data_prefix(prefix, checkpoint_id, save_id),
            self.rank,
            self.plan_position if self.name is None else self.name,
            self.nbytes,
            self.part_bytes,
        )


def item_keys(head: str, rank: int, name: int | str, nbytes: int, part_bytes: int) -> list[str]:
    """The data keys of an item's parts: ``<head><rank>/<name>/<part>``, where ``head`` is
    ``data_prefix`` of the save and ``name`` the item's name (format 1: its plan position)."""
    base = f"{head}{rank}/{name}/"
    if nbytes <= part_bytes:
        return [base + "0"]
    return [f"{base}{i}" for i in range(-(-nbytes // part_bytes))]
