"""Shared-memory tensor segments between processes on one machine.

Every process that takes part owns one *segment*: a file in a shared-memory directory
(/dev/shm by default) that it keeps an exclusive `flock` on for as long as it lives, mapped
read-write by the owner and read-only by its peers. A tensor sent to a peer that shares the
directory is copied once into a block of the sender's segment; only a handle (segment, offset,
lease) travels over ZMQ, and the reader views the bytes where they lie.

Lifetimes are explicit:
- A block lent in a reply belongs to its owner until the borrower sends `release` (the
  orchestrator does at the end of each request, and for a streamed chunk once its downstream
  credited it), or until the borrower's segment is gone or unlocked: a borrower that dies,
  even by SIGKILL, gives its blocks back.
- A block sent in a request is freed when that request's terminal reply arrives (the worker is
  then done with it), or when the channel closes.
- A segment whose owner died (its lock is free) is unlinked by whichever live process sweeps
  first: every manager sweeps at start and every `SWEEP_S` seconds, and `omnistage serve`
  leaves a reaper behind that sweeps its session once the serve process is gone.

Each segment is capped (`ShmConfig.cap_bytes`, the sum over processes bounds the machine): a
sender that finds its segment full waits for blocks to come back (back-pressure), or, given a
patience (streamed chunks), only that long before it sends frames instead. Pages are
reserved with fallocate before anything is written, so a full tmpfs makes the sender wait or
fall back to frames; it never faults with SIGBUS or runs the machine out of memory.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from omnistage import backoff, kube
from omnistage import protocol as p

log = logging.getLogger("omnistage.shm")

ENV_DIR = kube.ENV_SHM_DIR  # the shared directory; unset: no shared memory
ENV_CAP = kube.ENV_SHM_CAP  # each process's segment cap
ENV_SESSION = kube.ENV_SHM_SESSION  # groups one `omnistage serve`'s segments for its reaper
ENV_ENABLE = "OMNISTAGE_SHM"  # "0" turns shared memory off for `omnistage serve`
ENV_MIN = "OMNISTAGE_SHM_MIN_BYTES"  # smaller tensors travel as frames

PREFIX = "omnistage-shm"
NAME_RE = re.compile(r"^omnistage-shm\.([a-z0-9-]{1,40})\.([0-9]{1,10})\.([0-9a-f]{16})$")
MAGIC = b"OMNISHM1"
PAGE = mmap.PAGESIZE
HEADER = PAGE  # page 0: magic and nonce; blocks start on the next page
DEFAULT_CAP = 1 << 30
MIN_BYTES = 64 << 10  # smaller tensors go as frames: a handle and a release cost more
SWEEP_S = 2.0  # how often a manager sweeps dead owners and reclaims dead borrowers' blocks
IDLE_TRIM_S = 10.0  # an idle segment gives its pages back to the system after this long
THREAD_COPY_BYTES = 8 << 20  # copies this large run off the event loop


class ShmError(RuntimeError):
    """Shared memory cannot be set up here (no such directory, not writable, ...)."""


class WaitCancelled(Exception):
    """The request was cancelled while its sender waited for room in shared memory."""


@dataclass(frozen=True)
class ShmConfig:
    """Where segments live and how large this process's may grow."""

    dir: Path
    cap_bytes: int = DEFAULT_CAP
    session: str = "default"
    min_bytes: int = MIN_BYTES

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9-]{1,40}", self.session):
            raise ShmError(f"{ENV_SESSION}: {self.session!r} must be 1-40 of [a-z0-9-]")
        if self.cap_bytes < PAGE:
            raise ShmError(f"{ENV_CAP}: the cap must be at least one page ({PAGE} bytes)")
        if self.min_bytes < 0:
            raise ShmError(f"{ENV_MIN}: must be >= 0, got {self.min_bytes}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ShmConfig | None:
        """The configuration a launched process was given; None when it has no shared dir."""
        env = os.environ if env is None else env
        where = env.get(ENV_DIR, "")
        if not where:
            return None
        cap, least = env.get(ENV_CAP, ""), env.get(ENV_MIN, "")
        try:
            cap_bytes = int(float(cap) * (1 << 20)) if cap else DEFAULT_CAP
        except ValueError:
            raise ShmError(f"{ENV_CAP}: {cap!r} is not a number of MiB") from None
        try:
            min_bytes = int(least) if least else MIN_BYTES
        except ValueError:
            raise ShmError(f"{ENV_MIN}: {least!r} is not a whole number of bytes") from None
        return cls(Path(where), cap_bytes, env.get(ENV_SESSION, "") or "default", min_bytes)

    @classmethod
    def local(cls, env: Mapping[str, str] | None = None) -> ShmConfig | None:
        """For `omnistage serve`: /dev/shm (or $OMNISTAGE_SHM_DIR) with a fresh session,
        unless $OMNISTAGE_SHM is 0 or the directory is not writable."""
        env = os.environ if env is None else env
        if env.get(ENV_ENABLE, "1").lower() in ("0", "false", "no", "off"):
            return None
        base = cls.from_env({**env, ENV_DIR: env.get(ENV_DIR) or "/dev/shm"})
        assert base is not None
        if not (base.dir.is_dir() and os.access(base.dir, os.W_OK | os.X_OK)):
            log.info("shared memory off: %s is not a writable directory", base.dir)
            return None
        return replace(base, session=f"s{os.getpid()}-{secrets.token_hex(3)}")

    def env(self) -> dict[str, str]:
        """What a launched process needs to join: ShmConfig.from_env reads it back."""
        return {ENV_DIR: str(self.dir), ENV_CAP: str(self.cap_bytes / (1 << 20)),
                ENV_SESSION: self.session, ENV_MIN: str(self.min_bytes)}


# ---- liveness and sweeping -------------------------------------------------------------------


def owner_alive(path: Path) -> bool:
    """True while the segment at path exists and its owner holds its lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # another user's: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops a lock we took
    return False


def sweep(directory: Path, session: str | None = None, keep: str = "") -> list[str]:
    """Unlink every segment in directory whose owner is dead; returns their names.

    With session, only that session's segments. A segment is dead when its lock can be taken:
    the kernel drops a process's locks when it exits, however it exits.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = NAME_RE.match(name)
        if m is None or name == keep or (session is not None and m.group(1) != session):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Still the file we locked (not a new one under the same name)? Then it is dead.
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # locked (alive), or another sweeper was first
        finally:
            os.close(fd)
    if removed:
        log.info("swept %d segment(s) of dead processes from %s: %s", len(removed), directory,
                 ", ".join(removed))
    return removed


def session_segments(directory: Path, session: str) -> list[str]:
    """The names of the session's segments still in directory."""
    try:
        return [n for n in os.listdir(directory)
                if (m := NAME_RE.match(n)) is not None and m.group(1) == session]
    except OSError:
        return []


# ---- this process's segment ----------------------------------------------------------------


class Block(NamedTuple):
    """A live block of the owner's segment."""

    lease: int
    offset: int
    size: int  # rounded up to whole pages
    nbytes: int  # what the tensor uses


class Segment:
    """This process's own segment: a sparse file of cap + one header page, locked while we live.

    A first-fit allocator hands out page-aligned blocks. Freed blocks keep their pages, so the
    next tensor of that size finds them mapped in the sender and in every reader (no page
    faults); after IDLE_TRIM_S without a live block, the pages go back to the system.
    """

    def __init__(self, cfg: ShmConfig) -> None:
        self.cfg = cfg
        self.name = f"{PREFIX}.{cfg.session}.{os.getpid()}.{secrets.token_hex(8)}"
        self.path = cfg.dir / self.name
        self.nonce = secrets.token_hex(16)
        self.capacity = cfg.cap_bytes // PAGE * PAGE
        self.size = HEADER + self.capacity
        self._fd = _create_locked(cfg.dir, self.path, self.size,
                                  MAGIC + bytes.fromhex(self.nonce))
        self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._mm)
        self._free: list[tuple[int, int]] = [(HEADER, self.capacity)]  # (offset, size), sorted
        self._blocks: dict[int, Block] = {}
        self._leases = iter(range(1, 1 << 62))
        self.used = 0
        self._backed = HEADER  # [0, _backed) is reserved with fallocate
        self._idle_since: float | None = time.monotonic()
        self.closed = False

    def alloc(self, nbytes: int) -> Block | None:
        """A block of at least nbytes, or None when the cap (or the tmpfs) has no room now."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        for i, (off, free) in enumerate(self._free):  # noqa: B007 - used after the loop
            if free >= size:
                break
        else:
            return None
        end = off + size
        if end > self._backed:
            try:  # reserve the pages now: writing to an unbacked tmpfs page could SIGBUS
                os.posix_fallocate(self._fd, self._backed, end - self._backed)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                log.warning("shared memory directory %s is full (%s)", self.cfg.dir, exc)
                return None
            self._backed = end
        if free == size:
            del self._free[i]
        else:
            self._free[i] = (end, free - size)
        block = Block(next(self._leases), off, size, nbytes)
        self._blocks[block.lease] = block
        self.used += size
        self._idle_since = None
        return block

    def free(self, lease: int) -> bool:
        """Give a block back; False for a lease that is not live (already freed, or foreign)."""
        block = self._blocks.pop(lease, None)
        if block is None:
            return False
        self.used -= block.size
        i = bisect.bisect(self._free, (block.offset, 0))
        off, size = block.offset, block.size
        if i < len(self._free) and off + size == self._free[i][0]:  # merge with the next
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous
            off, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (off, size))
        if not self._blocks:
            self._idle_since = time.monotonic()
        return True

    def view(self, block: Block) -> memoryview:
        """The block's bytes, writable (only the owner writes)."""
        return self._view[block.offset:block.offset + block.nbytes]

    def lease_of(self, lease: int) -> Block | None:
        return self._blocks.get(lease)

    @property
    def live(self) -> int:
        return len(self._blocks)

    @property
    def backed(self) -> int:
        """Bytes of the file reserved in memory (header included)."""
        return self._backed

    def trim(self, idle_s: float = IDLE_TRIM_S) -> int:
        """Give the pages back when no block has been live for idle_s; returns bytes freed."""
        if self._blocks or self._idle_since is None or self._backed <= HEADER:
            return 0
        if time.monotonic() - self._idle_since < idle_s:
            return 0
        freed = self._backed - HEADER
        self._mm.madvise(mmap.MADV_REMOVE, HEADER, freed)
        self._backed = HEADER
        return freed

    def close(self) -> None:
        """Unlink the file and drop the lock. Readers' mappings stay valid until they unmap."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):  # a view still exported: the GC unmaps it later
            self._view.release()
            self._mm.close()
        os.close(self._fd)


def _create_locked(directory: Path, path: Path, size: int, header: bytes) -> int:
    """Create the segment already locked, then give it its name, so no sweeper ever sees it
    unlocked (O_TMPFILE, then link). Falls back to create-then-lock where O_TMPFILE is
    missing."""
    if not directory.is_dir():
        raise ShmError(f"shared-memory directory {directory} does not exist")
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        tmpfile = True
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise ShmError(f"cannot create a segment in {directory}: {exc}") from None
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        tmpfile = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, HEADER)
        os.pwrite(fd, header, 0)
        if tmpfile:  # linkat(AT_SYMLINK_FOLLOW), which os.link uses only given a dir fd
            dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=dirfd)
            finally:
                os.close(dirfd)
    except OSError as exc:
        os.close(fd)
        if not tmpfile:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise ShmError(f"cannot create segment {path}: {exc}") from None
    return fd


# ---- peers' segments -------------------------------------------------------------------------


class _Mapped:
    """A peer's segment, mapped read-only."""

    __slots__ = ("mm", "nonce", "size", "view")

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            if self.size < HEADER:
                raise ValueError("it is not a segment (too small)")
            self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.view = memoryview(self.mm)
        if bytes(self.view[:len(MAGIC)]) != MAGIC:
            raise ValueError("it is not a segment (bad magic)")
        self.nonce = bytes(self.view[len(MAGIC):len(MAGIC) + 16]).hex()


# ---- the manager -----------------------------------------------------------------------------


class SegmentManager:
    """One process's part in shared memory: its own segment, its peers' mapped segments, the
    blocks it lent (and to whom), and the sweeping that keeps nothing behind."""

    MAX_MAPPED = 256

    def __init__(self, cfg: ShmConfig) -> None:
        self.cfg = cfg
        cfg.dir.mkdir(parents=True, exist_ok=True)
        sweep(cfg.dir)  # leftovers of processes that died before us
        self.segment = Segment(cfg)
        self.name = self.segment.name
        self._mapped: dict[str, _Mapped] = {}
        self._lent: dict[int, str] = {}  # lease -> borrower segment
        self._borrowed: dict[str, set[int]] = {}  # borrower segment -> leases
        self.peers: set[str] = set()  # segments whose probe we verified (they see ours too)
        # Borrowed blocks go back through an open channel to their lender; while it has none
        # (a replica between channels), they wait here.
        self._lenders: dict[str, Callable[[list[int]], None]] = {}
        self._pending: dict[str, list[int]] = {}
        self._waiters: deque[object] = deque()
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.counters: dict[str, int] = {"placed": 0, "waits": 0, "fallbacks": 0,
                                         "reclaimed": 0, "swept": 0}

    # ---- handshake -----------------------------------------------------------------------

    def probe(self) -> p.ShmProbe:
        return p.ShmProbe(self.name, self.segment.nonce)

    def verify(self, probe: p.ShmProbe | None) -> bool:
        """True when the peer's segment is in our directory with the nonce it claims: we share
        a machine and a directory, so each can map the other's blocks."""
        if probe is None:
            return False
        if probe.segment == self.name:
            return True
        try:
            ok = self._map(probe.segment).nonce == probe.nonce
        except p.ShmUnavailable:
            return False
        if ok:
            self.peers.add(probe.segment)
        return ok

    # ---- reading -------------------------------------------------------------------------

    def resolve(self, desc: p.ShmTensor, nbytes: int) -> memoryview:
        """A read-only view of a shared-memory tensor (protocol.ShmResolver)."""
        if desc.segment == self.name:
            seg = self.segment
            block = seg.lease_of(desc.lease)
            if block is None or block.offset != desc.offset or block.nbytes < nbytes:
                raise p.ShmUnavailable(f"lease {desc.lease} is not live in {desc.segment}")
            return seg.view(block).toreadonly()[:nbytes]
        mapped = self._map(desc.segment)
        if desc.offset < HEADER or desc.offset + nbytes > mapped.size:
            raise p.ShmUnavailable(
                f"block [{desc.offset}, {desc.offset + nbytes}) lies outside segment "
                f"{desc.segment} ({mapped.size} bytes)")
        return mapped.view[desc.offset:desc.offset + nbytes]

    def _map(self, segment: str) -> _Mapped:
        mapped = self._mapped.get(segment)
        if mapped is not None:
            return mapped
        if NAME_RE.match(segment) is None:
            raise p.ShmUnavailable(f"{segment!r} is not a segment name")
        try:
            mapped = _Mapped(self.cfg.dir / segment)
        except FileNotFoundError:
            raise p.ShmUnavailable(
                f"segment {segment} is not in {self.cfg.dir} (its owner exited, or runs on "
                "another machine)") from None
        except (OSError, ValueError) as exc:
            raise p.ShmUnavailable(f"cannot map segment {segment}: {exc}") from None
        if len(self._mapped) >= self.MAX_MAPPED:  # the oldest; views keep their own mapping
            self._mapped.pop(next(iter(self._mapped)))
        self._mapped[segment] = mapped
        return mapped

    # ---- writing -------------------------------------------------------------------------

    def wants(self, value: Any) -> bool:
        """Whether value should travel through shared memory (large, and not there already)."""
        if isinstance(value, p.WireTensor):
            return value.shm is None and value.nbytes >= self.cfg.min_bytes
        nbytes = getattr(value, "nbytes", None)
        return isinstance(nbytes, int) and nbytes >= self.cfg.min_bytes

    def try_place(self, value: Any, borrower: str | None = None) -> p.WireTensor | None:
        """value copied into a new block of our segment, or None when it has no room now.

        With borrower, the block is lent to that peer until it releases it (or dies); without,
        the caller frees it (ReplicaChannel does, when the request's terminal reply arrives).
        """
        wt = p.WireTensor.from_any(value)
        block = self.segment.alloc(wt.nbytes) if not self._waiters else None
        if block is None:
            return None
        return self._fill(block, wt, borrower)

    async def place(
        self,
        value: Any,
        borrower: str | None = None,
        deadline: float | None = None,
        cancelled: Callable[[], bool] | None = None,
        patience: float | None = None,
    ) -> p.WireTensor | None:
        """Like try_place, but waits (FIFO) for room while the segment is full: back-pressure.

        Returns None when waiting cannot help (the tensor exceeds the cap, or the directory is
        full while nothing of ours is live) or, with patience, once it waited that many seconds
        (a sender whose own window bounds what it has out, a streamed chunk, must not wait on
        blocks that other requests hold): send it as frames then. Raises TimeoutError at the
        deadline (a time.monotonic() value) and WaitCancelled when cancelled() turns true.
        """
        wt = p.WireTensor.from_any(value)
        seg = self.segment
        if wt.nbytes > seg.capacity:
            self.counters["fallbacks"] += 1
            return None
        block = seg.alloc(wt.nbytes) if not self._waiters else None
        if block is None:
            block = await self._wait_for(wt.nbytes, deadline, cancelled, patience)
            if block is None:
                self.counters["fallbacks"] += 1
                return None
        if wt.nbytes >= THREAD_COPY_BYTES:
            await asyncio.to_thread(_copy, seg.view(block), wt)
            return self._fill(block, wt, borrower, copied=True)
        return self._fill(block, wt, borrower)

    async def _wait_for(
        self, nbytes: int, deadline: float | None, cancelled: Callable[[], bool] | None,
        patience: float | None = None,
    ) -> Block | None:
        self.counters["waits"] += 1
        changed = self._event()
        ticket = object()
        self._waiters.append(ticket)
        give_up = None if patience is None else time.monotonic() + patience
        try:
            while True:
                if self._waiters[0] is ticket:
                    block = self.segment.alloc(nbytes)
                    if block is not None:
                        return block
                    if self.segment.live == 0:  # the directory itself is full
                        return None
                if cancelled is not None and cancelled():
                    raise WaitCancelled("cancelled while waiting for room in shared memory")
                wait = SWEEP_S / 4
                if give_up is not None:
                    left = give_up - time.monotonic()
                    if left <= 0 and (deadline is None or time.monotonic() < deadline):
                        return None  # patience spent: frames, not a wait on others' blocks
                    wait = min(wait, max(left, 0.0))
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"no room in shared memory ({self.segment.used} of "
                            f"{self.segment.capacity} bytes lent) before the deadline")
                    wait = min(wait, left)
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), wait)
                except TimeoutError:
                    self.reclaim()  # a borrower that died gives its blocks back
        finally:
            self._waiters.remove(ticket)
            changed.set()  # the next waiter tries now

    def _fill(self, block: Block, wt: p.WireTensor, borrower: str | None,
              copied: bool = False) -> p.WireTensor:
        view = self.segment.view(block)
        if not copied:
            _copy(view, wt)
        if borrower is not None:
            self._lent[block.lease] = borrower
            self._borrowed.setdefault(borrower, set()).add(block.lease)
        self.counters["placed"] += 1
        return p.WireTensor(wt.dtype, wt.shape, view.toreadonly(),
                            p.ShmRef(self.name, block.offset, block.lease))

    def free(self, leases: list[int] | tuple[int, ...]) -> int:
        """Give blocks of our segment back (a `release`, a terminal reply, a lost channel).
        Unknown or already freed leases are ignored; returns how many were freed."""
        freed = 0
        for lease in leases:
            borrower = self._lent.pop(lease, None)
            if borrower is not None:
                held = self._borrowed.get(borrower)
                if held is not None:
                    held.discard(lease)
                    if not held:
                        del self._borrowed[borrower]
            freed += self.segment.free(lease)
        if freed and self._changed is not None:
            self._changed.set()
        return freed

    # ---- borrowing -----------------------------------------------------------------------

    def attach_lender(self, segment: str, send_release: Callable[[list[int]], None]) -> None:
        """A channel to the owner of segment is open: releases go through it from now on."""
        self._lenders[segment] = send_release
        pending = self._pending.pop(segment, None)
        if pending:
            send_release(pending)

    def detach_lender(self, segment: str, send_release: Callable[[list[int]], None]) -> None:
        if self._lenders.get(segment) == send_release:  # bound methods are equal, not identical
            del self._lenders[segment]

    def release(self, msg: p.Message[Any]) -> None:
        """The reader is done with a reply: its lender's blocks go back to the lender, and
        blocks of our own segment that it carried (an echo of what we sent) are freed."""
        own = [wt.shm.lease for wt in msg.tensors.values()
               if wt.shm is not None and wt.shm.segment == self.name]
        if own:
            self.free(own)
        if msg.lender is None or msg.lender == self.name:
            return
        leases = p.lent_leases(msg, msg.lender)
        if not leases:
            return
        send = self._lenders.get(msg.lender)
        if send is None:
            self._pending.setdefault(msg.lender, []).extend(leases)
            return
        try:
            send(leases)
        except Exception:  # the channel is closing: keep them for the next one
            self._pending.setdefault(msg.lender, []).extend(leases)

    @property
    def pending(self) -> int:
        """Borrowed blocks waiting for a channel to their lender."""
        return sum(len(v) for v in self._pending.values())

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    # ---- upkeep --------------------------------------------------------------------------

    def reclaim(self) -> int:
        """Free every block lent to a borrower whose segment is gone or unlocked (it died)."""
        freed = 0
        for borrower in list(self._borrowed):
            if owner_alive(self.cfg.dir / borrower):
                continue
            leases = list(self._borrowed.get(borrower, ()))
            freed += self.free(leases)
            self.peers.discard(borrower)
            log.info("reclaimed %d block(s) lent to %s, which is gone", len(leases), borrower)
        self.counters["reclaimed"] += freed
        return freed

    def upkeep(self) -> None:
        """One round of housekeeping: sweep dead owners, reclaim dead borrowers' blocks, forget
        mappings of segments that are gone, give idle pages back."""
        self.counters["swept"] += len(sweep(self.cfg.dir, keep=self.name))
        self.reclaim()
        for name in list(self._mapped):
            if not (self.cfg.dir / name).exists():
                del self._mapped[name]
                self.peers.discard(name)
        for name in list(self._pending):  # a lender that is gone took its blocks with it
            if not (self.cfg.dir / name).exists():
                del self._pending[name]
        self.segment.trim()

    async def run(self, every: float = SWEEP_S) -> None:
        """upkeep() every `every` seconds, until cancelled."""
        while True:
            await asyncio.sleep(every)
            try:
                self.upkeep()
            except Exception:  # housekeeping never takes the process down
                log.exception("shared-memory upkeep failed")

    def start(self) -> None:
        """Run upkeep in the background on the running event loop (close() stops it)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    def stats(self) -> dict[str, int]:
        seg = self.segment
        return {"capacity": seg.capacity, "used": seg.used, "backed": seg.backed,
                "live": seg.live, "lent": len(self._lent), "mapped": len(self._mapped),
                "pending_releases": self.pending, **self.counters}

    def close(self) -> None:
        """Unlink our segment. Peers' views of it stay readable until they drop them."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._mapped.clear()
        self.segment.close()


def start_segment_manager(cfg: ShmConfig) -> SegmentManager | None:
    """A manager with its upkeep running on this event loop; None (and an error in the log)
    when shared memory cannot be set up: tensors then travel as frames."""
    try:
        manager = SegmentManager(cfg)
    except (ShmError, OSError) as exc:
        log.error("shared memory off: %s", exc)
        return None
    manager.start()
    log.info("shared memory on: segment %s (cap %d MiB)", manager.segment.path,
             manager.segment.capacity >> 20)
    return manager


def _copy(dst: memoryview, wt: p.WireTensor) -> None:
    src = wt.buffer.buffer if hasattr(wt.buffer, "buffer") else wt.buffer
    if len(dst) >= THREAD_COPY_BYTES:  # numpy lets go of the GIL while it copies
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = memoryview(src).cast("B")


# ---- the reaper: `omnistage serve`'s segments never outlive it -------------------------------


def spawn_reaper(cfg: ShmConfig, grace: float = 60.0) -> subprocess.Popen[bytes]:
    """A process that sweeps cfg.session's segments once this process is gone, however it goes.

    It waits for EOF on a pipe only this process holds: closed on purpose (a clean shutdown,
    the reaper sweeps once and exits) or by the kernel when this process dies, SIGKILL
    included; then it sweeps until no segment of the session is left or `grace` seconds pass
    (the session's workers die with their parent). It runs in its own session so a Ctrl-C to
    the terminal does not stop it first.
    """
    return subprocess.Popen(
        [sys.executable, "-m", "omnistage.shm", "reap", str(cfg.dir), cfg.session, str(grace),
         str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


CLEAN_EXIT = b"bye\n"


def release_reaper(reaper: subprocess.Popen[bytes]) -> None:
    """Tell the reaper the session ended cleanly (every replica stopped), then let it go."""
    if reaper.stdin is None:
        return
    with contextlib.suppress(OSError):
        reaper.stdin.write(CLEAN_EXIT)
        reaper.stdin.flush()
    with contextlib.suppress(OSError):
        reaper.stdin.close()


def _reap(directory: Path, session: str, grace: float, parent: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    said = b""
    with contextlib.suppress(OSError):
        while chunk := sys.stdin.buffer.read(65536):
            said += chunk
    # A parent that closes the pipe on purpose says so first (`release_reaper`). Its death is
    # not told by getppid(): the kernel closes a dying process's files, so this EOF, before it
    # reparents its children and sends their PDEATHSIG, so the workers may still be alive here.
    if said.endswith(CLEAN_EXIT):
        sweep(directory, session)
        return 0
    deadline = time.monotonic() + grace
    for delay in backoff.delays(0.05, 1.0):
        sweep(directory, session)
        if not session_segments(directory, session) or time.monotonic() > deadline:
            break
        time.sleep(delay)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "reap":
        sys.exit(_reap(Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5])))
    print("usage: python -m omnistage.shm reap DIR SESSION GRACE_S PARENT_PID", file=sys.stderr)
    sys.exit(2)
