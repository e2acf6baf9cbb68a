"""The process of a rank > 0 that ``RankGroup.open`` starts: join the group, serve commands.

``python -m asyncflow_actors.roles._rank_main HOST PORT RANK WORLD BACKEND TIMEOUT THREADS``
"""

from __future__ import annotations

import atexit
import os
import sys


def main(argv: list[str]) -> int:
    host, port, rank, world, backend, timeout, threads = argv
    from ._gc import gc_paused

    with gc_paused(freeze=True):  # as a node's preload: no full collections during the imports
        import torch
        import torch.distributed as dist

        from ._rank_host import serve
        from ._ranks import Rendezvous

    torch.set_num_threads(int(threads))
    Rendezvous(host, int(port), int(world), backend, float(timeout)).join(int(rank))
    try:
        serve()
    finally:
        dist.destroy_process_group()
    return 0


def _exit_now(code: int) -> None:
    """End the process once its rank left the group, skipping the interpreter's teardown of
    every module and object, as a node does (``asyncflow_actors.node``): with torch loaded it
    takes about half a second of CPU, which rank 0 waits out at every close of a group. Exit
    handlers still run first; the streams are flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader is gone: nothing more can reach it
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main(sys.argv[1:]))
