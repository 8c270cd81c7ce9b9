"""The segment manager (omnistage.shm) in one process: allocation, handles, lifetimes, sweeping
and back-pressure. tests/integration/test_shm.py covers the same paths across real processes
(kill -9 included)."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omnistage import protocol as p
from omnistage import shm as S
from tests.harness.waiting import HANG_GUARD, until

MiB = 1 << 20


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    """A private directory on tmpfs when there is one (the real medium), else tmp_path."""
    base = Path("/dev/shm")
    if base.is_dir() and os.access(base, os.W_OK):
        d = base / f"omnistage-test-{os.getpid()}-{tmp_path.name}"
        d.mkdir()
        yield d
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    else:
        yield tmp_path


@pytest.fixture
def managers(shm_dir: Path) -> Iterator[list[S.SegmentManager]]:
    made: list[S.SegmentManager] = []
    yield made
    for m in made:
        m.close()


def manager(made: list[S.SegmentManager], shm_dir: Path, **kw) -> S.SegmentManager:
    m = S.SegmentManager(S.ShmConfig(shm_dir, session="unit", **kw))
    made.append(m)
    return m


def crash(m: S.SegmentManager) -> str:
    """What SIGKILL leaves: the mapping and the descriptor go (so the lock does), the file
    stays."""
    seg = m.segment
    seg._view.release()
    seg._mm.close()
    os.close(seg._fd)
    seg.closed = True
    return m.name


# ---- the allocator -------------------------------------------------------------------------


def test_blocks_are_page_aligned_first_fit_and_coalesce(managers, shm_dir) -> None:
    seg = manager(managers, shm_dir, cap_bytes=4 * S.PAGE).segment
    a, b, c = seg.alloc(1), seg.alloc(S.PAGE + 1), seg.alloc(S.PAGE)
    assert a is not None and b is not None and c is not None
    assert [x.offset % S.PAGE for x in (a, b, c)] == [0, 0, 0]
    assert (a.offset, b.offset, c.offset) == (S.HEADER, S.HEADER + S.PAGE, S.HEADER + 3 * S.PAGE)
    assert seg.alloc(1) is None  # the cap is reached: no room, never an error
    assert seg.used == 4 * S.PAGE
    assert seg.free(a.lease) and seg.free(b.lease)
    assert not seg.free(a.lease)  # a second free of the same lease changes nothing
    assert seg.used == S.PAGE
    big = seg.alloc(3 * S.PAGE)  # a and b's pages merged into one free run
    assert big is not None and big.offset == S.HEADER
    assert len({a.lease, b.lease, c.lease, big.lease}) == 4  # a lease is never reused


def test_pages_are_reserved_before_use_and_given_back_when_idle(managers, shm_dir) -> None:
    seg = manager(managers, shm_dir, cap_bytes=16 * MiB).segment
    block = seg.alloc(4 * MiB)
    assert block is not None
    assert seg.backed == S.HEADER + 4 * MiB
    assert os.stat(seg.path).st_blocks * 512 >= 4 * MiB  # fallocate'd: no SIGBUS later
    assert seg.trim(idle_s=0) == 0  # a live block: nothing is given back
    seg.free(block.lease)
    assert seg.trim(idle_s=60) == 0  # not idle long enough
    assert seg.trim(idle_s=0) == 4 * MiB
    assert seg.backed == S.HEADER
    assert os.stat(seg.path).st_blocks * 512 <= S.HEADER


def test_a_full_directory_is_no_room_not_a_crash(managers, shm_dir, monkeypatch) -> None:
    seg = manager(managers, shm_dir).segment

    def enospc(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    assert seg.alloc(MiB) is None
    assert seg.used == 0 and seg.live == 0


# ---- handles: place, handshake, resolve ----------------------------------------------------


def test_a_peer_reads_the_placed_bytes_in_place(managers, shm_dir) -> None:
    sender, reader = manager(managers, shm_dir), manager(managers, shm_dir)
    assert reader.verify(sender.probe()) and sender.verify(reader.probe())
    x = np.arange(MiB // 4, dtype=np.float32).reshape(256, -1)
    placed = sender.try_place(x)
    assert placed is not None and placed.shm is not None and placed.shm.segment == sender.name
    frames = p.encode(p.Submit(id="r", shm=sender.name), {"x": placed}, shm=True)
    assert len(frames) == 1  # only the handle travels
    msg = p.decode_request(frames, reader.resolve)
    got = msg.tensors["x"]
    assert got.shm == placed.shm
    view = got.numpy()
    np.testing.assert_array_equal(view, x)
    assert not view.flags.writeable  # peers map segments read-only
    sender.segment.view(sender.segment.lease_of(placed.shm.lease))[:4] = b"\0\0\x80\x3f"
    assert view[0, 0] == 1.0  # the same memory, not a copy


def test_without_a_shared_peer_a_placed_tensor_goes_as_a_frame(managers, shm_dir) -> None:
    m = manager(managers, shm_dir)
    x = np.ones(MiB // 4, np.float32)
    placed = m.try_place(x)
    frames = p.encode(p.Final(id="r"), {"x": placed}, shm=False)
    assert len(frames) == 2 and isinstance(frames[1], bytes)  # a copy: the block may go back
    m.free([placed.shm.lease])
    np.testing.assert_array_equal(p.decode_reply(frames).tensors["x"].numpy(), x)


def test_verify_needs_the_same_file_and_nonce(managers, shm_dir, tmp_path) -> None:
    a, b = manager(managers, shm_dir), manager(managers, shm_dir)
    assert not b.verify(p.ShmProbe(a.name, "0" * 32))  # another machine with the same name
    assert not b.verify(p.ShmProbe("omnistage-shm.unit.1.0123456789abcdef", a.segment.nonce))
    assert not b.verify(None)
    elsewhere = S.SegmentManager(S.ShmConfig(tmp_path, session="unit"))  # another directory
    try:
        assert not b.verify(elsewhere.probe())
    finally:
        elsewhere.close()
    assert b.verify(a.probe()) and a.name in b.peers


@pytest.mark.parametrize(("segment", "offset", "error"), [
    ("../../etc/passwd", S.HEADER, "is not a segment name"),
    ("omnistage-shm.unit.1.0123456789abcdef", S.HEADER, "is not in"),
    (None, 0, "lies outside segment"),  # the header page is never a block
    (None, 1 << 40, "lies outside segment"),
])
def test_a_bad_handle_is_a_protocol_error_naming_it(managers, shm_dir, segment, offset,
                                                    error) -> None:
    owner, reader = manager(managers, shm_dir), manager(managers, shm_dir)
    desc = {"in": "shm", "name": "x", "dtype": "uint8", "shape": [8], "lease": 1,
            "segment": segment or owner.name, "offset": offset}
    frames = [p.msgspec.msgpack.encode({"t": "submit", "id": "r", "tensors": [desc]})]
    with pytest.raises(p.ProtocolError, match=r"tensors\[0\] \(x\): .*" + error):
        p.decode_request(frames, reader.resolve)
    with pytest.raises(p.ProtocolError, match="in shared memory, which this peer did not offer"):
        p.decode_request(frames)


def test_a_reply_lends_only_its_senders_blocks(managers, shm_dir) -> None:
    worker, client, other = (manager(managers, shm_dir) for _ in range(3))
    assert client.verify(other.probe()) and worker.verify(other.probe())
    assert client.verify(worker.probe())
    mine = worker.try_place(np.ones(MiB, np.uint8), borrower=client.name)
    passed = other.try_place(np.zeros(MiB, np.uint8))  # another worker's, passed through
    frames = p.encode(p.Final(id="r"), {"a": mine, "b": passed}, shm=True)
    msg = p.decode_reply(frames, client.resolve)
    assert p.lent_leases(msg, worker.name) == [mine.shm.lease]
    assert p.lent_leases(msg, None) == []


# ---- lifetimes -----------------------------------------------------------------------------


def test_release_goes_to_the_lender_or_waits_for_a_channel(managers, shm_dir) -> None:
    worker, client = manager(managers, shm_dir), manager(managers, shm_dir)
    client.verify(worker.probe())
    lent = [worker.try_place(np.ones(MiB, np.uint8), borrower=client.name) for _ in range(3)]
    assert worker.stats()["lent"] == 3

    def reply(wt: p.WireTensor) -> p.Message:
        msg = p.decode_reply(p.encode(p.Final(id="r"), {"x": wt}, shm=True), client.resolve)
        msg.lender = worker.name
        return msg

    released: list[list[int]] = []
    client.attach_lender(worker.name, released.append)
    client.release(reply(lent[0]))
    assert released == [[lent[0].shm.lease]]
    client.detach_lender(worker.name, released.append)
    client.release(reply(lent[1]))  # no channel now: kept until there is one
    assert client.pending == 1
    client.attach_lender(worker.name, worker.free)  # a new channel: the pending one goes
    assert client.pending == 0
    assert worker.stats()["lent"] == 2  # lent[0] went to `released`, not to the worker
    # Releasing a reply twice, or a lease the worker no longer has, frees nothing else.
    client.release(reply(lent[1]))
    assert worker.stats()["lent"] == 2


def test_blocks_lent_to_a_dead_borrower_come_back(managers, shm_dir) -> None:
    worker, client, alive = (manager(managers, shm_dir) for _ in range(3))
    for m in (client, alive):
        worker.verify(m.probe())
    worker.try_place(np.ones(MiB, np.uint8), borrower=client.name)
    kept = worker.try_place(np.ones(MiB, np.uint8), borrower=alive.name)
    assert worker.reclaim() == 0  # both borrowers hold their locks
    crash(client)
    assert worker.reclaim() == 1
    assert worker.stats()["lent"] == 1 and worker.segment.lease_of(kept.shm.lease) is not None
    assert client.name not in worker.peers


def test_sweep_unlinks_only_dead_owners(managers, shm_dir) -> None:
    live, dead = manager(managers, shm_dir), manager(managers, shm_dir)
    stranger = shm_dir / "not-ours"
    stranger.write_bytes(b"x")
    name = crash(dead)
    assert S.owner_alive(shm_dir / live.name) and not S.owner_alive(shm_dir / name)
    assert S.sweep(shm_dir, session="other") == []  # another session's sweep leaves it
    assert S.sweep(shm_dir) == [name]
    assert sorted(os.listdir(shm_dir)) == sorted([live.name, "not-ours"])
    live.close()
    assert not (shm_dir / live.name).exists()  # a clean exit unlinks its own


def test_a_new_manager_sweeps_what_dead_processes_left(managers, shm_dir) -> None:
    name = crash(manager(managers, shm_dir))
    manager(managers, shm_dir)
    assert not (shm_dir / name).exists()


def test_upkeep_forgets_gone_segments_and_their_pending_releases(managers, shm_dir) -> None:
    worker, client = manager(managers, shm_dir), manager(managers, shm_dir)
    client.verify(worker.probe())
    wt = worker.try_place(np.ones(MiB, np.uint8), borrower=client.name)
    msg = p.decode_reply(p.encode(p.Final(id="r"), {"x": wt}, shm=True), client.resolve)
    msg.lender = worker.name
    client.release(msg)
    assert client.pending == 1 and worker.name in client.peers
    worker.close()  # the lender exits: what it lent went with it
    client.upkeep()
    assert client.pending == 0 and worker.name not in client.peers
    assert client.stats()["mapped"] == 0


# ---- back-pressure -------------------------------------------------------------------------


async def test_a_full_segment_makes_the_sender_wait_until_space_frees(managers, shm_dir) -> None:
    m = manager(managers, shm_dir, cap_bytes=2 * MiB)
    x = np.ones(MiB, np.uint8)
    a, b = m.try_place(x), m.try_place(x)
    assert m.try_place(x) is None  # full now

    first = asyncio.ensure_future(m.place(x))
    second = asyncio.ensure_future(m.place(np.full(MiB, 7, np.uint8)))
    await until(lambda: m.stats()["waits"] == 2 or first.done() or second.done(),
                "both senders waiting")
    assert not first.done() and not second.done()  # waiting, not failing
    assert m.try_place(x) is None  # no jumping the queue while others wait
    m.free([a.shm.lease])
    placed = await asyncio.wait_for(first, HANG_GUARD)  # FIFO: the first waiter gets the room
    assert placed is not None and not second.done()
    m.free([b.shm.lease])
    late = await asyncio.wait_for(second, HANG_GUARD)
    assert late is not None and late.numpy()[0] == 7
    assert m.stats()["waits"] == 2 and m.segment.used == 2 * MiB


async def test_waiting_ends_at_the_deadline_or_on_cancel(managers, shm_dir) -> None:
    m = manager(managers, shm_dir, cap_bytes=MiB)
    x = np.ones(MiB, np.uint8)
    held = m.try_place(x)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no room in shared memory"):  # not wait_for's
        await asyncio.wait_for(m.place(x, deadline=time.monotonic() + 0.3), HANG_GUARD)
    assert time.monotonic() - t0 >= 0.25  # not before its deadline (a lower bound only)
    cancelled = False
    waiter = asyncio.ensure_future(m.place(x, cancelled=lambda: cancelled))
    await until(lambda: m.stats()["waits"] == 2 or waiter.done(), "the sender waiting")
    assert not waiter.done()
    cancelled = True
    with pytest.raises(S.WaitCancelled):
        await asyncio.wait_for(waiter, HANG_GUARD)
    m.free([held.shm.lease])
    assert await m.place(x) is not None  # nobody left in the queue blocks the next one


async def test_what_can_never_fit_falls_back_instead_of_waiting(managers, shm_dir,
                                                                monkeypatch) -> None:
    m = manager(managers, shm_dir, cap_bytes=MiB)
    assert await m.place(np.ones(2 * MiB, np.uint8)) is None  # larger than the cap
    monkeypatch.setattr(os, "posix_fallocate",
                        lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    assert await m.place(np.ones(MiB, np.uint8)) is None  # the directory is full, nothing lent
    assert m.stats()["fallbacks"] == 2


async def test_a_dead_borrower_unblocks_a_waiting_sender(managers, shm_dir) -> None:
    worker, client = manager(managers, shm_dir, cap_bytes=MiB), manager(managers, shm_dir)
    worker.verify(client.probe())
    worker.try_place(np.ones(MiB, np.uint8), borrower=client.name)
    waiter = asyncio.ensure_future(worker.place(np.ones(MiB, np.uint8)))
    await until(lambda: worker.stats()["waits"] == 1 or waiter.done(), "the sender waiting")
    assert not waiter.done()
    crash(client)  # it never releases; its death does
    assert await asyncio.wait_for(waiter, HANG_GUARD) is not None


# ---- configuration -------------------------------------------------------------------------


def test_config_from_the_environment(tmp_path) -> None:
    assert S.ShmConfig.from_env({}) is None
    cfg = S.ShmConfig.from_env({S.ENV_DIR: str(tmp_path), S.ENV_CAP: "64", S.ENV_SESSION: "s1",
                                S.ENV_MIN: "0"})
    assert cfg == S.ShmConfig(tmp_path, 64 * MiB, "s1", 0)
    assert S.ShmConfig.from_env(cfg.env()) == cfg
    with pytest.raises(S.ShmError, match=f"{S.ENV_CAP}: 'lots' is not a number of MiB"):
        S.ShmConfig.from_env({S.ENV_DIR: str(tmp_path), S.ENV_CAP: "lots"})
    with pytest.raises(S.ShmError, match=S.ENV_SESSION):
        S.ShmConfig.from_env({S.ENV_DIR: str(tmp_path), S.ENV_SESSION: "No/Slash"})
    assert S.ShmConfig.local({S.ENV_ENABLE: "0"}) is None
    assert S.ShmConfig.local({S.ENV_DIR: str(tmp_path / "missing")}) is None
    local = S.ShmConfig.local({S.ENV_DIR: str(tmp_path)})
    assert local is not None and local.dir == tmp_path and local.session != "default"
