"""The multi-process launcher of `ncf train --nproc/--gpus`: `pytest tests/test_launch.py`.

Launcher behaviour runs over a stand-in worker (tests/launch_worker.py, driven by
tests/launch_driver.py); the end of the file runs the real `ncf train --nproc 2` on gloo.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ncfcli import backend
from ncfcli.cli import app
from ncfcli.errors import NcfError
from ncfcli.launch.environment import LaunchFlags
from ncfcli.launch.plan import (
    LaunchPlan,
    check_port_free,
    free_port,
    plan_launch,
    strip_launch_args,
    supervise,
)
from tests._cli import hears_ctrl_c

HERE = Path(__file__).parent
DRIVER = HERE / "launch_driver.py"
EPOCHS = 2
TINY = [
    "--factors",
    "8",
    "--layers",
    "16",
    "8",
    "--batch-size",
    "2048",
    "--lr",
    "0.01",
    "--seed",
    "3",
    "--order-factors",  # the order term's inputs travel through the ranks too
    "8",
]


# ---- options ------------------------------------------------------------------------------


def test_strip_launch_args_removes_every_launch_option_and_device() -> None:
    argv = ["DATA", "--nproc", "2", "--epochs", "3", "--master-port=29999", "--nnodes", "1",
            "--node-rank=0", "--master-addr", "h0", "--device", "cuda", "--gpus", "4", "--amp"]  # fmt: skip
    assert strip_launch_args(argv) == (["DATA", "--epochs", "3", "--amp"], "cuda")
    assert strip_launch_args(["DATA", "--", "--nproc"]) == (["DATA", "--", "--nproc"], None)


def test_plan_for_cpu_workers() -> None:
    plan = plan_launch(["train", "DATA", "--nproc", "2", "--epochs", "1"], LaunchFlags(nproc=2))
    assert plan.worker_args == ("DATA", "--epochs", "1", "--device", "cpu")
    assert (plan.world_size, plan.nproc_per_node, plan.master_addr) == (2, 2, "127.0.0.1")
    assert plan.threads == max(1, (len(os.sched_getaffinity(0))) // 2)
    check_port_free(plan.master_port)  # an automatic port is free


def test_worker_environment() -> None:
    plan = LaunchPlan(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="h0", master_port=29511,
                      device="cuda", threads=3)  # fmt: skip
    env = plan.worker_env(2, base={"PATH": "/bin"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")} == {
        "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29511", "OMP_NUM_THREADS": "3",
    }  # fmt: skip
    assert plan.worker_env(0, base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    # the node's threads, for a worker that runs alone while the others wait (race.py); none
    # where the user chose the threads
    assert env["NCF_NODE_THREADS"] == "12"
    assert "NCF_NODE_THREADS" not in plan.worker_env(
        0, base={"OMP_NUM_THREADS": "7", "NCF_NODE_THREADS": "12"}
    )
    # every rank is a client of the store node 0's launcher holds (not rank 0's own)
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 2, "gpus": 2}, "--nproc and --gpus cannot be used together"),
        ({"nproc": 0, "gpus": None}, "--nproc must be >= 1, got 0"),
        ({"nproc": None, "gpus": 0}, "--gpus must be >= 1, got 0"),
        ({"nproc": 2, "gpus": None, "nnodes": 0}, "--nnodes must be >= 1, got 0"),
        ({"nproc": 2, "gpus": None, "nnodes": 2, "node_rank": 2, "master_addr": "h"},
         "--node-rank must be in 0..1 for --nnodes 2, got 2"),
        ({"nproc": 2, "gpus": None, "nnodes": 2, "node_rank": 1}, "--nnodes 2 needs --master-addr"),
        ({"nproc": 2, "gpus": None, "master_port": 70000}, "--master-port must be in 1..65535, got 70000"),
    ],
)  # fmt: skip
def test_bad_launch_options_are_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(NcfError, match=message) as e:
        plan_launch(["train", "DATA"], LaunchFlags(**kwargs))
    assert "\n" not in str(e.value)


def test_nproc_with_a_gpu_device_is_refused() -> None:
    with pytest.raises(NcfError, match="--nproc starts CPU workers but --device cuda was given"):
        plan_launch(["train", "DATA", "--device", "cuda"], LaunchFlags(nproc=2))


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(NcfError, match=f"--master-port {port} is in use on this machine"):
            plan_launch(["train", "DATA"], LaunchFlags(nproc=2, master_port=port))


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("", port))


def test_launch_is_needed_only_where_no_job_has_the_ranks_yet() -> None:
    def needed(nproc: int | None, gpus: int | None, environ: dict[str, str]) -> bool:
        return LaunchFlags(nproc, gpus).needed(environ)

    assert needed(2, None, environ={})
    assert needed(None, 1, environ={})  # so that --gpus 1 without a GPU is reported
    assert not needed(None, None, environ={})
    assert not needed(1, None, environ={})
    assert not needed(2, None, environ={"WORLD_SIZE": "2"})  # torchrun already did it
    assert not needed(2, None, environ={"SLURM_STEP_NUM_TASKS": "2"})  # srun did
    assert LaunchFlags(nproc=2, nnodes=2, master_addr="h").processes == 4
    with pytest.raises(NcfError, match="--nproc must be >= 1, got 0"):
        LaunchFlags(nproc=0)  # refused where it is made, before anything is launched


@pytest.mark.skipif(backend.cuda_available(), reason="needs a machine without CUDA")
def test_gpus_without_cuda_is_one_line(prepared_dir: Path) -> None:
    result = CliRunner().invoke(app, ["train", str(prepared_dir), "--gpus", "2"])
    assert result.exit_code != 0
    assert result.stderr.strip().splitlines() == [
        f"error: --gpus 2: no usable CUDA GPU ({backend.cuda_status()[1]}); use --nproc 2 to "
        "train with CPU workers instead"
    ]


def test_port_in_use_through_the_command(prepared_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(
            app, ["train", str(prepared_dir), "--nproc", "2", "--master-port", str(port)]
        )
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --master-port {port} is in use")


# ---- supervision, with a stand-in worker -------------------------------------------------


def drive(
    mode: str, tmp_path: Path, nproc: int = 2, grace: str = "1"
) -> subprocess.CompletedProcess:
    env = {**os.environ, "NCF_LAUNCH_GRACE": grace}
    env.pop("NCF_LAUNCH_VERBOSE", None)
    return subprocess.run([sys.executable, str(DRIVER), str(nproc), mode, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip


def test_workers_get_their_ranks_and_only_rank_0_is_shown(tmp_path: Path) -> None:
    res = drive("env", tmp_path, nproc=3)
    assert res.returncode == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "3"), ("1", "1", "3"), ("2", "2", "3")]  # fmt: skip
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert res.stdout == "result of rank 0\n"
    assert res.stderr == "progress of rank 0\n"


def test_a_raising_worker_stops_the_others_with_its_error(tmp_path: Path) -> None:
    res = drive("raise1", tmp_path)
    assert res.returncode == 1
    assert res.stderr == "error: rank 1 failed: RuntimeError: boom on rank 1\n"


def test_a_worker_killed_by_a_signal(tmp_path: Path) -> None:
    res = drive("kill1", tmp_path)
    assert res.returncode == 1
    assert res.stderr == "error: rank 1 failed: killed by SIGKILL\n"


def test_no_hang_when_rank_0_never_returns_and_rank_1_fails(tmp_path: Path) -> None:
    # rank 0 ignores SIGTERM: the launcher must SIGKILL it after the grace period
    res = drive("hang0", tmp_path)
    assert res.returncode == 1
    assert res.stderr == "error: rank 1 failed: dataset /nope does not exist\n"


def test_rank_0_error_is_reported_once_with_its_exit_code(tmp_path: Path) -> None:
    res = drive("error0", tmp_path)
    assert res.returncode == 2
    assert res.stderr == "epoch 1/2 ...\nerror: rank 0 failed: --lr must be > 0, got -1\n"


def test_a_rank_dying_between_collectives_is_named_not_its_peer(tmp_path: Path) -> None:
    # rank 0 then fails in all_reduce ("Connection closed by peer"): a consequence, not the cause
    res = drive("gloo", tmp_path)
    assert res.returncode == 1
    assert res.stderr == "error: rank 1 failed: ValueError: bad batch on rank 1\n"


def test_the_store_outlives_rank_0(tmp_path: Path) -> None:
    """The launcher holds the job's store until every worker has exited: a rank that still
    uses it after rank 0's process is gone (a group's teardown does) finds it."""
    res = drive("store", tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "store1").read_text() == "ok"


def test_a_collective_still_held_by_gloo_at_exit_does_not_abort(tmp_path: Path) -> None:
    """The teardown waits until gloo's threads have let go of every tensor a collective was
    given: one released while the interpreter exits kills the rank by SIGABRT (issue 32's
    `test_resume_on_another_world_size[one-then1]` flake), forced here (launch_worker `late`)."""
    res = drive("late", tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""


def test_a_master_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        plan = LaunchPlan(nproc_per_node=2, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                          master_port=s.getsockname()[1], device="cpu", threads=1)  # fmt: skip
        with pytest.raises(NcfError, match=r"^cannot listen on --master-port \d+: "):
            supervise([sys.executable, "-c", "pass"], plan)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_reaches_every_worker_once(tmp_path: Path, sig: int) -> None:
    # The launcher hears Ctrl-C as a terminal's foreground job does, even when this test
    # runner was started with SIGINT ignored (a background job of a script).
    proc = subprocess.Popen([sys.executable, str(DRIVER), "2", "sigint", str(tmp_path)],
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=hears_ctrl_c)  # fmt: skip
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err == "error: interrupted; checkpoint saved\n"  # rank 0's own message, once
    assert (tmp_path / "interrupted0").exists() and (tmp_path / "interrupted1").exists()


def test_workers_hear_the_launcher_when_sigint_was_ignored(tmp_path: Path) -> None:
    """Started with SIGINT ignored (what a script's `ncf train --nproc 2 &` inherits), the
    launcher still gets its workers to stop cleanly on SIGTERM: they must not inherit the ignore."""
    ignore = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", ignore, str(DRIVER), "2", "sigint",
                             str(tmp_path)], stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert err == "error: interrupted; checkpoint saved\n"
    assert (tmp_path / "interrupted0").exists() and (tmp_path / "interrupted1").exists()


# ---- the real command on gloo ------------------------------------------------------------


def ncf(*args: str, check_sync: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "NCF_DEVICE")}
    # one thread per process, as the launcher gives each of 2 workers on 2 cores: the runs
    # compare like for like, and a 2-thread single process does not fight the test's workers
    env["OMP_NUM_THREADS"] = "1"
    if check_sync:
        env["NCF_CHECK_SYNC"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "ncfcli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def train_json(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 2-epoch training with 1 process and with 2 gloo workers (parameters checked
    equal across ranks after every step)."""
    base = tmp_path_factory.mktemp("runs")
    out = {"one": base / "one", "two": base / "two"}
    one = train_json(ncf("train", str(prepared_dir), "--out", str(out["one"]), "--epochs", str(EPOCHS), *TINY,
                         "--device", "cpu", "--json", "-q"))  # fmt: skip
    two = train_json(ncf("train", str(prepared_dir), "--out", str(out["two"]), "--epochs", str(EPOCHS), *TINY,
                         "--nproc", "2", "--json", "-q", check_sync=True))  # fmt: skip
    # what `--json` printed, kept beside each run (RESULT) for the tests that read it
    for name, result in (("one", one), ("two", two)):
        (base / f"{name}{RESULT}").write_text(json.dumps(result))
    return out


RESULT = ".result.json"


def printed(run: Path) -> dict:
    """What `ncf train --json` printed for one of the `runs`."""
    return json.loads(run.with_name(run.name + RESULT).read_text())


@pytest.mark.slow
def test_two_workers_match_one_process(runs: dict[str, Path]) -> None:
    last_one, last_two = history(runs["one"])[-1], history(runs["two"])[-1]
    for split in ("validation", "test"):
        one, two = last_one[split], last_two[split]
        assert one["hr@10"] > 0.2 and two["hr@10"] > 0.2  # both learned (random is 10/101)
        # Every global step trains on the same samples at any world size (batches.py), so the
        # two runs differ only by the order DDP sums floats in: the 0.01, on tiny data.
        assert abs(two["hr@10"] - one["hr@10"]) <= 0.01, (split, one, two)
        assert abs(two["ndcg@10"] - one["ndcg@10"]) <= 0.01, (split, one, two)
    assert last_two["loss"] == pytest.approx(last_one["loss"], rel=1e-3)


@pytest.mark.slow
def test_two_workers_keep_the_optimizer_state_of_one_process(runs: dict[str, Path]) -> None:
    """Adam's first moment is a running mean of the gradients themselves, so it sees their
    scale, which Adam's steps do not (m / sqrt(v) cancels it): gradients averaged over the
    ranks twice (halved at 2 workers) still train, but leave exp_avg at half of one process's.
    Strong scaling, the same global batch: the states agree up to float summation order."""
    import torch

    states = {name: torch.load(runs[name] / "checkpoints" / "last.pt", weights_only=True)
              for name in ("one", "two")}  # fmt: skip
    one, two = (states[n]["optimizer"]["state"] for n in ("one", "two"))
    assert one.keys() == two.keys() and one
    for k in one:
        assert float(one[k]["step"]) == float(two[k]["step"]) > 0, k
        for moment in ("exp_avg", "exp_avg_sq"):
            a, b = one[k][moment].double(), two[k][moment].double()
            assert a.norm() > 0, (k, moment)
            assert (b - a).norm() <= 1e-3 * a.norm(), (k, moment, float(b.norm() / a.norm()))


@pytest.mark.slow
def test_samples_per_second_counts_every_rank(runs: dict[str, Path], prepared_dir: Path) -> None:
    """samples/s x seconds = the samples all ranks trained: per epoch (metrics.jsonl) and for
    the run (`--json`). With W ranks of a batch b, an epoch's N samples are trained but for
    the (tail % W) last of the tail that does not fill a global step (data/batches.py)."""
    n_train = json.loads((prepared_dir / "meta.json").read_text())["n_train"]
    for name, world in (("one", 1), ("two", 2)):
        cfg = json.loads((runs[name] / "config.json").read_text())
        assert cfg["world_size"] == world
        total = n_train * (1 + cfg["train"]["neg_per_pos"])
        b = cfg["train"]["batch_size"] // world  # strong scaling: the per-rank batch
        trained = total - (total % (b * world)) % world
        rows = history(runs[name])
        for row in rows:
            assert row["samples_per_second"] * row["train_seconds"] == pytest.approx(
                trained, rel=1e-9
            ), (name, row["epoch"])
        seconds = sum(row["train_seconds"] for row in rows)
        assert printed(runs[name])["samples_per_second"] * seconds == pytest.approx(
            EPOCHS * trained, rel=1e-9
        ), name


@pytest.mark.slow
@pytest.mark.slow
def test_two_workers_in_micro_batches_match_one_process(
    runs: dict[str, Path], prepared_dir: Path, tmp_path: Path
) -> None:
    # Each rank's 1024-sample share in slices of 400: DDP skips the all-reduce on the first two
    # slices (no_sync) and sums the accumulated gradients on the third; the ranks stay equal
    # after every step (NCF_CHECK_SYNC) and the run matches one process.
    run = tmp_path / "micro"
    train_json(ncf("train", str(prepared_dir), "--out", str(run), "--epochs", str(EPOCHS), *TINY,
                   "--nproc", "2", "--micro-batch", "400", "--json", "-q", check_sync=True))  # fmt: skip
    one, micro = history(runs["one"])[-1], history(run)[-1]
    for split in ("validation", "test"):
        assert abs(micro[split]["hr@10"] - one[split]["hr@10"]) <= 0.01, (split, one, micro)
        assert abs(micro[split]["ndcg@10"] - one[split]["ndcg@10"]) <= 0.01, (split, one, micro)
    assert micro["loss"] == pytest.approx(one["loss"], rel=1e-3)


@pytest.mark.slow
def test_evaluation_split_over_ranks_equals_one_process(runs: dict[str, Path]) -> None:
    # the 2-rank evaluation of the last epoch (sums reduced over ranks) against a 1-process
    # evaluation of the very same weights
    for name in ("test", "validation"):
        res = ncf("eval", str(runs["two"]), "--k", "10", "--split", name, "--json",
                  "--device", "cpu")  # fmt: skip
        assert res.returncode == 0, res.stderr
        single = json.loads(res.stdout)["metrics"]
        split = history(runs["two"])[-1][name]
        assert single["hr@10"] == split["hr@10"]  # a count: exact
        # ranks reduce integer counts per rank position (metrics.metric_sums): exact as well
        assert single["ndcg@10"] == split["ndcg@10"]


@pytest.mark.parametrize(
    ("first", "then"), [("two", ["--device", "cpu"]), ("one", ["--nproc", "2"])]
)
@pytest.mark.slow
def test_resume_on_another_world_size(runs: dict[str, Path], tmp_path: Path, first: str,
                                      then: list[str], prepared_dir: Path) -> None:  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(runs[first], run)
    before = history(run)
    out = train_json(ncf("train", str(prepared_dir), "--out", str(run), "--resume", "--epochs", str(EPOCHS + 1),
                         *then, "--json", "-q"))  # fmt: skip
    after = history(run)
    assert out["epochs"] == EPOCHS + 1 and len(after) == EPOCHS + 1
    assert after[:EPOCHS] == before  # the finished epochs are kept, not retrained
    assert after[-1]["loss"] < before[-1]["loss"]  # it went on from the saved state
    assert after[-1]["validation"]["hr@10"] >= before[-1]["validation"]["hr@10"] - 0.03


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker through /proc")
@pytest.mark.slow
def test_killed_worker_ends_the_real_run_with_its_error(prepared_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["NCF_LAUNCH_GRACE"] = "2"
    proc = subprocess.Popen([sys.executable, "-m", "ncfcli", "train", str(prepared_dir), "--out",
                             str(tmp_path / "run"), "--epochs", "200", *TINY, "--nproc", "2", "-q"],
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        rank1 = None
        deadline = time.monotonic() + 60
        # rank 0 writes config.json once every rank has joined and loaded the data
        while not (tmp_path / "run" / "config.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        rank1 = _child_with_rank(proc.pid, "1")
        os.kill(rank1, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1] == "error: rank 1 failed: killed by SIGKILL"


def _child_with_rank(parent: int, rank: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under {parent}")
