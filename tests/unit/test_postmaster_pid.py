"""Which process runs a data directory: a postmaster.pid left by a killed server may name a pid the
system has since given to another process, which must never be taken for the server (nor stopped)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from controlplane.runtime.postgres import PostgresServer, postmaster_pid


@contextmanager
def process_in(directory: Path) -> Iterator[int]:
    """A live process whose working directory is `directory` (as a postmaster's is its data's)."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], cwd=directory) as child:
        try:
            yield child.pid
        finally:
            child.kill()


def write_pid_file(datadir: Path, pid: int) -> None:
    (datadir / "postmaster.pid").write_text(f"{pid}\n{datadir}\n1700000000\n5432\n")


def test_a_live_process_counts_only_in_its_own_directory(tmp_path: Path) -> None:
    datadir, elsewhere = tmp_path / "pgdata", tmp_path / "elsewhere"
    datadir.mkdir()
    elsewhere.mkdir()
    with process_in(datadir) as running_here, process_in(elsewhere) as reused:
        write_pid_file(datadir, running_here)
        assert postmaster_pid(datadir) == running_here
        write_pid_file(datadir, reused)  # the pid of a killed server, given to another process
        assert postmaster_pid(datadir) is None
        server = PostgresServer(datadir=datadir, port=0)
        assert not server.is_running()
        server.stop()  # nothing to stop: the other process is left alone
        os.kill(reused, 0)  # still alive
        assert postmaster_pid(elsewhere) is None  # no pid file there


def test_a_dead_pid_or_an_unreadable_file_is_no_server(tmp_path: Path) -> None:
    with process_in(tmp_path) as pid:
        pass
    write_pid_file(tmp_path, pid)
    assert postmaster_pid(tmp_path) is None
    (tmp_path / "postmaster.pid").write_text("not a pid\n")
    assert postmaster_pid(tmp_path) is None
    (tmp_path / "postmaster.pid").unlink()
    assert postmaster_pid(tmp_path) is None
