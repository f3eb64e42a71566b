"""A private PostgreSQL for the whole session, and a fresh bank per test."""

from __future__ import annotations

import os
import pwd
import uuid

import asyncpg
import pytest
from prometheus_client import CollectorRegistry
from raylane.actors.consolidation import ConsolidationMetrics, MemoryStore

from tests.support.pgtemp import PG_OS_USER, TempPostgres, find_pg_bin


def _why_no_postgres() -> str | None:
    if find_pg_bin() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not found; set RAYLANE_PG_BIN"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_OS_USER)
        except KeyError:
            return f"running as root and there is no {PG_OS_USER!r} user to run initdb as"
    return None


@pytest.fixture(scope="session")
def pg_server():
    reason = _why_no_postgres()
    if reason:
        pytest.skip(reason)
    with TempPostgres() as pg:
        yield pg


@pytest.fixture(scope="session")
def pg_dsn(pg_server: TempPostgres) -> str:
    return pg_server.dsn


@pytest.fixture
async def fresh_dsn(pg_server: TempPostgres) -> str:
    """A DSN to a new, empty database (for schema tests)."""
    name = f"raylane_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(pg_server.dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return pg_server.dsn_for(name)


@pytest.fixture
async def store(pg_dsn: str):
    store = await MemoryStore.connect(pg_dsn)
    yield store
    await store.close()


@pytest.fixture
def bank() -> str:
    """Tests share the database; a fresh bank id per test keeps them apart."""
    return f"bank-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def metrics() -> ConsolidationMetrics:
    return ConsolidationMetrics(CollectorRegistry())
