"""A real etcd server for tests: free loopback ports, a temporary data dir, kill and restart.

Usage::

    with EtcdServer() as etcd:          # starts /usr/bin/etcd and waits until it answers
        registry = EtcdRegistry("127.0.0.1", etcd.client_port)
        etcd.kill()                     # SIGKILL, as a crash
        etcd.restart()                  # same data dir, same ports; waits until it answers

The server's output goes to ``etcd.log`` in the data dir's parent; a start that fails
raises with its tail. ``stop()`` (also on exit) terminates the process and deletes
the directory.

With ``tls`` (certificates of ``tests/harness/certs.py``) the server speaks TLS only and
requires a client certificate its CA signed (``--client-cert-auth``); :meth:`EtcdServer.enable_auth`
then turns on etcd's users, as an operator would (``etcdctl user add``, ``role grant-permission``,
``auth enable``), through the gRPC API with the ``root`` client certificate.
"""

from __future__ import annotations

import json
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from comm.registry.etcd_grpc import etcd3, etcdrpc, prefix_end
from comm.sockets import free_port
from tests.harness.certs import Certs

__all__ = ["ETCD_BINARY", "EtcdServer", "etcd_available"]

ETCD_BINARY = shutil.which("etcd") or "/usr/bin/etcd"
DEFAULT_START_TIMEOUT = timedelta(seconds=20)


def etcd_available() -> bool:
    """True if the etcd server binary is installed."""
    return shutil.which("etcd") is not None


class EtcdServer:
    """One single-member etcd cluster on loopback.

    Args:
        start_timeout: how long :meth:`start` / :meth:`restart` wait for etcd to answer.
        tls: serve TLS only, to clients with a certificate these certs' CA signed.
        flags: more of etcd's flags (``--auth-token-ttl=1``).
    """

    def __init__(self, *, start_timeout: timedelta = DEFAULT_START_TIMEOUT, tls: Certs | None = None,
                 flags: tuple[str, ...] = ()) -> None:
        self.start_timeout = start_timeout
        self.tls = tls
        self.flags = flags
        self._root = Path(tempfile.mkdtemp(prefix="cellmesh-etcd-"))
        self.data_dir = self._root / "data"
        self.log_path = self._root / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The registry URL for :func:`comm.registry.connect_registry`."""
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> EtcdServer:
        """Start etcd and wait until it answers ``/health`` (bounded by ``start_timeout``).

        Raises:
            RuntimeError: if etcd is already running, exits, or does not answer in time
                (with the tail of its log).
        """
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"etcd (pid {self._proc.pid}) is already running")
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        args = [
            ETCD_BINARY,
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=warn",
            *self.flags,
        ]
        if self.tls is not None:
            args += [f"--cert-file={self.tls.server.cert}", f"--key-file={self.tls.server.key}",
                     f"--trusted-ca-file={self.tls.ca}", "--client-cert-auth"]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout.total_seconds()
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"etcd exited with code {code} while starting:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.client_url}/health", timeout=1,
                                            context=self._ssl_context()) as response:
                    body = json.loads(response.read() or b"{}")
                if body.get("health") == "true":
                    return
                last = f"/health said {body}"
            except (OSError, urllib.error.URLError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
        raise RuntimeError(
            f"etcd on {self.client_url} did not become healthy within "
            f"{self.start_timeout.total_seconds():.0f}s ({last}):\n{self._log_tail()}"
        )

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        root = self.tls.clients["root"]
        context.load_cert_chain(str(root.cert), str(root.key))
        return context

    def enable_auth(self, root_password: str, users: dict[str, tuple[str, str]]) -> None:
        """Turn on etcd's users: ``root``, and each of ``users`` (name -> (password, key prefix)) with
        a role of its own that may read and write that prefix only. Needs ``tls`` (a ``root`` client)."""
        assert self.tls is not None, "enable_auth needs a TLS server (the root client certificate)"
        root = self.tls.clients["root"]
        client = etcd3.client(host="127.0.0.1", port=self.client_port, ca_cert=str(self.tls.ca),
                              cert_key=str(root.key), cert_cert=str(root.cert), timeout=10)
        try:
            stub = etcdrpc.AuthStub(client.channel)
            stub.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password), timeout=10)
            stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=10)
            stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
            for name, (password, prefix) in users.items():
                stub.UserAdd(etcdrpc.AuthUserAddRequest(name=name, password=password), timeout=10)
                stub.RoleAdd(etcdrpc.AuthRoleAddRequest(name=name), timeout=10)
                key = prefix.encode()
                permission = etcdrpc.auth_pb2.Permission(permType=etcdrpc.auth_pb2.Permission.READWRITE,
                                                         key=key, range_end=prefix_end(key))
                stub.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name=name, perm=permission),
                                         timeout=10)
                stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=name, role=name), timeout=10)
            stub.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=10)
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL etcd (a crash) and reap it; a no-op if it is not running."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self) -> EtcdServer:
        """Kill etcd if it runs, then start it again on the same data dir and ports."""
        self.kill()
        return self.start()

    def stop(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Terminate etcd (SIGTERM, then SIGKILL after ``timeout``) and delete its directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout.total_seconds())
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._proc = None
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        # A last resort: never leave an etcd behind if a test forgot stop().
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
