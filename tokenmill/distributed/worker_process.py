"""WorkerProcess: one tensor-parallel rank as a child `python -m tokenmill.distributed.worker`.

A fresh interpreter that imports tokenmill alone, never the user's main module, so tensor
parallelism starts the same from a script file with or without a main guard, from a script piped
to `python -`, and from a notebook (multiprocessing's spawn re-runs the main module, which the
last three don't have or must not re-run). The config travels pickled on the child's stdin; the
child's output comes back on a pipe, is copied to this process's stderr line by line, and its
last lines are kept for the error raised when the worker dies. A pipe of its own says when the
worker has read its weights, the slow part of its start that fails most often.
"""

from __future__ import annotations

import collections
import os
import pickle
import select
import subprocess
import sys
import threading
from pathlib import Path

import tokenmill
from tokenmill.config import EngineConfig

LOG_TAIL_LINES = 20
# The folder that holds the tokenmill package: the child imports this very tokenmill, installed
# or not (a source checkout run from elsewhere).
_PACKAGE_ROOT = str(Path(tokenmill.__file__).resolve().parent.parent)


class WorkerProcess:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.name = f"tokenmill-rank-{rank}"
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _PACKAGE_ROOT + (os.pathsep + path if path else ""),
               "PYTHONUNBUFFERED": "1"}
        self._loaded, loaded_w = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.distributed.worker", "--rank", str(rank),
             "--parent-pid", str(os.getpid()), "--loaded-fd", str(loaded_w)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            pass_fds=(loaded_w,))
        os.close(loaded_w)
        assert self._process.stdin is not None
        self._process.stdin.write(pickle.dumps(config))
        self._process.stdin.close()
        self._copier = threading.Thread(target=self._copy_output, name=f"{self.name}-log",
                                        daemon=True)
        self._copier.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: killed by that signal (as multiprocessing says)."""
        return self._process.poll()

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def wait_loaded(self) -> None:
        """Block until the worker has read its weights; raises with its log if it exits first.
        Rank 0 joins the process group only after this, so a worker that fails to load can't
        leave rank 0 waiting in the rendezvous."""
        try:
            while True:
                readable, _, _ = select.select([self._loaded], [], [], 0.2)
                if readable and os.read(self._loaded, 1):
                    return
                if not self.is_alive():
                    raise self.exit_error("while starting")
        finally:
            os.close(self._loaded)

    def join(self, timeout: float | None = None) -> None:
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        self._copier.join(1.0)  # its last lines, which a caller may be about to quote

    def terminate(self) -> None:
        if self.is_alive():
            self._process.terminate()

    def log_tail(self) -> str:
        """The last lines the worker wrote, for an error message."""
        return "".join(self._tail).rstrip()

    def exit_error(self, while_doing: str) -> RuntimeError:
        """The error for a worker that exited: its code and the last lines of its log."""
        self.join(5.0)
        tail = self.log_tail()
        return RuntimeError(f"tensor parallel: {self.name} exited with code {self.exitcode} "
                            f"{while_doing}" + (f"; its last log lines:\n{tail}" if tail
                                                else " and wrote nothing"))

    def _copy_output(self) -> None:
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.decode(errors="replace")
            self._tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()
        self._process.stdout.close()

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid} exitcode={self.exitcode}>"
