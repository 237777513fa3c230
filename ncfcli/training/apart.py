"""A run of --recipe auto's race in a process of its own: `python -m ncfcli.training.apart SPEC`.

In a run of one process on a CPU, race.py trains the first column's recipe on the sample in
this process while a child trains the second's side by side (`race._together`): each run on a
sample of ~100k training positives trains small batches that leave the second core mostly idle,
so the two at once take the slower one's seconds, not the sum. SPEC is the pickled (run
config, compared metric, local device, parent's pid) race.py wrote in its temporary folder; the
child writes the run's validation figure beside it (SPEC with .json), or says its error in one line
on stderr and exits with the error's code; a Ctrl-C exits 130. It trains with loop.train,
exactly as the race's runs in turn do, so the figures are the same. It outlives no race: on
SIGTERM (the race stopping it, or on Linux its parent's death, whatever killed the parent) it
exits at once, and where the parent is gone it removes the race's temporary folder first.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import time
from pathlib import Path

from ncfcli.errors import INTERRUPTED, NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.launch.workers import parent_death_signal
from ncfcli.training import loop


def main(spec: Path) -> int:
    """Train the run of `spec` (module docstring); the process's exit code."""
    run, metric, device, parent = pickle.loads(spec.read_bytes())  # our own, in our folder
    _ends_with(parent, spec.parent)
    try:
        result = loop.train(run, None, DistEnv(0, 1, device), score_test=False)
    except NcfError as e:
        sys.stderr.write(f"error: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        return INTERRUPTED
    assert result.validation is not None
    spec.with_suffix(".json").write_text(json.dumps(float(result.validation[metric])))
    return 0


def _ends_with(parent: int, folder: Path) -> None:
    """SIGTERM ends this process at once (nothing of the run is kept: `folder` is the race's);
    on Linux the parent's death sends it (prctl PR_SET_PDEATHSIG), so a parent killed outright
    (SIGKILL, the OOM killer) leaves no run training for nobody. Where the parent is gone, the
    race's `folder` goes too: nobody else will remove it."""

    def stop(signum: int, frame: object) -> None:
        if _orphaned(parent):
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGTERM, stop)
    parent_death_signal(signal.SIGTERM)  # no prctl: the race's own SIGTERM still ends it
    if os.getppid() != parent:  # gone before the line above
        stop(signal.SIGTERM, None)


def _orphaned(parent: int, wait: float = 2.0) -> bool:
    """Whether `parent` is gone (this process handed to another), waiting up to `wait` s: the
    death signal comes as the parent's first thread exits, while its others may still hold
    this process (getppid unchanged a moment longer); a parent that stops this run on purpose
    stays."""
    deadline = time.monotonic() + wait
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
