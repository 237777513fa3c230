"""The sequence term's half of a CPU step on a second thread (ncfcli/training/step.py
`term_thread`, `_overlapped`): `python -m pytest tests/test_term_overlap.py`.

The overlapped step must train what the serial one trains, bit for bit (the two halves read
disjoint parameters and only the term draws random numbers), with --amp too (autocast is per
thread), and step every parameter once; an error in either half stops the run; runs where the
halves are not independent, or no core is free, stay serial.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ncfcli.training import loop, step
from tests.test_order import train
from tests.test_train import ncf

FLAGS = ["--sequence-length", "6", "--seed", "2"]


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh 2-core process: two cores (a one-core machine runs serially), torch's thread
    count at 2 and no OMP_NUM_THREADS (an earlier test of the same worker may have left
    either: training sets one thread on a small batch, one fewer than it finds on a large
    one, and nothing where OMP_NUM_THREADS is set: device.set_threads)."""
    monkeypatch.setattr(step, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else training keeps torch's count
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _overlap_counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Count the overlapped steps, and record what `term_thread` decided on."""
    calls: dict[str, Any] = {"n": 0}
    real = step._overlapped

    def counted(*args: Any) -> Any:
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(step, "_overlapped", counted)
    real_thread = loop.term_thread

    def recorded(s: Any) -> Any:  # what decided, for the assertion's message
        pool = real_thread(s)
        calls["why"] = (s.sequences is not None, s.backend.is_cuda, s.env.enabled,
                        s.scaler.is_enabled(), s.cfg.dropout, torch.get_num_threads(), pool)  # fmt: skip
        return pool

    monkeypatch.setattr(loop, "term_thread", recorded)
    return calls


def _state(run: Path) -> dict[str, Any]:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=False)


@pytest.mark.parametrize("extra", [[], ["--amp"]], ids=["fp32", "amp"])
def test_the_overlapped_step_trains_the_serial_steps_weights(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_cores: None, extra: list[str]
) -> None:
    calls = _overlap_counted(monkeypatch)
    overlapped = train(eras, tmp_path / "overlapped", *FLAGS, *extra)
    assert calls["n"] > 0, calls  # the run took the overlapped path
    monkeypatch.setattr(loop, "term_thread", lambda s: None)
    n = calls["n"]
    serial = train(eras, tmp_path / "serial", *FLAGS, *extra)
    assert calls["n"] == n  # and this one did not
    assert overlapped["validation"] == serial["validation"]
    assert overlapped["metrics"] == serial["metrics"]
    a, b = _state(tmp_path / "overlapped"), _state(tmp_path / "serial")
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    # Adam's moments and step counts too: each group stepped once a step, on its own thread.
    for k, st in b["optimizer"]["state"].items():
        mine = a["optimizer"]["state"][k]
        assert all(torch.equal(mine[key], st[key]) for key in st), k


def test_an_error_in_the_terms_half_stops_the_run(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_cores: None
) -> None:
    """The loop's thread waits for the term's half and raises what it raised: no step goes on
    without the term's gradients."""
    calls = _overlap_counted(monkeypatch)
    from ncfcli.model.neumf import NCF

    def broken(self: Any, *args: Any) -> Any:
        raise RuntimeError("planted failure in the sequence term")

    monkeypatch.setattr(NCF, "sequence_loss", broken)
    res = ncf("train", eras, "--out", tmp_path / "run", "--device", "cpu", "--epochs", "1",
              "-q", *FLAGS)  # fmt: skip
    assert res.exit_code != 0
    assert isinstance(res.exception, RuntimeError), res.output
    assert "planted failure" in str(res.exception)
    assert calls["n"] == 1, calls
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_an_error_in_the_kinds_half_waits_for_the_terms_half(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_cores: None
) -> None:
    """An error (a second Ctrl-C, out of memory) in the loop thread's half leaves the step only
    once the term's half is done: its Adam group is not still writing the weights while the
    run stops and saves."""
    import time

    from ncfcli.model.neumf import NCF
    from ncfcli.training import optim

    seen: dict[str, Any] = {"term done": False}
    real_term, real_overlapped = NCF.sequence_loss, step._overlapped

    def slow_term(self: Any, *args: Any) -> Any:
        time.sleep(0.3)  # the kind's half fails first
        out = real_term(self, *args)
        seen["term done"] = True
        return out

    def kind_fails(*args: Any) -> Any:
        raise RuntimeError("planted failure in the kind's loss")

    def overlapped(*args: Any) -> Any:
        try:
            return real_overlapped(*args)
        except RuntimeError:
            seen["term done when it raised"] = seen["term done"]
            raise

    monkeypatch.setattr(NCF, "sequence_loss", slow_term)
    monkeypatch.setattr(optim, "pointwise_loss", kind_fails)
    monkeypatch.setattr(step, "_overlapped", overlapped)
    res = ncf("train", eras, "--out", tmp_path / "run", "--device", "cpu", "--epochs", "1",
              "-q", *FLAGS)  # fmt: skip
    assert res.exit_code != 0 and "planted failure" in str(res.exception), res.output
    assert seen.get("term done when it raised") is True, seen


@pytest.fixture
def one_thread() -> Any:
    """Training's intra-op threads on a small batch (training/device.py `set_threads`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _session(**changes: Any) -> Any:
    """What `term_thread` reads of a Session: a CPU run of one process with the term."""
    s = SimpleNamespace(
        sequences=object(),
        backend=SimpleNamespace(is_cuda=False),
        env=SimpleNamespace(enabled=False),
        scaler=SimpleNamespace(is_enabled=lambda: False),
        cfg=SimpleNamespace(dropout=0.0),
    )
    for key, value in changes.items():
        setattr(s, key, value)
    return s


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"sequences": None}, "no sequence term"),
        ({"backend": SimpleNamespace(is_cuda=True)}, "a GPU queues its kernels already"),
        ({"env": SimpleNamespace(enabled=True)}, "DDP reduces both halves in one backward"),
        ({"scaler": SimpleNamespace(is_enabled=lambda: True)}, "one fp16 scaler for both"),
        ({"cfg": SimpleNamespace(dropout=0.2)}, "the kind draws dropout masks too"),
    ],
)
def test_runs_whose_halves_are_not_independent_stay_serial(
    monkeypatch: pytest.MonkeyPatch, one_thread: None, changes: dict[str, Any], why: str
) -> None:
    monkeypatch.setattr(step, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pool = step.term_thread(_session())
    assert pool is not None
    # The thread sets its own intra-op count: a new thread's OpenMP team would be every core's
    # (its matrix products on 2 threads, spinning against the loop's: 1.6x the CPU time).
    started = (pool._initializer, pool._initargs)  # type: ignore[attr-defined]
    assert started == (torch.set_num_threads, (1,))
    pool.shutdown()
    assert step.term_thread(_session(**changes)) is None, why


def test_no_free_core_or_several_intra_op_threads_stay_serial(
    monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    monkeypatch.setattr(step, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own limit: one thread a process
    assert step.term_thread(_session()) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(step, "cpu_count", lambda: 1)
    assert step.term_thread(_session()) is None
    monkeypatch.setattr(step, "cpu_count", lambda: 16)
    torch.set_num_threads(4)  # a large batch on a many-core CPU: intra-op threads already
    assert step.term_thread(_session()) is None


def test_micro_batches_step_serially_beside_a_term_thread(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, two_cores: None
) -> None:
    """--micro-batch cuts the step into slices (gradient accumulation), which the overlapped
    step does not: such a run steps serially though a term thread is there, and trains what
    the same run without a term thread trains."""
    calls = _overlap_counted(monkeypatch)
    cut = ["--micro-batch", "1024", "--epochs", "1"]
    threaded = train(eras, tmp_path / "threaded", *FLAGS, *cut)
    assert calls["why"][-1] is not None, calls  # a term thread was there
    assert calls["n"] == 0, calls  # and no step took it
    monkeypatch.setattr(loop, "term_thread", lambda s: None)
    serial = train(eras, tmp_path / "serial", *FLAGS, *cut)
    assert threaded["validation"] == serial["validation"]
