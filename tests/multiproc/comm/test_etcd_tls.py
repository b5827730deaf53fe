"""The etcd registry against a real etcd that serves TLS only, demands client certificates, and has users on.

The certificates are made here with ``openssl`` (tests/harness/certs.py); etcd gets ``root``
and a ``cellmesh`` user whose role may read and write ``/cellmesh/`` only, as
docs/security.md tells an operator to set it up. A client certificate with the common name
``nobody`` (no such etcd user) gets in through TLS but is nobody to etcd: what it may do
then comes from the user it logs in as.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from comm.errors import RegistryError
from comm.registry import EventType, KeepAlive, Registry, connect_registry
from comm.registry.etcd_options import PASSWORD_ENV, PASSWORD_FILE_ENV
from tests.harness.certs import Certs, make_certs, openssl_available
from tests.harness.etcd import EtcdServer, etcd_available

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

PASSWORD = "correct horse battery staple"
SHORT = timedelta(seconds=2)  # the request timeout where etcd must refuse (a refusal is a timeout here)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if not (etcd_available() and openssl_available()):
        pytest.fail("needs the etcd server and openssl binaries (`make test` installs etcd; Debian: openssl)")
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("root", "cellmesh", "nobody"))


@pytest.fixture(scope="module")
def etcd(certs: Certs) -> Iterator[EtcdServer]:
    with EtcdServer(tls=certs) as server:
        server.enable_auth("root-" + uuid.uuid4().hex, {"cellmesh": (PASSWORD, "/cellmesh/")})
        yield server


@pytest.fixture
def password_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(PASSWORD + "\n")  # as a Secret file may end
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(path))
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    return path


def url(etcd: EtcdServer, certs: Certs, *, client: str | None = "cellmesh", user: str | None = None,
        ca: bool = True) -> str:
    options = [f"ca={certs.ca}"] if ca else []
    if client is not None:
        pair = certs.stranger if client == "stranger" else certs.clients[client]
        options += [f"cert={pair.cert}", f"key={pair.key}"]
    if user is not None:
        options.append(f"user={user}")
    return f"etcd://127.0.0.1:{etcd.client_port}" + ("?" + "&".join(options) if options else "")


def exercise(registry: Registry, prefix: str) -> None:
    """Put, get, list, compare-and-set, a lease and a watch: what a worker and a coordinator do."""
    with registry.watch(prefix) as watch:
        registry.put(prefix + "a", b"1")
        assert registry.compare_and_set(prefix + "a", b"1", b"2")
        lease = registry.lease(timedelta(seconds=2))
        keeper = KeepAlive(lease)
        registry.put(prefix + "card", b"up", lease=lease)
        events = [watch.get(timedelta(seconds=5)) for _ in range(3)]
        keeper.stop(revoke=True)
    assert [(e.type, e.key, e.value) for e in events if e is not None] == [
        (EventType.PUT, prefix + "a", b"1"), (EventType.PUT, prefix + "a", b"2"),
        (EventType.PUT, prefix + "card", b"up")]
    assert [kv.key for kv in registry.list(prefix)] == [prefix + "a"]  # the revoked lease took the card
    assert registry.revision() >= 4


def test_a_user_logs_in_over_tls_with_a_client_certificate(etcd: EtcdServer, certs: Certs,
                                                           password_file: Path) -> None:
    registry = connect_registry(url(etcd, certs, client="nobody", user="cellmesh"))  # CN=nobody: no such user
    try:
        exercise(registry, f"/cellmesh/{uuid.uuid4().hex[:8]}/")
    finally:
        registry.close()


def test_the_client_certificate_alone_is_the_user_and_its_role_bounds_it(etcd: EtcdServer, certs: Certs
                                                                         ) -> None:
    registry = connect_registry(url(etcd, certs))  # CN=cellmesh: etcd's user of that name, no login
    try:
        exercise(registry, f"/cellmesh/{uuid.uuid4().hex[:8]}/")
        with pytest.raises(RegistryError, match=r"PERMISSION_DENIED.*client certificate .*cellmesh.pem: "
                                                r"grant that etcd user a role with readwrite"):
            registry.put("/elsewhere/x", b"1")
    finally:
        registry.close()


@pytest.mark.parametrize(("case", "says"), [
    ("no client certificate", "UNAVAILABLE|did not complete"),
    ("another CA's certificate", "UNAVAILABLE|did not complete"),
    ("plain gRPC", "UNAVAILABLE|did not complete"),
    ("a wrong password", r"the login as 'cellmesh' failed: INVALID_ARGUMENT: .*authentication failed.*"
                         r"check the user and the password in CELLMESH_ETCD_PASSWORD_FILE"),
])
def test_etcd_refuses_who_it_should(etcd: EtcdServer, certs: Certs, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, case: str, says: str) -> None:
    target = {"no client certificate": url(etcd, certs, client=None),
              "another CA's certificate": url(etcd, certs, client="stranger"),
              "plain gRPC": url(etcd, certs, client=None, ca=False),
              "a wrong password": url(etcd, certs, client="nobody", user="cellmesh")}[case]
    wrong = tmp_path / "wrong"
    wrong.write_text("not the password")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(wrong))
    registry = connect_registry(target, request_timeout=SHORT)
    try:
        with pytest.raises(RegistryError, match=says):
            registry.put("/cellmesh/refused", b"1")
    finally:
        registry.close()


def test_a_forgotten_token_means_a_new_login_and_the_watch_resumes(certs: Certs, password_file: Path) -> None:
    """etcd forgets a token left idle for ``--auth-token-ttl`` and, when restarted from a snapshot, all of
    them (``--snapshot-count=1``: no login is replayed from its log)."""
    with EtcdServer(tls=certs, flags=("--auth-token-ttl=1", "--snapshot-count=1")) as etcd:  # its own
        etcd.enable_auth("root-" + uuid.uuid4().hex, {"cellmesh": (PASSWORD, "/cellmesh/")})
        # CN=nobody: the token is all that makes it the cellmesh user
        registry = connect_registry(url(etcd, certs, client="nobody", user="cellmesh"))
        try:
            prefix = f"/cellmesh/{uuid.uuid4().hex[:8]}/"
            registry.put(prefix + "first", b"0")
            time.sleep(2.5)  # the token expires
            with registry.watch(prefix) as watch:  # refused once (invalid token), then a new login
                registry.put(prefix + "before", b"1")
                first = watch.get(timedelta(seconds=5))
                assert first is not None and first.key == prefix + "before"
                etcd.restart()
                registry.put(prefix + "after", b"2")
                second = watch.get(timedelta(seconds=15))
                assert second is not None and (second.key, second.value) == (prefix + "after", b"2")
        finally:
            registry.close()
