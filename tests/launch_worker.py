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

    from ncfcli.launch import distributed, environment

    env = environment.env_from_environ()
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

    from ncfcli.launch import distributed, environment

    env = environment.env_from_environ()
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
elif mode == "late":
    # Issue 32's SIGABRT at exit, made certain. A collective returns while gloo's worker thread
    # still holds its tensor; the thread then releases the tensor's Python object, and must wait
    # for the GIL to do it. Is the interpreter exiting by the time it gets the GIL, Python ends
    # the thread (pthread_exit) inside that C++ destructor: std::terminate, SIGABRT. In the wild
    # the thread is late by microseconds (1 resumed run in ~15 on 2 busy cores); here rank 1's
    # collective is still in flight when its call returns, rank 0 joins it once rank 1 is past
    # its teardown, and rank 1 keeps the GIL from then into its exit (a 100 s switch interval:
    # no waiting thread asks for it), as a busy main thread does.
    import torch
    import torch.distributed as dist

    from ncfcli.launch import distributed, environment

    env = environment.env_from_environ()
    distributed.init(env, "cpu")
    if rank == 1:

        class SlowExit:
            """Holds the group, as a DDP model does past destroy_process_group, and lets go of
            the GIL once the interpreter is exiting (a collection's __del__ that sleeps)."""

            def __init__(self) -> None:
                self.group = dist.group.WORLD
                self.sleep = time.sleep  # a builtin: modules are being torn down when it runs

            def __del__(self) -> None:
                self.sleep(0.5)

        keep = SlowExit()
        issue = dist.all_reduce

        def unwaited(t: torch.Tensor, op: object = None, group: object = None,
                     async_op: bool = False) -> object:  # fmt: skip
            return issue(t, op=op, group=group, async_op=True)

        dist.all_reduce = unwaited  # the helper's call returns with the work still in flight
        distributed.all_reduce_sum(torch.ones(3), env)
        distributed.shutdown(env)
        sys.setswitchinterval(100)
        (out / "teardown1").write_text("1")
        until = time.monotonic() + 1.0
        while time.monotonic() < until:  # holds the GIL: rank 0 joins, gloo's thread waits
            pass
    else:
        # join once rank 1 is past its teardown; a rank 1 that waits in it, after 1 s
        deadline = time.monotonic() + 1.0
        while not (out / "teardown1").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        distributed.all_reduce_sum(torch.ones(3), env)
        distributed.shutdown(env)
elif mode == "train":
    # `ncf train ARGS...` (argv after DIR and BOUND) with the first column's bound lowered to
    # BOUND, so a tiny log is in the second column's range, where --recipe auto races.
    from ncfcli.cli import main
    from ncfcli.training import defaults

    first, *rest = defaults.TIERS
    defaults.TIERS = ((int(sys.argv[3]), *first[1:]), *rest)
    sys.argv = ["ncf", "train", *sys.argv[4:]]
    main()
else:
    raise SystemExit(f"unknown mode {mode}")
