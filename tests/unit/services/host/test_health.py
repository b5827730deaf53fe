"""The probe and metrics endpoint (services/host/health.py), over a real socket."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry, Gauge

from comm.refusals import Refusals
from comm.traffic import GLOO, ZMQ, SentBytes, snapshot
from services.host.health import HealthServer, TrafficCollector
from tests.harness.http import http_get as _get


@pytest.fixture
def state() -> dict[str, bool]:
    return {"live": True, "ready": False}


@pytest.fixture
def server(state: dict[str, bool]) -> HealthServer:
    metrics = CollectorRegistry()
    Gauge("cellmesh_test_value", "a value", registry=metrics).set(42)
    srv = HealthServer(live=lambda: (state["live"], "live detail"), ready=lambda: (state["ready"], "not yet"),
                       metrics=metrics, host="127.0.0.1").start()
    yield srv
    srv.close()


def test_probes_follow_their_checks(server: HealthServer, state: dict[str, bool]) -> None:
    assert _get(server.url + "/healthz") == (200, "live detail\n")
    assert _get(server.url + "/readyz") == (503, "not yet\n")
    state["ready"], state["live"] = True, False
    assert _get(server.url + "/readyz")[0] == 200
    assert _get(server.url + "/healthz") == (503, "live detail\n")


def test_metrics_are_prometheus_text(server: HealthServer) -> None:
    status, body = _get(server.url + "/metrics")
    assert status == 200
    assert "cellmesh_test_value 42.0" in body


def test_unknown_path_and_a_failing_check(state: dict[str, bool]) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    srv = HealthServer(live=broken, ready=lambda: (True, ""), host="127.0.0.1").start()
    try:
        assert _get(srv.url + "/nope")[0] == 404
        status, body = _get(srv.url + "/healthz")
        assert status == 503 and "RuntimeError: boom" in body
    finally:
        srv.close()


def test_garbage_gets_an_error_and_the_server_keeps_serving(server: HealthServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"\x00\xff garbage HTTP/1.1\r\n\r\n")
        reply = s.recv(4096)
    status_line = reply.split(b"\r\n")[0].split()
    assert status_line[0].startswith(b"HTTP/") and int(status_line[1]) in (400, 501), reply[:200]
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        pass  # a client that sends nothing is dropped by the read timeout, not waited for by others
    assert _get(server.url + "/healthz")[0] == 200


def test_traffic_is_on_metrics_by_backend_and_reason() -> None:
    refusals, sent = Refusals(), SentBytes()
    for _ in range(3):
        refusals.refuse("frame", "data/size", "127.0.0.1")
    refusals.refuse("frame", "rpc/forbidden", "127.0.0.1")
    refusals.count("connection", "a key that is not the job's")
    sent.add(ZMQ, 1000)
    sent.add(GLOO, 24)
    metrics = CollectorRegistry()
    metrics.register(TrafficCollector(lambda: snapshot(sent, refusals)))
    srv = HealthServer(live=lambda: (True, ""), ready=lambda: (True, ""), metrics=metrics,
                       host="127.0.0.1").start()
    try:
        status, body = _get(srv.url + "/metrics")
    finally:
        srv.close()
    assert status == 200
    assert 'cellmesh_refused_frames_total{reason="data/size"} 3.0' in body
    assert 'cellmesh_refused_frames_total{reason="rpc/forbidden"} 1.0' in body
    assert 'cellmesh_refused_connections_total{reason="a key that is not the job\'s"} 1.0' in body
    assert 'cellmesh_bytes_sent_total{backend="zmq"} 1000.0' in body
    assert 'cellmesh_bytes_sent_total{backend="gloo"} 24.0' in body
    assert 'backend="nccl"' not in body  # a backend that sent nothing is not listed
