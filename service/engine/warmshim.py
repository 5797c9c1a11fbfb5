"""The worker command Ray runs for a pre-started rank: hand the worker to a warm host.

Ray starts a rank actor's worker as ``<py_executable> default_worker.py ARGS``; with
``py_executable`` = ``python -S -I warmshim.py SOCKET`` this script runs instead (no site,
standard library only: it starts in milliseconds). It gives the worker's command line,
environment, working folder and standard streams to the warm host listening on SOCKET
(engine.warmhost), which runs the worker in its own, already imported, interpreter; then it
waits until that process ends (the socket closes) and exits, so Ray's view of the process it
started follows the worker. Where no host answers, it becomes the plain worker Ray meant
(``exec`` of this interpreter with the same arguments): nothing is lost but the head start.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys


def main(argv: list[str]) -> None:
    path, worker = argv[1], argv[2:]
    try:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(path)
    except OSError:
        os.execv(sys.executable, [sys.executable, *worker])
    message = json.dumps({"argv": worker, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    pid = conn.recv(32)
    if not pid:  # the host ended before it took the worker: be the plain worker
        os.execv(sys.executable, [sys.executable, *worker])

    def forward(sig: int, _frame: object) -> None:  # a signal for "the worker" goes to it
        try:
            os.kill(int(pid), sig)
        except (OSError, ValueError):
            pass
        sys.exit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while conn.recv(1):  # the host writes nothing more: this returns when it ends
        pass


if __name__ == "__main__":
    main(sys.argv)
