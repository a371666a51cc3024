"""The rows of ``benchmarks/run.py``'s report, which way each is better, and the targets.

Every row compares within one run, so that a row means the same on any machine: a
**speed-up** divides throughputs (the case's GB/s over its baseline's: higher is better), a
**time ratio** divides median times (lower is better), a **checksum cost** is the extra time a
default verified load or checksummed save takes over the same with checksums off (the median
of each round's ratio, the two taking turns; lower is better), and a **peak RSS** row divides
the memory a call used by what it is allowed (lower is better). GB/s rows are the machine's
own (higher is better).

``TARGETS`` is the one table of the rows a run is held to; ``failures`` names each row that
falls short (``python benchmarks/run.py --check`` exits 1 with them).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

HIGHER, LOWER = "higher", "lower"

#: The targets: row -> (comparison, bound). ``--check`` fails on each row that misses its
#: bound, or that the run did not measure.
TARGETS: dict[str, tuple[str, float]] = {
    "checksum cost, LMDB load (extra time, fraction)": ("<=", 0.10),
    "checksum cost, LMDB save (extra time, fraction)": ("<=", 0.10),
    "checksum cost, Redis load (extra time, fraction)": ("<=", 0.10),
    "checksum cost, Redis save (extra time, fraction)": ("<=", 0.10),
    "checksum cost, Redis save into an empty server (extra time, fraction)": ("<=", 0.10),
    "Redis save / raw-socket SET (speed-up)": (">=", 0.8),
    "Redis save / DCP FS shm t=1, taking turns (speed-up)": (">=", 1.0),
    "async_save blocking: LMDB / DCP default stager (time ratio)": ("<=", 1.0),
    "async_save blocking: Redis / DCP default stager (time ratio)": ("<=", 1.0),
    "LMDB load / DCP FileSystemReader shm (speed-up)": (">=", 5.0),
    "LMDB save steady / DCP FS shm t=2, taking turns (speed-up)": (">=", 3.0),
    "LMDB save first, new store / DCP FS shm t=2, taking turns (speed-up)": (">=", 1.3),
    "peak anon RSS, LMDB save / (10% of the state dict + 1 part)": ("<=", 1.0),
    "peak anon RSS, Redis save / (10% of the state dict + 1 part)": ("<=", 1.0),
    "peak anon RSS, LMDB load / 1 part": ("<=", 1.0),
    "peak anon RSS, Redis load / 1 part": ("<=", 1.0),
    "peak anon RSS, safetensors export / (the largest tensor + 10%)": ("<=", 1.0),
}


@dataclass(frozen=True)
class Row:
    """One row of the report: what is measured, its value, which way is better, a note."""

    metric: str
    value: float
    better: str  # HIGHER or LOWER
    note: str = ""

    @property
    def target(self) -> tuple[str, float] | None:
        return TARGETS.get(self.metric)

    @property
    def met(self) -> bool | None:
        """Whether the row meets its target; None for a row without one."""
        if self.target is None:
            return None
        op, bound = self.target
        return self.value >= bound if op == ">=" else self.value <= bound


def target_text(target: tuple[str, float] | None) -> str:
    return "" if target is None else f"{target[0]} {target[1]:g}"


def missed(rows: Iterable[Row]) -> list[tuple[str, Row | None]]:
    """Each target row that falls short, with its row (None: the run did not measure it)."""
    by_name = {row.metric: row for row in rows}
    return [
        (name, by_name.get(name))
        for name in TARGETS
        if name not in by_name or not by_name[name].met
    ]


def failures(rows: Iterable[Row]) -> list[str]:
    """One line per target missed: its row, measured against target."""
    return [
        f"{name}: "
        + ("not measured" if row is None else f"measured {row.value:.3f}")
        + f", target {target_text(TARGETS[name])}"
        for name, row in missed(rows)
    ]


#: Ratios of one case to its baseline: (row, case, baseline, note). A speed-up divides GB/s.
SPEED_UPS = [
    ("LMDB load / DCP FileSystemReader shm", "kv_lmdb_load", "dcp_fs_shm_load", ""),
    (
        "LMDB save steady / DCP FS shm t=2, taking turns",
        "kv_lmdb_save_steady",
        "dcp_fs_shm_save_t2_turns",
        "",
    ),
    (
        "LMDB save first, new store / DCP FS shm t=1, taking turns",
        "kv_lmdb_save_first",
        "dcp_fs_shm_save_t1_turns",
        "",
    ),
    (
        "LMDB save first, new store / DCP FS shm t=2, taking turns",
        "kv_lmdb_save_first",
        "dcp_fs_shm_save_t2_turns",
        "",
    ),
    ("Redis save / raw-socket SET", "kv_redis_save", "raw_redis_set", ""),
    (
        "Redis save / DCP FS shm t=1, taking turns",
        "kv_redis_save",
        "dcp_fs_shm_save_t1_turns",
        "",
    ),
    (
        "Redis save steady, keep_last=1 / DCP FS shm t=1 keeping 1, taking turns",
        "kv_redis_save_steady",
        "dcp_fs_shm_save_t1_keep1",
        "a training job's pattern",
    ),
    ("Redis load / raw-socket GET-into", "kv_redis_load", "raw_redis_get_into", ""),
    ("Redis load / DCP FileSystemReader shm", "kv_redis_load", "dcp_fs_shm_load", ""),
]

#: Speed-ups for comparison: against DCP's saves timed in a block at the start of the run (each
#: catches whatever part of the machine's drift its block fell in), and Redis over a Unix socket
OTHER_SPEED_UPS = [
    (
        "LMDB save steady / DCP FS shm t=2 timed in a block at the start",
        "kv_lmdb_save_steady",
        "dcp_fs_shm_save_t2",
        "for comparison",
    ),
    (
        "LMDB save first, new store / DCP FS shm t=1 timed in a block at the start",
        "kv_lmdb_save_first",
        "dcp_fs_shm_save_t1",
        "for comparison",
    ),
    (
        "Redis save / DCP FS shm t=1 timed in a block at the start",
        "kv_redis_save",
        "dcp_fs_shm_save_t1",
        "for comparison",
    ),
    (
        "Redis over a Unix socket, save / DCP FS shm t=1, taking turns",
        "kv_redis_unix_save",
        "dcp_fs_shm_save_t1_turns",
        "",
    ),
    (
        "Redis over a Unix socket, load / DCP FileSystemReader shm",
        "kv_redis_unix_load",
        "dcp_fs_shm_load",
        "",
    ),
]

#: The save into an empty server, against one whose allocator takes transparent huge pages
#: (``bench.HUGE_PAGES_ENV``): what the server's allocation of new memory costs
HUGE_PAGE_SERVER = [
    (
        "Redis save into an empty server on huge pages / DCP FS shm t=1, taking turns",
        "kv_redis_save_huge_pages",
        "dcp_fs_shm_save_t1_turns",
        "server: (JE_)MALLOC_CONF=thp:always, disable-thp no",
    ),
    (
        "Redis save into an empty server on huge pages / on the default server, taking turns",
        "kv_redis_save_huge_pages",
        "kv_redis_save",
        "",
    ),
]

#: The first saves on a tmpfs mounted with ``huge=`` (``run.py --huge-tmpfs``), whose pages are
#: allocated and mapped 2 MiB at a time
HUGE_TMPFS = [
    (
        "LMDB save first, new store, on a tmpfs of huge pages / DCP FS t=2 on the same tmpfs, "
        "taking turns",
        "kv_lmdb_save_first_huge_tmpfs",
        "dcp_fs_huge_tmpfs_save_t2_turns",
        "tmpfs",
    ),
    (
        "LMDB save first, new store, on a tmpfs of huge pages / on /dev/shm, taking turns",
        "kv_lmdb_save_first_huge_tmpfs",
        "kv_lmdb_save_first",
        "",
    ),
    (
        "LMDB save first, new store, on a tmpfs of huge pages / DCP FS shm t=2, taking turns",
        "kv_lmdb_save_first_huge_tmpfs",
        "dcp_fs_shm_save_t2_turns",
        "",
    ),
    (
        "DCP FS t=2 on a tmpfs of huge pages / on /dev/shm, taking turns",
        "dcp_fs_huge_tmpfs_save_t2_turns",
        "dcp_fs_shm_save_t2_turns",
        "",
    ),
]

#: LMDB's steady save with parts larger than glibc's non-temporal threshold
#: (``bench.BIG_LMDB_PARTS``)
BIG_LMDB_PARTS = [
    (
        "LMDB save steady, part_bytes=256MiB / with the default parts, taking turns",
        "kv_lmdb_save_steady_big_parts",
        "kv_lmdb_save_steady",
        "",
    ),
    (
        "LMDB save steady, part_bytes=256MiB / DCP FS shm t=2, taking turns",
        "kv_lmdb_save_steady_big_parts",
        "dcp_fs_shm_save_t2_turns",
        "",
    ),
]

#: The two ways of writing a state dict into new memory with nothing around them
#: (``baselines.NewFileWrites``), against each other and against the saves that take them.
FIRST_SAVE_WAYS = [
    (
        "new memory, one thread of write() into one file and one mapping pages in and copying "
        "(LMDB's way, no LMDB) / two threads of write() (DCP's way, no DCP), taking turns",
        "new_file_write_map_t2",
        "new_file_write_t2",
        "a first save's two ways, nothing around them",
    ),
    (
        "LMDB save first, new store / its way above with nothing around it, taking turns",
        "kv_lmdb_save_first",
        "new_file_write_map_t2",
        "",
    ),
    (
        "DCP FS shm t=2 / its way above with nothing around it, taking turns",
        "dcp_fs_shm_save_t2_turns",
        "new_file_write_t2",
        "",
    ),
]

#: ``FIRST_SAVE_WAYS`` in runs whose LMDB first save mapped every page in before copying (runs
#: before ``new_file_write_map_t2`` existed).
FIRST_SAVE_WAYS_MAPPED = [
    (
        "new memory, mapped in on two threads then copied (LMDB's way, no LMDB) / two threads of "
        "write() (DCP's way, no DCP), taking turns",
        "new_file_map_copy_t2",
        "new_file_write_t2",
        "a first save's two ways, nothing around them",
    ),
    (
        "LMDB save first, new store / its way above with nothing around it, taking turns",
        "kv_lmdb_save_first",
        "new_file_map_copy_t2",
        "",
    ),
    (
        "DCP FS shm t=2 / its way above with nothing around it, taking turns",
        "dcp_fs_shm_save_t2_turns",
        "new_file_write_t2",
        "",
    ),
]

#: What the difference between the two ways is made of (runs before these cases lack them).
FIRST_SAVE_PARTS = [
    (
        "new memory, two threads of write() into one file / into two files (DCP's way), "
        "taking turns",
        "new_file_write_one_t2",
        "new_file_write_t2",
        "a file takes one write() at a time",
    ),
    (
        "new memory, mapped in on two threads then copied / two threads of write() into one "
        "file, taking turns",
        "new_file_map_copy_t2",
        "new_file_write_one_t2",
        "",
    ),
    (
        "memory already allocated (fallocate, untimed), mapped in on two threads then copied "
        "/ new memory, two threads of write() into two files, taking turns",
        "new_file_map_allocated_copy_t2",
        "new_file_write_t2",
        "mapping pages in, without allocating them",
    ),
]

#: A time ratio divides median times.
TIME_RATIOS = [
    ("small tensors, save + load: LMDB / DCP", "small_kv_lmdb", "small_dcp_fs_shm", ""),
    ("small tensors, save + load: Redis / DCP", "small_kv_redis", "small_dcp_fs_shm", ""),
    (
        "async_save blocking: LMDB / DCP default stager",
        "async_block_kv_lmdb",
        "async_block_dcp_fs_shm",
        "",
    ),
    (
        "async_save blocking: Redis / DCP default stager",
        "async_block_kv_redis",
        "async_block_dcp_fs_shm",
        "",
    ),
    # what training waits for with a plain dcp.save into an LMDB store (steady state) against
    # what it waits for with DCP's async_save
    (
        "LMDB save steady, plain dcp.save / DCP async_save blocking",
        "kv_lmdb_save_steady",
        "async_block_dcp_fs_shm",
        "below 1: no async needed",
    ),
    (
        "async_save blocking, staging copy reused: LMDB cache_staged_state_dict / DCP "
        "DefaultStager kept",
        "async_block_kv_lmdb_cached",
        "async_block_dcp_fs_shm_cached",
        "both reuse one staging copy",
    ),
    (
        "async_save blocking: DCP DefaultStager kept / DCP default stager",
        "async_block_dcp_fs_shm_cached",
        "async_block_dcp_fs_shm",
        "what reusing the copy buys",
    ),
]

#: Checksum costs: (store and operation, checksums off, checksums on: the default)
CHECKSUM_PAIRS = [
    ("LMDB load", "kv_lmdb_load_noverify", "kv_lmdb_load"),
    # steady saves (keep_last=1), a training job's pattern, taking turns with each other alone
    ("LMDB save", "kv_lmdb_save_steady_nosum", "kv_lmdb_save_steady_sum"),
    ("Redis load", "kv_redis_load_noverify", "kv_redis_load"),
    ("Redis save", "kv_redis_save_steady_nosum", "kv_redis_save_steady_sum"),
    # first saves into an empty server, taking turns with every other save
    ("Redis save into an empty server", "kv_redis_save_nosum", "kv_redis_save"),
    # hashing on a worker thread while the engine sends (engines without
    # hashes_while_writing): for comparison
    (
        "Redis save into an empty server, hashed on a worker thread",
        "kv_redis_save_nosum",
        "kv_redis_save_sum_thread",
    ),
]


def paired_cost(with_sums: list[float], without: list[float]) -> float:
    """The median of each round's ratio less 1: what the first costs over the second, as a
    fraction of the second's time (each round times one of each, next to each other)."""
    return statistics.median(a / b for a, b in zip(with_sums, without, strict=True)) - 1


def rows(r: dict[str, Any]) -> list[Row]:
    """Every row of a run's report, from its results (``results.json``)."""

    def g(name: str) -> float:
        return float(r[name]["gbps"])

    def t(name: str) -> float:
        return float(r[name]["median_s"])

    def runs(name: str) -> list[float]:
        return list(r[name]["runs_s"])

    size = r["state_dict_bytes"]
    out = [Row(f"{m} (speed-up)", g(c) / g(b), HIGHER, n) for m, c, b, n in SPEED_UPS]
    if "new_file_write_t2" in r:  # (runs before these cases existed lack them)
        ways = FIRST_SAVE_WAYS if "new_file_write_map_t2" in r else FIRST_SAVE_WAYS_MAPPED
        out += [Row(f"{m} (speed-up)", g(c) / g(b), HIGHER, n) for m, c, b, n in ways]
    if "new_file_write_one_t2" in r:
        out += [Row(f"{m} (speed-up)", g(c) / g(b), HIGHER, n) for m, c, b, n in FIRST_SAVE_PARTS]
    if "kv_lmdb_save_steady_big_parts" in r:
        out += [Row(f"{m} (speed-up)", g(c) / g(b), HIGHER, n) for m, c, b, n in BIG_LMDB_PARTS]
    if "kv_redis_save_huge_pages" in r:
        held = r.get("redis_huge_pages_bytes", 0) / 2**20
        out += [
            Row(
                f"{m} (speed-up)",
                g(c) / g(b),
                HIGHER,
                f"{n}; {held:.0f} MiB in huge pages" if n else n,
            )
            for m, c, b, n in HUGE_PAGE_SERVER
        ]
    if "kv_lmdb_save_first_huge_tmpfs" in r:
        mount = r.get("huge_tmpfs_mount", "huge=?")
        held = r.get("huge_tmpfs_huge_pages_bytes", 0) / 2**20
        note = f"tmpfs {mount}; {held:.0f} MiB of a first save in huge pages"
        out += [
            Row(f"{m} (speed-up)", g(c) / g(b), HIGHER, note if n else n)
            for m, c, b, n in HUGE_TMPFS
        ]
    out += [Row(f"{m} (time ratio)", t(c) / t(b), LOWER, n) for m, c, b, n in TIME_RATIOS]
    for label, ours in (("LMDB", "kv_lmdb_huge"), ("Redis", "kv_redis_huge")):
        total = sum(runs(f"async_block_{ours}")) / sum(runs("async_block_dcp_fs_shm"))
        out.append(
            Row(
                f"async_save blocking: {label} huge_pages=True / DCP default stager, medians "
                "(time ratio)",
                t(f"async_block_{ours}") / t("async_block_dcp_fs_shm"),
                LOWER,
                f"opt-in; ratio of the totals {total:.2f}",
            )
        )
    for label, gap in (("1 s apart", "gap1"), ("back to back", "back_to_back")):
        later = f"kv_lmdb_new_store_later_{gap}"
        out += [
            Row(
                f"LMDB new store, no get_ready, keep_last=2, saves 2-10 {label}: median (GB/s)",
                g(later),
                HIGHER,
                "against LMDB's own put below",
            ),
            Row(
                f"LMDB new store, no get_ready, keep_last=2, saves 2-10 {label}: slowest (GB/s)",
                size / max(runs(later)) / 1e9,
                HIGHER,
                "the tail",
            ),
        ]
    out.append(
        Row(
            "LMDB put steady, no kvckpt, one write transaction (GB/s)",
            g("raw_lmdb_put_steady"),
            HIGHER,
            "the ceiling",
        )
    )
    for label, name in (
        ("glibc's default memcpy", "default"),
        ("non-temporal memcpy from the part size", "nt"),
        ("every copy in LMDB's put (KVCKPT_LMDB_RESERVE=0)", "put"),
    ):
        if f"store_mode_{name}_later" not in r:
            continue
        own = f"own process, {label}"
        if f"store_mode_{name}_memcpy" in r:
            out.append(
                Row(
                    f"the same parts copied alone, one thread, {own} (GB/s)",
                    g(f"store_mode_{name}_memcpy"),
                    HIGHER,
                    "the machine's copy",
                )
            )
        out += [
            Row(
                f"LMDB new store, no get_ready, saves 2-10 1 s apart, {own}: median (GB/s)",
                g(f"store_mode_{name}_later"),
                HIGHER,
            ),
            Row(
                f"LMDB put steady, no kvckpt, {own} (GB/s)",
                g(f"store_mode_{name}_raw_put"),
                HIGHER,
                "the ceiling",
            ),
        ]
        if f"store_mode_{name}_sum" in r:
            out.append(
                Row(
                    f"checksum cost, LMDB save, {own} (extra time, fraction)",
                    paired_cost(runs(f"store_mode_{name}_sum"), runs(f"store_mode_{name}_nosum")),
                    LOWER,
                )
            )
    if "store_mode_put_later" in r and "store_mode_default_later" in r:
        out.append(
            Row(
                "LMDB saves 2-10, own processes: kvckpt copying into reserved room / every copy in "
                "LMDB's put (speed-up)",
                g("store_mode_default_later") / g("store_mode_put_later"),
                HIGHER,
                "both with glibc's default memcpy",
            )
        )
    out += [Row(f"{m} (speed-up)", g(c) / g(b), HIGHER, n) for m, c, b, n in OTHER_SPEED_UPS]
    for label, plain, summed in CHECKSUM_PAIRS:
        if summed not in r:  # (runs before the Redis steady pair existed lack it)
            continue
        out.append(
            Row(
                f"checksum cost, {label} (extra time, fraction)",
                paired_cost(runs(summed), runs(plain)),
                LOWER,
            )
        )
    out += rss_rows(r)
    return out


def rss_rows(r: dict[str, Any]) -> list[Row]:
    """Peak anonymous RSS above the state dict, over what each call is allowed."""
    rss, size = r["rss_delta_bytes"], r["state_dict_bytes"]
    part = r["part_bytes_redis"]
    largest = r.get("largest_tensor_bytes", part)
    out = []
    for key, label, allowed, text in (
        ("kv_lmdb_save", "LMDB save", 0.1 * size + part, "(10% of the state dict + 1 part)"),
        ("kv_redis_save", "Redis save", 0.1 * size + part, "(10% of the state dict + 1 part)"),
        ("kv_lmdb_load", "LMDB load", part, "1 part"),
        ("kv_redis_load", "Redis load", part, "1 part"),
        (
            "kv_safetensors_export",
            "safetensors export",
            1.1 * largest,
            "(the largest tensor + 10%)",
        ),
    ):
        if key in rss:
            out.append(
                Row(
                    f"peak anon RSS, {label} / {text}",
                    rss[key] / allowed,
                    LOWER,
                    f"{rss[key] / size:.3f} of the state dict",
                )
            )
    return out
