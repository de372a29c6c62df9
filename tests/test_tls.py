"""TLS the way operators write it: libpq's parameters in the URL, on every entry point.

A PostgreSQL server with TLS (Debian's ``postgresql-15``: the embedded build has none)
accepts only ``hostssl`` connections on TCP, password or client-certificate ones, so a
session that connects at all used TLS. A throwaway CA signs a certificate for
127.0.0.1/localhost, one for another host, and a client certificate; a second, unrelated CA
signs a rogue one. The server presents one at a time (switched by reloading its settings).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import asyncpg
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import engine_arguments
from cronoq_store._cli import cli
from cronoq_store._cli.exits import ExitCode
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Submitted, TaskId, TaskSpec, TimeBase
from cronoq_store._errors import StoreError
from cronoq_store._store import PgStore
from cronoq_store._urls import URL_ENV, UnsupportedParameterError
from cronoq_store.testing import EmbeddedPostgres
from cronoq_store.testing._unprivileged import system_user_entry

from .pgharness import without_instance
from .support import ROOT, texts_of
from .waits import until_value

#: Debian's PostgreSQL 15, built with OpenSSL (.ci/run installs it).
PG15_BIN = Path("/usr/lib/postgresql/15/bin")
CERT_USER = "cq_cert_user"
#: What refusing the other host's certificate says (OpenSSL's words, through asyncpg).
MISMATCH = "mismatch, certificate is not valid for '127.0.0.1'"


# --- certificates -------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


@dataclass
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls, common: str) -> Authority:
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common))
            .issuer_name(_name(common))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def issue(
        self, common: str, names: list[x509.GeneralName]
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return key, builder.sign(self.key, hashes.SHA256())

    def crl(self, revoked: list[x509.Certificate]) -> bytes:
        now = dt.datetime.now(dt.timezone.utc)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.cert.subject)
            .last_update(now - dt.timedelta(hours=1))
            .next_update(now + dt.timedelta(days=1))
        )
        for cert in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(cert.serial_number)
                .revocation_date(now - dt.timedelta(minutes=5))
                .build()
            )
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey, password: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


@dataclass
class Files:
    """Where every certificate, key and CRL the tests use lives."""

    dir: Path
    ca: Path
    rogue_ca: Path
    client_cert: Path
    client_key: Path
    client_key_encrypted: Path
    key_password: str
    crl_revoking_server: Path
    crl_empty: Path
    server: dict[str, tuple[Path, Path]]  # certificate and key, by name
    presented: tuple[Path, Path]  # the certificate and key the server reads

    @classmethod
    def make(cls, where: Path) -> Files:
        ca = Authority.make("cronoq test CA")
        rogue = Authority.make("someone else's CA")
        loopback = [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost"),
        ]
        issued = {
            "right": ca.issue("127.0.0.1", loopback),
            "other-host": ca.issue("db.other.example", [x509.DNSName("db.other.example")]),
            "rogue": rogue.issue("127.0.0.1", loopback),
        }
        client_key, client_cert = ca.issue(CERT_USER, [])
        password = f"k{uuid.uuid4().hex[:12]}"

        def write(name: str, data: bytes, mode: int = 0o644) -> Path:
            path = where / name
            path.write_bytes(data)
            path.chmod(mode)
            return path

        server = {
            name: (write(f"{name}.crt", _pem(cert)), write(f"{name}.key", _key_pem(key), 0o600))
            for name, (key, cert) in issued.items()
        }
        return cls(
            dir=where,
            ca=write("ca.crt", _pem(ca.cert)),
            rogue_ca=write("rogue-ca.crt", _pem(rogue.cert)),
            client_cert=write("client.crt", _pem(client_cert)),
            client_key=write("client.key", _key_pem(client_key), 0o600),
            client_key_encrypted=write(
                "client-encrypted.key", _key_pem(client_key, password.encode()), 0o600
            ),
            key_password=password,
            crl_revoking_server=write("revoked.crl", ca.crl([issued["right"][1]])),
            crl_empty=write("empty.crl", ca.crl([])),
            server=server,
            presented=(
                write("server.crt", _pem(issued["right"][1])),
                write("server.key", _key_pem(issued["right"][0]), 0o600),
            ),
        )


# --- the server ---------------------------------------------------------------------------


@dataclass
class TlsServer:
    server: EmbeddedPostgres
    files: Files

    def url(self, user: str = "postgres", **query: str) -> str:
        password = f":{self.server.password}" if user == "postgres" else ""
        base = f"postgresql://{user}{password}@127.0.0.1:{self.server.port}/postgres"
        return f"{base}?{urlencode(query)}" if query else base

    def verified(self, mode: str = "verify-full", **query: str) -> str:
        return self.url(sslmode=mode, sslrootcert=str(self.files.ca), **query)

    async def admin(self, sql: str, *args: object) -> list[asyncpg.Record]:
        """A statement on the unix socket (trust, no TLS): never a session under test."""
        conn = await asyncpg.connect(
            host=str(self.server.socket_dir), port=self.server.port, user="postgres"
        )
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    async def present(self, name: str) -> None:
        """Make the server present certificate ``name`` to every new session: its files are
        copied over the ones the server reads (settings given on its command line cannot be
        changed at runtime), and the server reloads them."""
        before = (await self.admin("SELECT pg_conf_load_time()"))[0][0]
        for source, target in zip(self.files.server[name], self.files.presented, strict=True):
            target.write_bytes(source.read_bytes())  # keeps the owner and the mode
        await self.admin("SELECT pg_reload_conf()")
        # New backends fork from the postmaster once it reloaded.
        await until_value(
            lambda: self.admin("SELECT pg_conf_load_time()"),
            lambda rows: rows[0][0] > before,
            f"the server reloading its certificate {name!r}",
        )


def _require_pg15() -> None:
    if (PG15_BIN / "postgres").exists():
        return
    why = (
        f"TLS tests need a PostgreSQL built with OpenSSL at {PG15_BIN} (Debian: apt-get "
        "install postgresql-15; .ci/run installs it); the embedded build has no TLS"
    )
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsServer]:
    _require_pg15()
    base = Path(tempfile.mkdtemp(prefix="cronoq-tls-"))
    certs = base / "certs"
    certs.mkdir()
    files = Files.make(certs)
    cert, key = files.presented
    server = EmbeddedPostgres(
        base,
        bin_dir=PG15_BIN,
        settings={
            "ssl": "on",
            "ssl_cert_file": str(cert),
            "ssl_key_file": str(key),
            "ssl_ca_file": str(files.ca),
            "max_connections": "50",
        },
    )
    if os.geteuid() == 0:
        # The server runs as the unprivileged user and must own its key files (0600).
        entry = system_user_entry()
        for path in (base, certs, *certs.iterdir()):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    try:
        server.start()
        (server.data_dir / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"hostssl all {CERT_USER} 127.0.0.1/32 cert\n"
            "hostssl all all 127.0.0.1/32 scram-sha-256\n"
        )
        made = TlsServer(server, files)

        async def prepare() -> None:
            await made.admin("SELECT pg_reload_conf()")
            await made.admin(f"CREATE ROLE {CERT_USER} LOGIN SUPERUSER")

        asyncio.run(prepare())
        yield made
    finally:
        server.destroy()
        subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture
async def tls(tls_server: TlsServer) -> AsyncIterator[TlsServer]:
    """The server presenting its right certificate, whatever a test switched it to."""
    await tls_server.present("right")
    yield tls_server
    await tls_server.present("right")


def _config() -> PgStoreConfig:
    return PgStoreConfig(
        schema=f"s_{uuid.uuid4().hex[:10]}", lock_poll=0.05, keepalive=0.5, session_timeout=2.0
    )


async def _connects(url: str) -> None:
    """Open the store on ``url`` (migrating a fresh schema) and commit through it."""
    config = _config()
    async with await PgStore.connect(url, config) as store:
        epoch = await store.acquire_leadership()
        await store.commit(epoch, TimeBase.now(), [Submitted(TaskId(1), 1, 0, TaskSpec(b"x"))], [])


async def _refused(url: str) -> str:
    with pytest.raises(StoreError) as refused:
        await _connects(url)
    return texts_of(refused.value)


# --- PgStore.connect: every mode means what libpq says ------------------------------------


async def test_every_session_of_the_store_uses_tls_when_asked(tls: TlsServer) -> None:
    config = _config()
    async with await PgStore.connect(tls.verified(), config) as store:
        epoch = await store.acquire_leadership()
        await store.commit(epoch, TimeBase.now(), [Submitted(TaskId(1), 1, 0, TaskSpec(b"x"))], [])
        rows = await tls.admin(
            "SELECT a.application_name, s.ssl FROM pg_stat_activity a "
            "JOIN pg_stat_ssl s USING (pid) WHERE a.application_name LIKE $1",
            f"{config.application_name}%",
        )
    names = {without_instance(name) for name, _ in rows}
    # The pool's sessions and the lock session, each over TLS.
    assert f"{config.application_name} leader" in names
    assert config.application_name in names
    assert all(ssl for _, ssl in rows), rows


async def test_an_application_engine_made_from_engine_arguments_and_its_lock_session(
    tls: TlsServer,
) -> None:
    """``from_engine``: the lock session is made like the application's engine, TLS too."""
    dialled, arguments = engine_arguments(tls.verified())
    engine = create_async_engine(dialled, connect_args=arguments)
    config = _config()
    try:
        async with await PgStore.from_engine(engine, config) as store:
            epoch = await store.acquire_leadership()
            await store.commit(
                epoch, TimeBase.now(), [Submitted(TaskId(1), 1, 0, TaskSpec(b"x"))], []
            )
            rows = await tls.admin(
                "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
                "WHERE starts_with(a.application_name, $1)",
                f"{config.application_name} leader ",
            )
        assert [ssl for (ssl,) in rows] == [True]
    finally:
        await engine.dispose()
    await tls.present("other-host")
    refused = create_async_engine(dialled, connect_args=arguments)
    try:
        with pytest.raises(StoreError, match=MISMATCH):
            await PgStore.from_engine(refused, _config())
    finally:
        await refused.dispose()


async def test_verify_full_refuses_a_certificate_for_another_host(tls: TlsServer) -> None:
    await tls.present("other-host")
    why = await _refused(tls.verified())
    assert MISMATCH in why, why
    # verify-ca checks the chain only: the same certificate is accepted.
    await _connects(tls.verified("verify-ca"))


async def test_a_certificate_from_another_authority_is_refused_unless_not_verified(
    tls: TlsServer,
) -> None:
    await tls.present("rogue")
    for mode in ("verify-full", "verify-ca"):
        assert "certificate verify failed" in await _refused(tls.verified(mode))
    # require with a root certificate verifies the chain, as libpq does.
    assert "certificate verify failed" in await _refused(tls.verified("require"))
    # Without one, require, prefer and allow encrypt without verifying.
    for mode in ("require", "prefer", "allow"):
        await _connects(tls.url(sslmode=mode))


async def test_disable_is_refused_by_a_server_that_takes_only_tls(tls: TlsServer) -> None:
    why = await _refused(tls.url(sslmode="disable"))
    assert "no encryption" in why, why


async def test_a_client_certificate_logs_in_without_a_password(tls: TlsServer) -> None:
    files = tls.files
    cert = {"sslcert": str(files.client_cert), "sslkey": str(files.client_key)}
    await _connects(tls.url(CERT_USER, sslmode="verify-full", sslrootcert=str(files.ca), **cert))
    # An encrypted key, with its passphrase (sslpassword).
    encrypted = {
        "sslcert": str(files.client_cert),
        "sslkey": str(files.client_key_encrypted),
        "sslpassword": files.key_password,
    }
    await _connects(
        tls.url(CERT_USER, sslmode="verify-full", sslrootcert=str(files.ca), **encrypted)
    )
    # A wrong passphrase fails, and no output shows either passphrase.
    wrong = {**encrypted, "sslpassword": f"wrong-{files.key_password}"}
    url = tls.url(CERT_USER, sslmode="verify-full", sslrootcert=str(files.ca), **wrong)
    with pytest.raises(StoreError) as failed:
        await _connects(url)
    code, out = await asyncio.to_thread(_cli, url, "status")
    assert code == ExitCode.UNREACHABLE, out
    seen = texts_of(failed.value) + out
    assert "sslpassword=***" in out
    assert files.key_password not in seen
    # Without the certificate the cert rule refuses the role.
    assert "certificate" in await _refused(
        tls.url(CERT_USER, sslmode="verify-full", sslrootcert=str(files.ca))
    )


async def test_a_crl_that_revokes_the_server_certificate_is_refused(tls: TlsServer) -> None:
    revoked = await _refused(tls.verified(sslcrl=str(tls.files.crl_revoking_server)))
    assert "certificate revoked" in revoked, revoked
    await _connects(tls.verified(sslcrl=str(tls.files.crl_empty)))


# --- the command line and Alembic ---------------------------------------------------------


def _cli(url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--url", url, *args], env={"COLUMNS": "250"})
    return result.exit_code, result.stdout + result.stderr


async def test_the_cli_speaks_tls_from_the_url(tls: TlsServer) -> None:
    schema = f"s_{uuid.uuid4().hex[:10]}"
    url = tls.verified()
    code, out = await asyncio.to_thread(_cli, url, "--schema", schema, "migrate")
    assert code == ExitCode.OK, out
    code, out = await asyncio.to_thread(_cli, url, "--schema", schema, "status")
    assert code == ExitCode.OK, out
    await tls.present("other-host")
    code, out = await asyncio.to_thread(_cli, url, "--schema", schema, "status")
    assert code == ExitCode.UNREACHABLE, out
    assert MISMATCH in out, out


def _alembic(url: str, schema: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    command = [sys.executable, "-m", "alembic", "-x", f"url={url}", "-x", f"schema={schema}"]
    return subprocess.run(
        [*command, "upgrade", "head"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_alembic_speaks_tls_from_the_url(tls: TlsServer) -> None:
    schema = f"s_{uuid.uuid4().hex[:10]}"
    done = await asyncio.to_thread(_alembic, tls.verified(), schema)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = await tls.admin(f'SELECT version_num FROM "{schema}".cronoq_alembic_version')
    assert len(rows) == 1
    await tls.present("other-host")
    refused = await asyncio.to_thread(_alembic, tls.verified(), schema)
    assert refused.returncode != 0
    assert MISMATCH in refused.stdout, refused.stdout + refused.stderr


# --- what the store cannot honour is refused by name --------------------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("sslmode=verify-full&sslcompression=1", "sslcompression"),
        ("gssencmode=require", "gssencmode"),
        ("channel_binding=require", "channel_binding"),
        ("sslcrldir=/etc/crl.d", "sslcrldir"),
        ("sslcertmode=require", "sslcertmode"),
        ("sslsni=0", "sslsni"),
        ("sslmode=verify_full", "sslmode"),
        ("ssl_min_protocol_version=SSLv3", "ssl_min_protocol_version"),
        ("sslmode=require&hostaddr=127.0.0.1", "hostaddr"),
        ("ssl=require&sslmode=verify-full", "sslmode"),
        ("sslmode=verify-full&sslrootcert=system", "sslrootcert"),
        # A file that is not there is named (asyncpg's FileNotFoundError names none).
        ("sslmode=require&sslrootcert=/nonexistent/ca.crt", "sslrootcert"),
        ("sslmode=verify-full&sslrootcert=~/ca.crt", "sslrootcert"),
        ("sslmode=verify-full&sslrootcert=no-such-ca.crt", "sslrootcert"),
        ("sslmode=require&sslcert=/nonexistent/c.crt&sslkey=/etc/hostname", "sslcert"),
        ("sslmode=require&sslcert=/etc/hostname&sslkey=/nonexistent/c.key", "sslkey"),
        ("sslmode=verify-ca&sslrootcert=/etc/hostname&sslcrl=/nonexistent/r.crl", "sslcrl"),
    ],
)
async def test_a_parameter_the_store_cannot_honour_is_refused_by_name(
    query: str, named: str
) -> None:
    url = f"postgresql://ops:Hx{uuid.uuid4().hex[:8]}@127.0.0.1:1/app?{query}"
    with pytest.raises(UnsupportedParameterError) as refused:
        await PgStore.connect(url)
    assert named in str(refused.value)
    assert named in refused.value.names
    assert "Hx" not in texts_of(refused.value)
    code, out = await asyncio.to_thread(_cli, url, "status")
    assert code == ExitCode.USAGE, out
    assert named in out
    assert "Hx" not in out


def test_alembic_refuses_a_parameter_it_cannot_honour_by_name() -> None:
    secret = f"Hx{uuid.uuid4().hex[:8]}"
    url = f"postgresql://ops:{secret}@127.0.0.1:1/app?sslmode=require&gssencmode=prefer"
    refused = _alembic(url, "public")
    assert refused.returncode != 0
    assert refused.stdout.startswith("FAILED: database URL postgresql://ops:***@"), refused.stdout
    assert "cannot honour the parameter gssencmode" in refused.stdout
    assert "Traceback" not in refused.stderr
    assert secret not in refused.stdout + refused.stderr
