"""The wake pipe ([Note: a wake pipe] in comm/wake.py): a poll woken from another thread, a wake that never
blocks, nothing after close, and no descriptor left behind by a pipe nobody closed."""

from __future__ import annotations

import gc
import os
import select
import threading
import time

import pytest
import zmq

from comm.wake import WakePipe


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_wake_makes_it_readable_until_drained() -> None:
    pipe = WakePipe()
    try:
        assert not readable(pipe.fd)
        pipe.wake()
        pipe.wake()
        assert readable(pipe.fd)
        pipe.drain()
        assert not readable(pipe.fd)
        pipe.drain()  # an empty pipe: returns at once
    finally:
        pipe.close()


def test_wakes_never_block_even_when_nobody_drains() -> None:
    pipe = WakePipe()
    try:
        started = time.monotonic()
        for _ in range(200_000):  # a pipe's buffer holds 64 KiB: most of these find it full
            pipe.wake()
        assert time.monotonic() - started < 30
        pipe.drain()
        assert not readable(pipe.fd)
    finally:
        pipe.close()


def test_a_poll_asleep_on_it_is_woken_from_another_thread() -> None:
    pipe = WakePipe()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        sock.bind("inproc://wake-test")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(pipe.fd, zmq.POLLIN)
        timer = threading.Timer(0.2, pipe.wake)
        started = time.monotonic()  # before the timer starts: the wake comes 0.2 s after this at the earliest
        timer.start()
        events = dict(poller.poll(20_000))
        waited = time.monotonic() - started
        timer.join()
        assert pipe.fd in events and sock not in events
        assert 0.2 <= waited < 10, waited  # woken, not timed out (20 s)
    finally:
        sock.close(0)
        ctx.term()
        pipe.close()


def test_after_close_a_wake_or_drain_does_nothing_and_close_is_idempotent() -> None:
    pipe = WakePipe()
    fd = pipe.fd
    pipe.close()
    assert pipe.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    other_read, other_write = os.pipe()  # may take the closed numbers: a late wake must not write there
    try:
        pipe.wake()
        pipe.drain()
        pipe.close()
        assert not readable(other_read)
    finally:
        os.close(other_read)
        os.close(other_write)


def test_a_pipe_nobody_closed_closes_when_collected() -> None:
    pipe = WakePipe()
    read, write = pipe.fd, pipe._write
    os.fstat(read)
    del pipe
    gc.collect()
    for fd in (read, write):
        with pytest.raises(OSError):
            os.fstat(fd)
