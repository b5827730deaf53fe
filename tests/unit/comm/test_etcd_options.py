"""The options of an etcd registry URL: TLS files and a user, the password from the environment only."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from comm.registry import connect_registry
from comm.registry.etcd_options import PASSWORD_ENV, PASSWORD_FILE_ENV, EtcdOptions, etcd_options


def options(url: str, **environ: str) -> EtcdOptions:
    return etcd_options(url, urlsplit(url), environ)


def test_no_options_is_plain_grpc_without_a_login() -> None:
    assert options("etcd://etcd:2379") == EtcdOptions()
    assert not EtcdOptions().tls and EtcdOptions().describe() == "plain"


def test_tls_a_client_certificate_and_a_user_with_the_password_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    got = options("etcd://etcd:2379?ca=/c/ca.pem&cert=/c/me.pem&key=/c/me.key&user=cellmesh",
                  **{PASSWORD_FILE_ENV: str(secret)})
    assert got == EtcdOptions(ca=Path("/c/ca.pem"), cert=Path("/c/me.pem"), key=Path("/c/me.key"),
                              user="cellmesh", password="s3cret")
    assert got.describe() == "TLS, client certificate /c/me.pem, user 'cellmesh'"
    assert "s3cret" not in repr(got)
    assert options("etcd://etcd?ca=/ca.pem&user=u", **{PASSWORD_ENV: "pw"}).password == "pw"
    # without a user, a password in the environment is nobody's business
    assert options("etcd://etcd?ca=/ca.pem", **{PASSWORD_ENV: "pw"}).password is None


@pytest.mark.parametrize(("url", "environ", "says"), [
    ("etcd://u:pw@etcd:2379", {}, "no user or password before the host; give ?user=NAME"),
    ("etcd://etcd?ca=/ca.pem&user=u&password=pw", {}, "['password'] (the password never goes in the URL)"),
    ("etcd://etcd:2379?cacert=/ca.pem", {}, "unknown option(s) ['cacert'] (accepted: ca, cert, key, user)"),
    ("etcd://etcd:2379?ca=/a.pem&ca=/b.pem", {}, "give ca= once, with a value"),
    ("etcd://etcd:2379?ca=", {}, "give ca= once, with a value"),
    ("etcd://etcd:2379?ca=/ca.pem&cert=/c.pem", {}, "a client certificate needs both cert= and key="),
    ("etcd://etcd:2379?cert=/c.pem&key=/c.key", {}, "a client certificate needs TLS; add ca="),
    ("etcd://etcd?user=u", {PASSWORD_ENV: "pw"}, "a user (its password would cross the network in clear) "
                                                 "needs TLS; add ca="),
    ("etcd://etcd:2379?ca=/ca.pem&user=u", {}, f"set {PASSWORD_FILE_ENV} to a file holding it"),
    ("etcd://etcd:2379?ca=/ca.pem&user=u", {PASSWORD_ENV: "a", PASSWORD_FILE_ENV: "/f"}, "set one"),
    ("etcd://etcd?ca=/ca.pem&user=u", {PASSWORD_FILE_ENV: "/no/such/file"}, "cannot read the etcd password"),
])
def test_refusals_name_the_option_and_the_fix(url: str, environ: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError) as err:
        options(url, **environ)
    assert says in str(err.value)
    assert "pw@" not in str(err.value)  # a password never appears in a message


def test_connect_registry_checks_the_files_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"ca=/no/such/ca.pem is not a readable file"):
        connect_registry("etcd://127.0.0.1:2379?ca=/no/such/ca.pem")
    with pytest.raises(ValueError, match="no password for the etcd user"):
        connect_registry("etcd://127.0.0.1:2379?ca=/no/such/ca.pem&user=u")
