"""The model's architecture, saved inside every checkpoint:
`python -c "from ncfcli.model.config import ModelConfig; print(ModelConfig(n_users=3, n_items=4))"`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ncfcli.model import kinds

KINDS = kinds.NCF  # the kinds a ModelConfig builds (the baselines have their own config)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture; saved inside every checkpoint so no flag is typed twice."""

    kind: str = "neumf"  # neumf | gmf | mlp | mf
    n_users: int = 0  # rows of the user tables (dense ids 0..n_users-1)
    n_items: int = 0  # rows of the item tables
    factors: int = 64  # GMF / MF embedding width
    # MLP sizes; layers[0] = 2 x MLP embedding
    layers: tuple[int, ...] = field(default=(256, 256, 128, 64))
    dropout: float = 0.5  # dropout after each MLP hidden layer
    order_factors: int = 0  # width of the order term's tables (0: no order term)
    sequence_length: int = 0  # latest items the sequence term reads (0: no sequence term)
    sequence_factors: int = 64  # the sequence term's width
    sequence_blocks: int = 2  # its self-attention blocks
    # its dropout (SASRec's for Amazon Beauty; chosen on its validation)
    sequence_dropout: float = 0.5
    # no position attends to a pad but itself (model/sequence.py); False: checkpoints from
    # before 6 December 2026, whose pads were attended
    sequence_mask_pads: bool = True
    sequence_weight: float = 1.0  # its share of the score (ncfcli/model/sequence.py: calibrate)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--model must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.n_users < 1 or self.n_items < 1:
            raise ValueError("a model needs at least one user and one item")
        if self.uses_gmf and self.factors < 1:
            raise ValueError(f"--factors must be >= 1, got {self.factors}")
        problem = kinds.layers_problem(self.layers) if self.uses_mlp else None
        if problem:
            raise ValueError(problem)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.order_factors < 0:
            raise ValueError(f"--order-factors must be >= 0, got {self.order_factors}")
        if self.sequence_length < 0:
            raise ValueError(f"--sequence-length must be >= 0, got {self.sequence_length}")
        if self.uses_sequence:
            if self.sequence_factors < 1 or self.sequence_blocks < 1:
                raise ValueError(f"--sequence-factors must be >= 1, got {self.sequence_factors}")
            if not 0.0 <= self.sequence_dropout < 1.0:
                raise ValueError(
                    f"the sequence dropout must be in [0, 1), got {self.sequence_dropout}"
                )
            if not self.sequence_weight > 0.0:
                raise ValueError(f"--sequence-weight must be > 0, got {self.sequence_weight}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        for part in ("length", "factors", "blocks", "dropout", "weight"):
            if f"seq_{part}" in d:  # older checkpoints named the sequence term `seq_*`
                d[f"sequence_{part}"] = d.pop(f"seq_{part}")
        if "layers" in d:
            d["layers"] = tuple(int(x) for x in d["layers"])
        d.setdefault("sequence_mask_pads", False)  # saved before the field: pads attended
        return cls(**d)

    @property
    def uses_gmf(self) -> bool:
        return self.kind in kinds.WITH_GMF

    @property
    def uses_mlp(self) -> bool:
        return self.kind in kinds.WITH_MLP

    @property
    def uses_order(self) -> bool:
        return self.order_factors > 0

    @property
    def uses_sequence(self) -> bool:
        return self.sequence_length > 0

    @property
    def takes_context(self) -> bool:
        """Does the model score with a third input: the previous item [B] (the order term), or
        the latest sequence_length items [B, L] (the sequence term; the order term reads its last)?"""
        return self.uses_order or self.uses_sequence

    def terms(self) -> dict[str, int]:
        """The optional terms' sizes, as a run reports them (`ncf train --json`): 0 is off."""
        return {name: int(getattr(self, name)) for name in TERMS}


# The optional terms' sizes a run reports: the order term's factors, the sequence term's window.
TERMS = ("order_factors", "sequence_length")


def no_terms() -> dict[str, int]:
    """ModelConfig.terms of a model without them (a baseline)."""
    return dict.fromkeys(TERMS, 0)


def describe_terms(terms: dict[str, int], note: str | None = None) -> list[tuple[str, str]]:
    """The run summary's rows of the optional terms (`terms`: ModelConfig.terms), with `note`,
    why the sequence window is not the one asked for, if it is not."""
    order, window = terms.get("order_factors", 0), terms.get("sequence_length", 0)
    sequence = f"latest {window} items" if window else "off"
    return [
        ("order term", f"{order} factors" if order else "off"),
        ("sequence term", sequence + (f" ({note})" if note else "")),
    ]
