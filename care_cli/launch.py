"""`--num-processes N`: start N copies of the same command through torchrun, quietly.

torchrun (torch's own elastic launcher) starts the processes, sets RANK / WORLD_SIZE / LOCAL_RANK, and ends
them all when one fails. This wrapper only keeps its log lines and its exception report off the terminal:
the processes print their own one-line errors, and the exit code is theirs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence


def strip_option(argv: Sequence[str], option: str) -> list[str]:
    """argv without ``option VALUE`` / ``option=VALUE`` (the launched copies must not launch again)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == option:
            skip = True
            continue
        if arg.startswith(option + "="):
            continue
        out.append(arg)
    return out


def launch(argv: Sequence[str], num_processes: int) -> int:
    """Run ``python -m care_cli ARGV`` in ``num_processes`` processes on this machine; their exit code."""
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # torchrun's own logger; read when it is imported
    # A few CPU threads per process: the per-sample CPU work (image preprocessing) gains little from more, and
    # idle OpenMP workers that spin compete with the other processes' Python threads (on 2 x H200 with 32 cores,
    # LLaVA-NeXT-7B: 16 threads per process made each process ~8% slower than alone; 4 threads, no slower).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(4, (os.cpu_count() or 1) // num_processes))))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in list(logging.root.manager.loggerDict):  # the launcher's own log lines (e.g. "failed (exitcode: 2)")
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={num_processes}", "--module", "care_cli", *argv]
    )
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        run(args)
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values() if f.exitcode]
        return 2 if 2 in codes else (codes[0] if codes else 1)
    return 0
