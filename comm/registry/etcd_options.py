"""How cellmesh reaches a guarded etcd: TLS files and a user, from the registry URL and the environment.

An etcd URL may carry query options::

    etcd://host:2379?ca=/certs/ca.pem                                 # TLS: check etcd's certificate
    etcd://host:2379?ca=/certs/ca.pem&cert=/certs/c.pem&key=/certs/c.key   # and present a client one
    etcd://host:2379?ca=/certs/ca.pem&user=cellmesh                   # and log in as a user

* ``ca``: the CA that signed etcd's server certificate (the connection is TLS, and etcd's
  name in the URL must be one its certificate holds);
* ``cert`` and ``key``: this process's client certificate and key, for an etcd started with
  ``--client-cert-auth`` (with auth enabled, etcd takes the certificate's common name as the
  user when no user logs in);
* ``user``: an etcd user to authenticate as; the password comes from
  ``CELLMESH_ETCD_PASSWORD_FILE`` (a file holding it, e.g. a mounted Secret) or
  ``CELLMESH_ETCD_PASSWORD``, never from the URL (URLs end up in process listings and logs).

A password crosses the network at each login, so a user needs TLS (``ca``). See
docs/security.md for running etcd that way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import SplitResult, parse_qs

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PASSWORD_ENV", "PASSWORD_FILE_ENV", "QUERY_KEYS", "EtcdOptions", "etcd_options"]

PASSWORD_ENV = "CELLMESH_ETCD_PASSWORD"
PASSWORD_FILE_ENV = "CELLMESH_ETCD_PASSWORD_FILE"
QUERY_KEYS = ("ca", "cert", "key", "user")


class EtcdOptions(BaseModel):
    """TLS and authentication of an etcd connection (all None: plain gRPC, no login)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = Field(default=None, min_length=1)
    password: str | None = Field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def describe(self) -> str:
        """What the connection uses, for messages (never the password)."""
        parts = ["TLS" if self.tls else "plain"]
        if self.cert is not None:
            parts.append(f"client certificate {self.cert}")
        if self.user is not None:
            parts.append(f"user {self.user!r}")
        return ", ".join(parts)


def _password(environ: Mapping[str, str]) -> str:
    path, value = environ.get(PASSWORD_FILE_ENV, "").strip(), environ.get(PASSWORD_ENV, "")
    if path and value:
        raise ValueError(f"both {PASSWORD_FILE_ENV} and {PASSWORD_ENV} are set; set one")
    if path:
        try:
            text = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"{PASSWORD_FILE_ENV}={path}: cannot read the etcd password ({exc.strerror})"
                             ) from None
        if not text:
            raise ValueError(f"{PASSWORD_FILE_ENV}={path}: the file is empty")
        return text
    if value:
        return value
    raise ValueError(f"no password for the etcd user: set {PASSWORD_FILE_ENV} to a file holding it (a "
                     f"mounted Secret) or {PASSWORD_ENV}")


def etcd_options(url: str, parts: SplitResult, environ: Mapping[str, str] | None = None) -> EtcdOptions:
    """The options of the etcd URL ``url`` (split as ``parts``); see the module docstring.

    Raises:
        ValueError: The URL holds a password or user info, an unknown or repeated option, a
            certificate without its key, a user without TLS, or the user's password is not set
            (each message names the option and the fix).
    """
    environ = os.environ if environ is None else environ
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"registry URL {_redacted(parts)!r}: no user or password before the host; give "
                         f"?user=NAME and the password in {PASSWORD_FILE_ENV} or {PASSWORD_ENV}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(QUERY_KEYS))
    if unknown:
        what = ("the password never goes in the URL" if "password" in unknown
                else f"accepted: {', '.join(QUERY_KEYS)}")
        raise ValueError(f"registry URL {_redacted(parts)!r}: unknown option(s) {unknown} ({what})")
    values: dict[str, str] = {}
    for key, given in query.items():
        if len(given) != 1 or not given[0]:
            raise ValueError(f"registry URL {url!r}: give {key}= once, with a value")
        values[key] = given[0]
    if ("cert" in values) != ("key" in values):
        raise ValueError(f"registry URL {url!r}: a client certificate needs both cert= and key=")
    if ("cert" in values or "user" in values) and "ca" not in values:
        why = ("a user (its password would cross the network in clear)" if "user" in values
               else "a client certificate")
        raise ValueError(f"registry URL {url!r}: {why} needs TLS; add ca=/path/to/etcd-ca.pem")
    password = _password(environ) if "user" in values else None
    paths = {k: Path(v) for k, v in values.items() if k != "user"}
    return EtcdOptions(**paths, user=values.get("user"), password=password)


def _redacted(parts: SplitResult) -> str:
    """The URL without its user info."""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    query = "?..." if parts.query else ""
    return f"{parts.scheme}://{host}{port}{parts.path}{query}"
