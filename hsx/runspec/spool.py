"""The local spool: finished batch files waiting for their upload, in two tiers with a byte budget each.

Tiers, tried in this order by the GPU worker's writer:
- ``memory``: a tmpfs folder (e.g. /dev/shm/hsx). Fast, and lost with the host: the ledger makes
  that safe (a batch is done only once verified in the store; a lost file is extracted again).
- ``disk``: the spool folder on a local disk (``--spool-dir``), used only while memory is full.
The GPU worker stops taking jobs only when every tier is at its budget.

A tier's budget is the smaller of its flag and what its file system can hold: the free
space ``statvfs`` reports, less a margin (``free_room``), checked before each write. A full
disk is backpressure like a full budget: the worker takes no job, and a write that still
meets ENOSPC waits and is tried again; it never counts against the batch.

The memory tier's default folder is ``/dev/shm/hsx-<uid>-<Redis tag>`` (``default_memory_dir``): one a user and
Redis server, so two users, or a test run beside a real run, on one host never share it (an older
hsx wrote ``/dev/shm/hsx`` for every install). Files an older hsx left in ``/dev/shm/hsx/<run>/`` are this
user's to upload: a worker of the run moves them into its memory folder at start (``adopt_legacy_spool``), and an
uploader takes an old job naming one there the same way.

A role that stops cleanly removes the memory tier's empty run folders, and the default folder itself once empty
(``remove_empty_spool_folders``): nothing is left in /dev/shm after the roles of a host stopped with their work done.

Inside a tier: ``<tier dir>/<run>/<batch>.safetensors`` and, while being written,
``<batch>.safetensors.tmp-<writer's worker name>+<pid>.<n>`` (``spool_temp_tag``): the worker name is what the sweeps
read (whose write it is, alive or not); ``+<pid>.<n>`` makes the file one write's own. Two writes of one batch
in one worker (a duplicate delivery) used to share ``.tmp-<worker name>``: the first's rename moved the file away
under the second, which failed with FileNotFoundError (tests/test_temp_race.py). Usage counts both: a temp file
takes the same bytes (leaked temp files once escaped the budget).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hsx import defaults as D
from hsx.store import layout

TMP_MARK = ".tmp-"  # <batch>.safetensors.tmp-<writer's worker name>+<pid>.<n>: a write in progress
WRITE_MARK = "+"    # after the worker name: what makes the temp file one write's (no --name holds a '+')
MEMORY_TIER, DISK_TIER = "memory", "disk"
FREE_MARGIN_BYTES = 256 * 2**20  # bytes a spool leaves free on its file system (at most 1/20 of the file system)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a write that meets these waits for room: backpressure, not failure


LEGACY_MEMORY_DIR = Path("/dev/shm/hsx")  # the memory tier's default of an older hsx: shared by every install
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")


def redis_tag(redis_url: str) -> str:
    """8 hex digits naming the Redis server and database of ``redis_url`` (host, port, db, or socket path;
    never the password): the same for every spelling of a loopback address."""
    import redis

    kw = redis.connection.parse_url(redis_url)
    host = str(kw.get("host") or "").lower()
    where = (f"unix:{kw['path']}" if kw.get("path") else
             f"{'localhost' if host in _LOOPBACK else host}:{kw.get('port') or 6379}") + f"/{kw.get('db') or 0}"
    return hashlib.sha256(where.encode()).hexdigest()[:8]


def default_memory_dir(redis_url: str, shm: Path = Path(D.MEMORY_SPOOL_SHM)) -> Path:
    """The memory tier's folder when none is given: one a user and Redis server (``hsx-<uid>-<redis_tag>``)."""
    return Path(shm) / f"hsx-{os.getuid()}-{redis_tag(redis_url)}"


def adopt_legacy_spool(run: str, into: Path, legacy: Path = LEGACY_MEMORY_DIR) -> list[Path]:
    """Move this user's complete batch files of ``run`` from the old shared default ``legacy/<run>/`` into
    ``into/<run>/`` (a rename on the same tmpfs); their new paths. Temp files (a write an older worker never
    finished) and other users' files stay."""
    src = Path(legacy) / run
    if not src.is_dir() or Path(into).resolve() == Path(legacy).resolve():
        return []
    moved = []
    for path in spool_files(legacy, run):
        try:
            if path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            dest = layout.spool_path(Path(into), run, path.name.removesuffix(".safetensors"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, dest)
        except FileNotFoundError:  # uploaded or moved by another process meanwhile
            continue
        moved.append(dest)
    return moved


def remove_empty_spool_folders(tier_dir: Path, itself: bool) -> list[Path]:
    """Remove the empty run folders right under ``tier_dir`` and, with ``itself``, ``tier_dir`` when that leaves it
    empty; the folders removed. What a role's clean stop does with its memory tier (else empty
    /dev/shm/hsx-* folders stay after every role had stopped); ``itself`` only for hsx's own default folder,
    never one a person named. rmdir only: a folder holding anything (a batch, another role's temp file) stays,
    and a writer that finds its folder gone makes it again (hsx.batch write_atomic)."""
    removed = []
    root = Path(tier_dir)
    try:
        entries = [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return removed
    for folder in [*entries, *([root] if itself else [])]:
        try:
            folder.rmdir()
        except OSError:   # not empty (ENOTEMPTY), gone already, or not ours to remove: it stays
            continue
        removed.append(folder)
    return removed


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def _existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (a folder not created yet is measured there)."""
    d = Path(path).absolute()
    while not d.exists() and d != d.parent:
        d = d.parent
    return d


def fs_type(path: Path) -> str | None:
    """The file system type (e.g. tmpfs) holding ``path``, from /proc/self/mounts; None when unknown."""
    d, best, kind = os.path.realpath(_existing(path)), "", None
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = d == point or d.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def auto_memory_budget(memory_dir: Path, cap: int = D.MEMORY_SPOOL_AUTO_CAP_BYTES,
                       share: float = D.MEMORY_SPOOL_AUTO_SHARE,
                       minimum: int = D.MEMORY_SPOOL_AUTO_MIN_BYTES) -> tuple[int, str]:
    """The memory tier's budget when none is given: ``share`` of its tmpfs's free space now, at most ``cap``;
    0 (off) when the folder is not on a tmpfs or that is under ``minimum``. Returns (bytes, why)."""
    kind = fs_type(memory_dir)
    if kind not in ("tmpfs", "ramfs"):
        return 0, f"{memory_dir} is not on a tmpfs (file system {kind or 'unknown'}): memory tier off"
    where = _existing(memory_dir)
    if not os.access(where, os.W_OK):
        return 0, f"{where} is not writable: memory tier off"
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    size = min(cap, int(free * share))
    if size < minimum:
        return 0, (f"{share:g} of the {free / 2**30:.2f} GiB free on the tmpfs of {memory_dir} is under "
                   f"{minimum / 2**30:g} GiB: memory tier off (give it room, e.g. docker shm_size)")
    return size, (f"auto: {share:g} of the {free / 2**30:.2f} GiB free on the tmpfs of {memory_dir}, "
                  f"at most {cap / 2**30:g} GiB")


def free_room(spool_dir: Path) -> int:
    """Bytes a spool may still write on the file system of ``spool_dir``: free space less the margin.

    0 when the file system has no free inode. A folder not created yet is measured at its nearest parent.
    """
    st = os.statvfs(_existing(spool_dir))
    if st.f_files and not st.f_favail:
        return 0
    margin = min(FREE_MARGIN_BYTES, st.f_blocks * st.f_frsize // 20)
    return max(0, st.f_bavail * st.f_frsize - margin)


@dataclass(frozen=True)
class SpoolUsage:
    files: int        # complete batch files
    bytes: int        # complete + temp files
    temp_files: int = 0
    temp_bytes: int = 0


def spool_usage(spool_dir: Path) -> SpoolUsage:
    """Batch files (complete and in progress) and their bytes, over every run under ``spool_dir``."""
    files = total = temps = temp_bytes = 0
    root = Path(spool_dir)
    if not root.exists():
        return SpoolUsage(0, 0)
    for run_dir in os.scandir(root):
        if not run_dir.is_dir():
            continue
        for entry in os.scandir(run_dir.path):
            complete = entry.name.endswith(".safetensors")
            if not complete and TMP_MARK not in entry.name:
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:  # uploaded (or renamed) meanwhile
                continue
            total += size
            if complete:
                files += 1
            else:
                temps, temp_bytes = temps + 1, temp_bytes + size
    return SpoolUsage(files, total, temps, temp_bytes)


def spool_files(spool_dir: Path, run: str) -> list[Path]:
    d = Path(spool_dir) / run
    return sorted(d.glob("*.safetensors")) if d.exists() else []


_writes = itertools.count()  # this process's writes: next() is atomic under the GIL, so one number a write


def spool_temp_tag(worker_name: str) -> str:
    """The tag of one write's temp file (``<batch>.safetensors.tmp-<tag>``): ``<worker name>+<pid>.<n>``, new at
    every call, so concurrent writes of one batch by one worker never share a file."""
    return f"{worker_name}{WRITE_MARK}{os.getpid()}.{next(_writes)}"


def _writer_of(tag: str) -> str:
    """The worker name in a temp file's tag; a tag with no per-write part (an older hsx's) is the name itself."""
    name, mark, _ = tag.rpartition(WRITE_MARK)
    return name if mark else tag


def spool_temp_files(spool_dir: Path, run: str) -> dict[Path, str]:
    """Temp files of ``run`` -> the writer's worker name in their name (``spool_temp_tag``)."""
    d = Path(spool_dir) / run
    if not d.exists():
        return {}
    return {p: _writer_of(p.name.split(TMP_MARK, 1)[1]) for p in sorted(d.iterdir()) if TMP_MARK in p.name}


@dataclass(frozen=True)
class Tier:
    name: str          # memory | disk
    dir: Path
    budget_bytes: int


@dataclass(frozen=True)
class SpoolTiers:
    """A host's spool tiers, memory first. A tier with budget 0 or no folder is left out."""

    tiers: tuple[Tier, ...]

    @classmethod
    def of(cls, disk_dir: Path, disk_budget: int, memory_dir: Path | None = None,
           memory_budget: int = 0) -> SpoolTiers:
        tiers = []
        if memory_dir is not None and memory_budget > 0:
            tiers.append(Tier(MEMORY_TIER, Path(memory_dir), memory_budget))
        tiers.append(Tier(DISK_TIER, Path(disk_dir), disk_budget))
        return cls(tuple(tiers))

    def get(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"spool tier {name!r} is not configured on this host ({', '.join(t.name for t in self.tiers)})")

    def usage(self) -> dict[str, SpoolUsage]:
        return {t.name: spool_usage(t.dir) for t in self.tiers}

    def choose(self, nbytes: int) -> Tier | None:
        """The first tier with room for ``nbytes`` more: under its budget (a tier that is empty takes any
        size) and on a file system with ``nbytes`` of free room."""
        for tier in self.tiers:
            used = spool_usage(tier.dir).bytes
            if ((used + nbytes <= tier.budget_bytes or (used == 0 and tier.budget_bytes > 0))
                    and nbytes <= free_room(tier.dir)):
                return tier
        return None

    def full(self, nbytes: int = 0) -> bool:
        """Every tier at or over its budget, or its file system without room for ``nbytes`` (the size of a
        batch, as far as the caller knows; at least one byte): the worker takes no job until uploads free some."""
        return all(spool_usage(t.dir).bytes >= t.budget_bytes or free_room(t.dir) < max(nbytes, 1) for t in self.tiers)

    def describe(self) -> str:
        """Each tier's budget and its file system's free room, for the "spool full" log line."""
        return ", ".join(f"{t.name} {t.dir}: budget {t.budget_bytes / 2**30:.2f} GiB, file system room "
                         f"{free_room(t.dir) / 2**20:.1f} MiB" for t in self.tiers)

    def path(self, tier: str, run: str, bid: str) -> Path:
        return layout.spool_path(self.get(tier).dir, run, bid)
