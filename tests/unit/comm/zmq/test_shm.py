"""Shared-memory bodies (comm/zmq/shm.py): slots handed over and back, full inboxes, bad slots, cleanup."""

from __future__ import annotations

import os
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
    slots = [outbox.put(chunk) for _ in range(shm.SLOTS)]
    assert sorted(s for s in slots if s is not None) == list(range(shm.SLOTS))
    assert outbox.put(chunk) is None  # the sender then uses the socket, it never waits
    body = inbox.take(slots[2] or 0, CHUNK_BYTES)
    assert np.frombuffer(body.buffer, dtype=np.uint8).min() == 7
    inbox.release(body)
    assert outbox.put(chunk[:10]) == slots[2]


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
    inbox.close()
    assert not os.path.exists(inbox.path)
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
    shm.Inbox().close()  # the next inbox sweeps it
    assert not os.path.exists(leaked)


def test_it_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELLMESH_SHM", "0")
    assert not shm.available()
