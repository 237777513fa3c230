"""A run of --recipe auto's race in a process of its own: `python -m ncfcli.training.apart SPEC`.

In a run of one process on a CPU, race.py trains the first column's recipe on the sample in
this process while a child trains the second's side by side (`race._together`): each run on a
sample of ~100k training positives trains small batches that leave the second core mostly idle,
so the two at once take the slower one's seconds, not the sum. SPEC is the pickled
(run config, compared metric, local device) race.py wrote in its temporary folder; the child
writes the run's validation figure beside it (SPEC with .json), or says its error in one line
on stderr and exits with the error's code; a Ctrl-C exits 130. It trains with loop.train,
exactly as the race's runs in turn do, so the figures are the same.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.training import loop
from ncfcli.training.race import INTERRUPTED


def main(spec: Path) -> int:
    """Train the run of `spec` (module docstring); the process's exit code."""
    run, metric, device = pickle.loads(spec.read_bytes())  # our own file, in our own folder
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


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
