"""What ops run: ``alembic`` from the checkout, and the migrations shipped inside the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import uuid
import venv
import zipfile
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import URL

from cronoq_store._migrations import head_revision
from cronoq_store._schema import VERSION_TABLE

from .pgharness import admin_execute, asyncpg_dsn
from .support import ROOT, alembic


def test_cli_upgrade_check_downgrade(pg_url: URL, schema: str) -> None:
    up = alembic("-x", f"schema={schema}", "upgrade", "head", url=pg_url)
    assert up.returncode == 0, up.stderr
    current = alembic("-x", f"schema={schema}", "current", url=pg_url)
    assert f"{head_revision()} (head)" in current.stdout
    check = alembic("-x", f"schema={schema}", "check", url=pg_url)
    assert check.returncode == 0, check.stderr
    assert "No new upgrade operations detected" in check.stdout
    down = alembic("-x", f"schema={schema}", "downgrade", "base", url=pg_url)
    assert down.returncode == 0, down.stderr
    assert "Running downgrade 0001_base" in down.stderr


def test_cli_takes_url_from_x_argument(pg_url: URL, schema: str) -> None:
    url = pg_url.render_as_string(hide_password=False)
    up = alembic("-x", f"schema={schema}", "-x", f"url={url}", "upgrade", "head")
    assert up.returncode == 0, up.stderr
    assert f"-> {head_revision()}" in up.stderr


def test_offline_sql_is_a_reviewable_script() -> None:
    result = alembic("-x", "schema=ops_review", "upgrade", "head", "--sql")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert script.index("BEGIN;") < script.index("pg_advisory_xact_lock(1668444013")
    assert "CREATE SCHEMA IF NOT EXISTS ops_review;" in script
    # Right after it, before any DDL, the script refuses a schema another role owns.
    refusal = script.index("DO $cronoq$")
    assert script.index("CREATE SCHEMA IF NOT EXISTS ops_review;") < refusal
    assert refusal < script.index("CREATE TABLE")
    assert "set_config('cronoq_store._schema', 'ops_review', true)" in script
    # The cluster's schema is never on the search path: every object is qualified.
    assert "set_config('search_path', 'pg_catalog, pg_temp', true)" in script
    assert "search_path TO" not in script
    assert "CREATE TABLE ops_review.cronoq_tasks" in script
    assert "INSERT INTO ops_review.cronoq_leader (id, epoch) VALUES (1, 0);" in script
    assert "CREATE TABLE ops_review.cronoq_alembic_version" in script
    assert script.rstrip().endswith("COMMIT;")


async def run_script(url: URL, script: str) -> None:
    """Run a ``--sql`` script as a DBA would (one simple-protocol batch, like ``psql -f``)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(script)
    finally:
        await conn.close()


async def test_offline_script_refuses_a_schema_another_role_owns_before_any_ddl(
    pg_url: URL, schema: str
) -> None:
    """A superuser running the reviewed script on a schema a lesser role pre-created (and
    could have filled with code that runs as the superuser) stops before creating anything;
    on a schema of its own the same script migrates it to head."""
    role = f"cq_squat_{uuid.uuid4().hex[:8]}"
    squatted = f"sq_{uuid.uuid4().hex[:10]}"
    await admin_execute(pg_url, f"CREATE ROLE {role} NOLOGIN")
    await admin_execute(pg_url, f"CREATE SCHEMA {squatted} AUTHORIZATION {role}")
    try:
        refused = alembic("-x", f"schema={squatted}", "upgrade", "head", "--sql")
        assert refused.returncode == 0, refused.stderr
        with pytest.raises(asyncpg.InsufficientPrivilegeError) as caught:
            await run_script(pg_url, refused.stdout)
        assert str(caught.value) == (
            f"cronoq-store: schema {squatted} is owned by {role}, neither postgres nor a "
            "superuser: refusing to migrate it (its owner could have planted code that would "
            "run as postgres); run the script as its owner"
        )
        tables = await admin_execute(
            pg_url, "SELECT relname FROM pg_class WHERE relnamespace = $1::regnamespace", squatted
        )
        assert tables == []
    finally:
        await admin_execute(pg_url, f"DROP SCHEMA {squatted} CASCADE")
        await admin_execute(pg_url, f"DROP ROLE {role}")
    accepted = alembic("-x", f"schema={schema}", "upgrade", "head", "--sql")
    await run_script(pg_url, accepted.stdout)
    version = await admin_execute(pg_url, f"SELECT version_num FROM {schema}.{VERSION_TABLE}")
    assert [r[0] for r in version] == [head_revision()]


def test_cli_errors_are_one_clear_line_without_password(pg_url: URL) -> None:
    wrong = pg_url.set(password="not-the-password-" + (pg_url.password or "x"))
    result = alembic("-x", "schema=abc", "upgrade", "head", url=wrong)
    assert result.returncode != 0
    assert "password authentication failed" in result.stderr
    assert (wrong.password or "") not in result.stderr + result.stdout
    assert (pg_url.password or "") not in result.stderr + result.stdout

    bad = alembic("-x", 'schema=x"; drop', "upgrade", "head", url=pg_url)
    assert bad.returncode != 0
    assert "FAILED: invalid schema name" in bad.stdout
    assert "Traceback" not in bad.stderr

    missing = alembic("-x", "schema=abc", "upgrade", "head")
    assert missing.returncode != 0
    assert "FAILED: no database URL" in missing.stdout


def test_an_unreachable_server_is_one_masked_line_naming_it() -> None:
    url = URL.create("postgresql", "ops", "s3cret-pw", "127.0.0.1", 1, "app")
    result = alembic("-x", "schema=abc", "upgrade", "head", url=url)
    assert result.returncode != 0
    assert result.stdout.splitlines() == [
        "FAILED: cannot connect to postgresql://ops:***@127.0.0.1:1/app (connecting failed: "
        "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 1))"
    ]
    assert len(result.stderr.splitlines()) == 1, result.stderr  # Alembic's log of that line
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_cli_refuses_newer_database(pg_url: URL, schema: str) -> None:
    assert alembic("-x", f"schema={schema}", "upgrade", "head", url=pg_url).returncode == 0
    stamp = alembic("-x", f"schema={schema}", "stamp", "--purge", "head", url=pg_url)
    assert stamp.returncode == 0, stamp.stderr
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncio, sys, asyncpg\n"
            "async def m():\n"
            "    c = await asyncpg.connect(sys.argv[1])\n"
            f'    await c.execute(\'UPDATE "{schema}".cronoq_alembic_version '
            "SET version_num = $$0099_future$$')\n"
            "    await c.close()\n"
            "asyncio.run(m())\n",
            pg_url.render_as_string(hide_password=False),
        ],
        check=True,
        timeout=60,
    )
    result = alembic("-x", f"schema={schema}", "upgrade", "head", url=pg_url)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "FAILED: schema" in result.stdout
    assert "0099_future" in result.stdout


@pytest.mark.slow
def test_wheel_ships_the_migrations(pg_url: URL, schema: str, tmp_path: Path) -> None:
    """Build the wheel, install it in a fresh venv, and migrate from there (no checkout)."""
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)]
    built = subprocess.run(
        [*build, str(ROOT)], capture_output=True, text=True, timeout=300, check=False
    )
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next(dist.glob("cronoq_store-*.whl"))
    # The licence travels with the wheel, and its metadata names it.
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [licence] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "Apache License" in archive.read(licence).decode()
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode()
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # The dependencies come from the test environment's site-packages (not its editable
    # install of this project, which a .pth file provides and PYTHONPATH does not read).
    deps = sysconfig.get_paths()["purelib"]
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    code = (
        "import asyncio, sys, cronoq_store\n"
        "import cronoq_store._cli, cronoq_store._demo, cronoq_store.testing.pytest_plugin\n"
        "from sqlalchemy.ext.asyncio import create_async_engine\n"
        "from cronoq_store._migrations import upgrade, script_location\n"
        "print(cronoq_store.__file__)\n"
        "print(script_location())\n"
        "print(cronoq_store.testing.pytest_plugin.__file__)\n"
        "async def main():\n"
        "    engine = create_async_engine(sys.argv[1])\n"
        "    await upgrade(engine, sys.argv[2])\n"
        "    await engine.dispose()\n"
        "asyncio.run(main())\n"
    )
    result = subprocess.run(
        [
            str(python),
            "-c",
            code,
            pg_url.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False),
            schema,
        ],
        cwd=run_dir,
        env={**os.environ, "PYTHONPATH": deps},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    module_file, location, plugin_file = result.stdout.split()
    assert module_file.startswith(str(env_dir)), module_file
    # The subpackages ship too: the operator's tool, the demo, the test helpers.
    assert plugin_file == str(Path(module_file).parent / "testing" / "pytest_plugin.py")
    script = subprocess.run(
        [str(env_dir / "bin" / "cronoq-store"), "--help"],
        env={**os.environ, "PYTHONPATH": deps},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert script.returncode == 0, script.stderr
    assert "Exit codes:" in script.stdout
    assert location == str(Path(module_file).parent / "_alembic")
    assert (Path(location) / "versions" / f"{head_revision()}.py").is_file()
    check = alembic("-x", f"schema={schema}", "current", url=pg_url)
    assert f"{head_revision()} (head)" in check.stdout

    # Alembic's own command line on the installed migrations, no checkout in sight.
    ini = subprocess.run(
        [str(env_dir / "bin" / "cronoq-store"), "alembic-ini"],
        env={**os.environ, "PYTHONPATH": deps},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert ini == str(Path(location) / "alembic.ini")
    ops = {
        **os.environ,
        "PYTHONPATH": deps,
        "CRONOQ_DATABASE_URL": pg_url.render_as_string(hide_password=False),
    }
    for args in (["current"], ["downgrade", "base"], ["upgrade", "head"]):
        ran = subprocess.run(
            [str(python), "-m", "alembic", "-c", ini, "-x", f"schema={schema}", *args],
            cwd=run_dir,
            env=ops,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert ran.returncode == 0, (args, ran.stderr)
        if args == ["current"]:
            assert f"{head_revision()} (head)" in ran.stdout
        if args == ["downgrade", "base"]:
            assert "Running downgrade 0001_base" in ran.stderr
        if args == ["upgrade", "head"]:
            assert "Running upgrade  -> 0001_base" in ran.stderr


async def test_the_offline_history_revision_grants_as_the_leader_row_is_granted(
    pg_url: URL, schema: str
) -> None:
    """Revision 0008 as a reviewed script: the roles that may read the leader row may read
    the history it creates (its grant runs server side, in the printed SQL as it is)."""
    up = alembic("-x", f"schema={schema}", "upgrade", "0007_leader_holder", url=pg_url)
    assert up.returncode == 0, up.stderr
    await admin_execute(pg_url, f"GRANT SELECT ON {schema}.cronoq_leader TO PUBLIC")
    script = alembic(
        "-x", f"schema={schema}", "upgrade", "0007_leader_holder:0008_leader_history", "--sql"
    )
    assert script.returncode == 0, script.stderr
    await run_script(pg_url, script.stdout)
    public = await admin_execute(
        pg_url,
        "SELECT a.privilege_type FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a "
        "WHERE c.oid = $1::regclass AND a.grantee = 0",
        f"{schema}.cronoq_leader_history",
    )
    assert [r[0] for r in public] == ["SELECT"]
