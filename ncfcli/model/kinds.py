"""The model kinds `ncf train --model` takes, and their checks, importable without torch.

One registry: the NCF kinds (ncfcli/model/neumf.py builds them) and the baselines
(ncfcli/model/baselines.py fits them). TrainConfig, ModelConfig, `ncf tune`'s space and the CLI
read the lists and checks here, so a new kind is added in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

from ncfcli.errors import NcfError

NCF = ("neumf", "gmf", "mlp", "mf")
BASELINES = ("pop", "itemknn", "ease", "als")
ALL = NCF + BASELINES
# The kinds with each tower: the GMF/MF embedding (--factors) and the MLP (--layers).
WITH_GMF = ("neumf", "gmf", "mf")
WITH_MLP = ("neumf", "mlp")
# The kinds whose score is a product (a GMF tower, no MLP), which shared negatives score as
# matrix products (ncfcli/model/neumf.py, NCF.shared_scores).
WITH_SHARED_NEGATIVES = ("mf", "gmf")


def is_baseline(kind: str | None) -> bool:
    return kind in BASELINES


def layers_problem(layers: Sequence[int]) -> str | None:
    """What is wrong with `--layers` (the first size is 2 x the MLP embedding), or None."""
    if len(layers) < 1 or any(n < 1 for n in layers):
        return f"--layers must be positive sizes, got {list(layers)}"
    if layers[0] % 2:
        return f"--layers: the first size must be even, got {layers[0]}"
    return None


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """'256 256 128 64' or '256,256,128,64' -> (256, 256, 128, 64)."""
    if text is None:
        return None
    words = text.replace(",", " ").split()
    try:
        return tuple(int(w) for w in words)
    except ValueError:
        raise NcfError(
            f"--layers takes whole numbers like 256 256 128 64, got {text!r}", 2
        ) from None
