"""Throwaway TLS certificates for tests, made with the ``openssl`` command (EC P-256: fast to make).

:func:`make_certs` writes a CA, a server certificate for ``127.0.0.1``/``localhost`` and one
client certificate per common name, all signed by that CA, plus a second CA that signed
nothing the server trusts (its client certificate is a stranger's).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certs", "KeyPairFiles", "make_certs", "openssl_available"]

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


@dataclass(frozen=True)
class KeyPairFiles:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Certs:
    """What :func:`make_certs` wrote."""

    ca: Path
    server: KeyPairFiles
    clients: dict[str, KeyPairFiles]  # by common name
    stranger: KeyPairFiles  # signed by another CA


def _run(*args: str) -> None:
    result = subprocess.run([OPENSSL, *args], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _ca(directory: Path, name: str) -> KeyPairFiles:
    pair = KeyPairFiles(directory / f"{name}.pem", directory / f"{name}.key")
    _run("req", "-x509", *_CURVE, "-keyout", str(pair.key), "-out", str(pair.cert), "-days", "2",
         "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return pair


def _signed(directory: Path, name: str, ca: KeyPairFiles, extensions: str) -> KeyPairFiles:
    pair = KeyPairFiles(directory / f"{name}.pem", directory / f"{name}.key")
    request = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(extensions)
    _run("req", "-new", *_CURVE, "-keyout", str(pair.key), "-out", str(request), "-subj", f"/CN={name}")
    _run("x509", "-req", "-in", str(request), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
         "-out", str(pair.cert), "-days", "2", "-extfile", str(ext))
    pair.key.chmod(0o600)
    return pair


def make_certs(directory: Path, clients: tuple[str, ...] = ("root",)) -> Certs:
    """A CA, a server certificate for loopback, and client certificates (CN = each of ``clients``)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    server = _signed(directory, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                              "extendedKeyUsage=serverAuth,clientAuth\n")
    made = {name: _signed(directory, name, ca, "extendedKeyUsage=clientAuth\n") for name in clients}
    other = _ca(directory, "other-ca")
    stranger = _signed(directory, "stranger", other, "extendedKeyUsage=clientAuth\n")
    return Certs(ca=ca.cert, server=server, clients=made, stranger=stranger)
