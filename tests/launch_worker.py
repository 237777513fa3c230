"""A stand-in for `ncf train` in the launcher tests: `python tests/launch_worker.py MODE [DIR]`.

Each MODE is one way a worker of a real run behaves or fails; DIR receives per-rank files.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

rank = int(os.environ["RANK"])
mode = sys.argv[1]
out = Path(sys.argv[2]) if len(sys.argv) > 2 else None


def ready() -> None:
    if out is not None:
        (out / f"ready{rank}").write_text("1")


if mode == "env":
    keys = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
    ]
    (out / f"env{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    sys.stderr.write(f"progress of rank {rank}\n")
    print(f"result of rank {rank}")
elif mode == "raise1":
    if rank == 1:
        time.sleep(0.3)
        raise RuntimeError("boom on rank 1")
    time.sleep(120)
elif mode == "kill1":
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
elif mode == "hang0":
    # rank 0 never returns and ignores SIGTERM: only SIGKILL after the grace period ends it
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    sys.stderr.write("some warning\nerror: dataset /nope does not exist\n")
    sys.exit(1)
elif mode == "error0":
    if rank == 0:
        sys.stderr.write("epoch 1/2 ...\nerror: --lr must be > 0, got -1\n")
        sys.exit(2)
    time.sleep(120)
elif mode == "sigint":
    try:
        ready()
        time.sleep(120)
    except KeyboardInterrupt:
        if rank == 0:
            sys.stderr.write("error: interrupted; checkpoint saved\n")
        (out / f"interrupted{rank}").write_text("1")
        sys.exit(130)
elif mode == "gloo":
    # A real process group: rank 1 dies between collectives, rank 0 is blocked in one.
    import torch

    from ncfcli import distributed

    env = distributed.env_from_environ()
    distributed.init(env, "cpu")
    t = distributed.all_reduce_sum(torch.ones(3), env)
    assert t.tolist() == [2.0, 2.0, 2.0]
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    while True:
        distributed.all_reduce_sum(torch.ones(3), env)
elif mode == "store":
    # rank 0 leaves the job at once; rank 1 then still uses the job's store, as a rank tearing
    # its group down does. The store must outlive rank 0 (the launcher holds it).
    import torch
    import torch.distributed as dist

    from ncfcli import distributed

    env = distributed.env_from_environ()
    distributed.init(env, "cpu")
    distributed.all_reduce_sum(torch.ones(3), env)
    if rank == 0:
        (out / "pid0").write_text(str(os.getpid()))
        os._exit(0)
    pid0 = out / "pid0"
    while not pid0.exists() or not pid0.read_text():
        time.sleep(0.05)
    status = Path(f"/proc/{pid0.read_text()}/status")
    while status.exists() and "State:\tZ" not in status.read_text():  # until rank 0 has exited
        time.sleep(0.05)
    store = dist.distributed_c10d._get_default_store()
    store.set("after", "rank 0 left")
    assert store.get("after") == b"rank 0 left"
    (out / "store1").write_text("ok")
    os._exit(0)
else:
    raise SystemExit(f"unknown mode {mode}")
