"""One replica group of one rank joining torchft through ``FtSession``, as a rank does.

``python tests/ft_join_probe.py RUN_DIR REPLICA FT_JSON``: prints ``started``, joins (waiting for
the run's other replica groups as a launch's first attempt does) and takes its first quorum, then
prints one JSON line: the seconds from its start to that quorum and the replica groups in it,
or the error it raised. Its own
store and gloo group; the Lighthouse is ``$TORCHFT_LIGHTHOUSE``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from loguru import logger

from wf_launch.rank.ft import FT_REPLICA_ENV, FtSession
from wf_launch.rundir import files


def main() -> None:
    run_dir, replica, ft = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    replica_dir = files.ft_replica_dir(run_dir, int(replica))
    (replica_dir / "logs").mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), FT_REPLICA_ENV: replica}
    )
    print("started", flush=True)
    t0 = time.monotonic()
    try:
        session = FtSession({"ft": ft}, replica_dir, 0, 1, None, logger)
        session.manager.start_quorum()
    except TimeoutError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
    else:
        took, together = time.monotonic() - t0, session.manager.num_participants()
        print(json.dumps({"seconds": took, "participants": together}), flush=True)
        session.shutdown()


if __name__ == "__main__":
    main()
