"""`ncf tune`'s workers (ncfcli/tuning/workers.py): a pruned trial's line, a --jobs worker whose
parent is gone, the GPU each worker takes from the parent's list, and the threads of a CPU
tune's jobs."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import pytest

optuna = pytest.importorskip("optuna")


def test_a_pruned_trial_says_so_with_its_epoch() -> None:
    from ncfcli.tuning.config import TuneConfig
    from ncfcli.tuning.search import Stop
    from ncfcli.tuning.workers import Progress

    study = optuna.create_study(direction="maximize")
    dist = {"model": optuna.distributions.CategoricalDistribution(["mf"])}
    study.add_trial(optuna.trial.create_trial(
        params={"model": "mf"}, distributions=dist, state=optuna.trial.TrialState.PRUNED,
        intermediate_values={1: 0.3, 2: 0.4}))  # fmt: skip
    cfg = TuneConfig(data_dir=".", trials=1, models=("mf",))
    line = Progress(cfg, None, Stop(), True).line(study, study.trials[0], "mf", None)
    assert line == "trial 0 mf: pruned at epoch 2; no finished trial yet"


def test_a_worker_whose_parent_is_gone_stops_after_its_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --jobs worker is its own process group: a parent killed outright leaves it running."""
    from ncfcli.tuning import search, workers
    from ncfcli.tuning.config import TuneConfig

    class Study:
        stopped = 0

        def get_trials(self, **kwargs: Any) -> list:
            return []

        def stop(self) -> None:
            self.stopped += 1

    dist = {"model": optuna.distributions.CategoricalDistribution(["pop"])}
    trial = optuna.trial.create_trial(params={"model": "pop"}, distributions=dist, value=0.5)
    progress = workers.Progress(TuneConfig(data_dir=".", trials=9), None, search.Stop(), True)
    study = Study()
    monkeypatch.setattr(workers, "parent", os.getppid())
    progress(study, trial)
    assert study.stopped == 0
    monkeypatch.setattr(workers, "parent", -1)  # the parent it started under is not its parent
    progress(study, trial)
    assert study.stopped == 1


@pytest.mark.parametrize("visible", ["2,3", "GPU-aa11,GPU-bb22", None])
def test_each_worker_takes_a_gpu_of_the_parents_list(monkeypatch: pytest.MonkeyPatch,
                                                     visible: str | None) -> None:  # fmt: skip
    from ncfcli.tuning import workers
    from ncfcli.tuning.config import TuneConfig

    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(workers, "search_trials", lambda cfg, path, worker, deadline, device, *rest:
                        seen.append((os.environ["CUDA_VISIBLE_DEVICES"], device)))  # fmt: skip
    cfg = asdict(TuneConfig(data_dir=".", trials=1))
    for worker in range(4):  # each worker a process of its own, started with the parent's list
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        workers.work(cfg, ".", worker, None, gpus=2)
    expected = (visible or "0,1").split(",")
    assert seen == [(expected[w % 2], "cuda") for w in range(4)]


def test_a_cpu_tunes_jobs_share_the_cores_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a narrowed affinity mask (a container, SLURM, taskset) the jobs share the mask's
    cores, not the machine's."""
    from ncfcli import backend
    from ncfcli.tuning import workers

    monkeypatch.setattr(
        backend.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False
    )
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 64)
    assert [workers.job_threads(j) for j in (1, 2, 4, 8)] == [6, 3, 1, 1]
