"""A private, throw-away PostgreSQL cluster for tests and benchmarks.

Never connects to a server someone else started: it runs `initdb` into a fresh temp dir and
starts its own postmaster on a free loopback port with its unix socket inside that dir.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from raylane.launch import free_port

if TYPE_CHECKING:
    from typing_extensions import Self

PG_BIN_CANDIDATES = (
    "/usr/lib/postgresql/15/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/14/bin",
    "/usr/local/pgsql/bin",
)
# initdb refuses to run as root, so as root every server command runs as this user.
PG_OS_USER = "postgres"


def find_pg_bin() -> Path | None:
    """The directory holding initdb and pg_ctl, or None when PostgreSQL is not installed."""
    env = os.environ.get("RAYLANE_PG_BIN")
    for candidate in ([env] if env else []) + list(PG_BIN_CANDIDATES):
        path = Path(candidate)
        if (path / "initdb").is_file() and (path / "pg_ctl").is_file():
            return path
    return None


class TempPostgres:
    """`with TempPostgres() as pg: pg.dsn` — initdb + pg_ctl start, and stop + delete on exit."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        found = bin_dir or find_pg_bin()
        if found is None:
            raise FileNotFoundError(
                "PostgreSQL server binaries (initdb, pg_ctl) not found; "
                "install postgresql or set RAYLANE_PG_BIN"
            )
        self.bin_dir = found
        self.root: Path | None = None
        self.port = 0

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """Over the unix socket: a round trip costs far less CPU than over loopback TCP."""
        assert self.root is not None, "not started"
        return f"postgresql://postgres@/{database}?host={self.root / 'sock'}&port={self.port}"

    @property
    def tcp_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> str:
        self.root = Path(tempfile.mkdtemp(prefix="raylane-pg-"))
        (self.root / "sock").mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, PG_OS_USER)
            shutil.chown(self.root / "sock", PG_OS_USER)
        self._run(
            "initdb",
            "-D",
            str(self.root / "data"),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        # NOTE: a free port can be taken between probing and binding; retry on a new one.
        for attempt in range(3):
            self.port = free_port()
            try:
                self._pg_ctl_start()
                return self.dsn
            except subprocess.CalledProcessError:
                if attempt == 2:
                    raise RuntimeError(f"postgres failed to start:\n{self.log()}") from None
        raise AssertionError("unreachable")

    def _pg_ctl_start(self) -> None:
        assert self.root is not None
        # fsync off: these clusters are disposable; a killed *client* is what tests exercise.
        options = (
            f"-p {self.port} -k {self.root / 'sock'} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.root / "data"),
            "-l",
            str(self.root / "log"),
            "-o",
            options,
            "-w",
            "-t",
            "30",
            "start",
        )

    def stop(self) -> None:
        if self.root is None:
            return
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def log(self) -> str:
        path = self.root / "log" if self.root else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        cmd = [str(self.bin_dir / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", PG_OS_USER, "--", *cmd]
        subprocess.run(
            cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.root
        )

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
