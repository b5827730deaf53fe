"""Shared memory (comm/zmq/shm.py): slots handed over and back, the header ring and its doorbell, full
inboxes, bad slots and records, cleanup."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from comm.errors import ProtocolError
from comm.sockets import CHUNK_BYTES
from comm.zmq import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="shared-memory bodies need x86-64 and /dev/shm")


@pytest.fixture
def pair() -> Iterator[tuple[shm.Inbox, shm.Outbox]]:
    inbox = shm.Inbox()
    outbox = shm.Outbox(inbox.path)
    yield inbox, outbox
    outbox.close()
    inbox.close()


def test_a_body_goes_in_and_its_slot_comes_back(pair: tuple[shm.Inbox, shm.Outbox]) -> None:
    inbox, outbox = pair
    data = np.arange(1000, dtype=np.uint8)
    slot = outbox.put(data)
    assert slot is not None
    body = inbox.take(slot, data.nbytes)
    assert bytes(body.buffer) == data.tobytes()
    assert not os.path.exists(inbox.path)  # the first body proves the peer mapped it: unlinked
    inbox.release(body)
    with pytest.raises(ProtocolError, match="not marked full"):
        inbox.take(slot, data.nbytes)  # released: no longer the receiver's to read


def test_a_full_inbox_refuses_and_a_released_slot_is_reused(pair: tuple[shm.Inbox, shm.Outbox]) -> None:
    inbox, outbox = pair
    chunk = np.full(CHUNK_BYTES, 7, dtype=np.uint8)
    slots = [outbox.put(chunk) for _ in range(shm.LARGE_SLOTS)]
    assert sorted(s for s in slots if s is not None) == list(range(shm.LARGE_SLOTS))
    assert outbox.put(chunk) is None  # the sender then uses the socket, it never waits
    body = inbox.take(slots[2] or 0, CHUNK_BYTES)
    assert np.frombuffer(body.buffer, dtype=np.uint8).min() == 7
    inbox.release(body)
    assert outbox.put(chunk) == slots[2]


def test_small_bodies_take_small_slots_and_run_out_apart(pair: tuple[shm.Inbox, shm.Outbox]) -> None:
    inbox, outbox = pair
    small = np.arange(shm.SMALL_BYTES, dtype=np.uint8)
    slots = [outbox.put(small) for _ in range(shm.SMALL_SLOTS)]
    assert sorted(s for s in slots if s is not None) == list(range(shm.LARGE_SLOTS, shm.SLOTS))
    assert outbox.put(small[:1]) is None  # small slots are full; a small body never takes a large one
    assert outbox.put(np.zeros(shm.SMALL_BYTES + 1, dtype=np.uint8)) == 0  # a larger body still finds one
    body = inbox.take(shm.SLOTS - 1, shm.SMALL_BYTES)
    assert bytes(body.buffer) == small.tobytes()
    with pytest.raises(ProtocolError, match="-byte slot"):
        inbox.take(shm.LARGE_SLOTS, shm.SMALL_BYTES + 1)  # a small slot holds no more than its size


def test_headers_go_through_the_ring_in_order_and_ring_the_doorbell_of_a_sleeping_receiver(
    pair: tuple[shm.Inbox, shm.Outbox],
) -> None:
    inbox, outbox = pair
    assert not inbox.pending()
    assert outbox.post(b"first")
    assert not select.select([inbox.bell], [], [], 0)[0]  # an awake receiver finds it at its next look
    inbox.sleeping()
    assert outbox.post(b"second")
    assert select.select([inbox.bell], [], [], 0)[0]  # a sleeping receiver wakes
    inbox.awake()
    inbox.sleeping()  # empties the doorbell before its last look
    assert not select.select([inbox.bell], [], [], 0)[0]
    inbox.awake()
    assert outbox.post(b"third")
    assert not select.select([inbox.bell], [], [], 0)[0]
    assert inbox.pending() and inbox.pop() == b"first"
    assert inbox.pop() == b"second" and inbox.pop() == b"third" and not inbox.pending()
    # the first record proves the peer mapped both: unlinked
    assert not os.path.exists(inbox.path) and not os.path.exists(inbox.path + "-bell")


def test_a_full_ring_refuses_and_a_long_header_is_refused(pair: tuple[shm.Inbox, shm.Outbox]) -> None:
    inbox, outbox = pair
    assert not outbox.post(b"x" * shm.RECORD)  # over a record: the header goes by socket instead
    for i in range(shm.RING):
        assert outbox.post(i.to_bytes(4, "little"))
    assert not outbox.post(b"one too many")  # the sender then uses the socket, it never waits
    assert inbox.pop() == (0).to_bytes(4, "little")
    assert outbox.post(b"room again")
    got = [inbox.pop() for _ in range(shm.RING)]
    assert got[-1] == b"room again" and not inbox.pending()


def test_a_record_with_a_bad_length_is_refused_and_consumed(pair: tuple[shm.Inbox, shm.Outbox]) -> None:
    inbox, outbox = pair
    assert outbox.post(b"fine")
    outbox._lengths[0] = 1 << 20  # a confused peer's record
    assert outbox.post(b"next")
    with pytest.raises(ProtocolError, match="over the"):
        inbox.pop()
    assert inbox.pop() == b"next"


@pytest.mark.parametrize(
    ("slot", "nbytes", "message"),
    [
        (shm.SLOTS, 1, "does not exist"),
        (-1, 1, "does not exist"),
        (0, CHUNK_BYTES + 1, "-byte slot"),
        (0, 1, "not marked full"),
    ],
)
def test_bad_slots_are_refused(
    pair: tuple[shm.Inbox, shm.Outbox], slot: int, nbytes: int, message: str
) -> None:
    inbox, _ = pair
    with pytest.raises(ProtocolError, match=message):
        inbox.take(slot, nbytes)


def test_close_unlinks_and_an_outbox_needs_a_real_inbox() -> None:
    inbox = shm.Inbox()
    assert os.path.exists(inbox.path) and (os.stat(inbox.path).st_mode & 0o777) == 0o600
    assert (os.stat(inbox.path + "-bell").st_mode & 0o777) == 0o600
    inbox.close()
    assert not os.path.exists(inbox.path) and not os.path.exists(inbox.path + "-bell")
    with pytest.raises(OSError):
        shm.Outbox(inbox.path)
    with pytest.raises(OSError, match="not a cellmesh shared-memory inbox"):
        shm.Outbox("/etc/passwd")


def test_inboxes_of_dead_processes_are_swept() -> None:
    code = "from comm.zmq import shm; box = shm.Inbox(); print(box.path, flush=True); import os; os._exit(0)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parents[4]),
    )
    leaked = done.stdout.strip()
    assert leaked and os.path.exists(leaked)  # a process that exited without closing (as kill -9 would)
    shm.Inbox().close()  # the next inbox sweeps it, and its doorbell
    assert not os.path.exists(leaked) and not os.path.exists(leaked + "-bell")


def test_it_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELLMESH_SHM", "0")
    assert not shm.available()
