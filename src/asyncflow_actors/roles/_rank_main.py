"""The process of a rank > 0 that ``RankGroup.open`` starts: join the group, serve commands.

``python -m asyncflow_actors.roles._rank_main HOST PORT RANK WORLD BACKEND TIMEOUT THREADS``
"""

from __future__ import annotations

import sys

from ..actors.remote._exit import exit_now


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


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
