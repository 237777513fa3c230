"""Runs the launcher's supervisor over tests/launch_worker.py: `python tests/launch_driver.py N
MODE DIR [ARGS...]` (ARGS go on to each worker).

Prints nothing itself; its exit code is the supervisor's return value.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ncfcli.launch.plan import LaunchPlan, free_port, supervise

nproc, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
plan = LaunchPlan(
    nproc_per_node=nproc,
    nnodes=1,
    node_rank=0,
    master_addr="127.0.0.1",
    master_port=free_port(),
    device="cpu",
    threads=1,
)
worker = str(Path(__file__).with_name("launch_worker.py"))
sys.exit(supervise([sys.executable, worker, mode, out, *sys.argv[4:]], plan))
