"""Evaluation that can be trusted under bad scores, several ranks and ties:
`python -m pytest tests/test_eval_trust.py`.

- NaN scores never help the positive: a NaN positive is a miss at every K, a NaN negative beats
  the positive, in the sampled protocol and in full ranking (capped by blocks or not);
- full-ranking sums of users split over ranks are reduced over the ranks: two ranks (a fake
  two-rank group of threads) give one process's HR and NDCG, in training's and `ncf eval`'s
  evaluation;
- a tie between epochs goes to the earlier one, in training and in `ncf inspect`'s re-pick.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_prepared
from ncfcli.launch import distributed
from ncfcli.launch.distributed import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring import metrics
from ncfcli.scoring.metrics import (
    budget_rows,
    full_ranks,
    full_split,
    metric_sums,
    sampled_ranks,
    sums_to_metrics,
)
from ncfcli.scoring.scorer import context_window, takes_context
from ncfcli.serve.config import EvalConfig
from ncfcli.serve.evaluation import evaluate
from ncfcli.training.config import TrainConfig
from tests._runs import make_run

CPU = get_backend("cpu")
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

NAN = float("nan")


class Table(torch.nn.Module):
    """A fake model scoring (u, i) as table[u, i], through score_all like NCF (every item,
    items [B], or each user's own items [U, C]); `subset_scoring` picks full ranking's capped
    block-by-block path (as NCF and ALS) or the whole masked matrix (as EASE)."""

    def __init__(self, table: list[list[float]], subset_scoring: bool) -> None:
        super().__init__()
        self.table = torch.tensor(table, dtype=torch.float32)
        self.subset_scoring = subset_scoring

    def score_all(self, users: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.table[users.long()]
        if items is None:
            return rows.clone()
        if items.dim() == 1:
            return rows[:, items.long()]
        return rows.gather(1, items.long())


# 3 users, 6 items. User 0's positive (item 1) scores NaN; user 1's positive (item 0) is its
# best finite score but item 4 scores NaN; user 2's positive (item 2) is its best, no NaN.
TABLE = [
    [0.1, NAN, 0.3, 0.2, 0.0, 0.4],
    [0.9, 0.1, 0.2, 0.3, NAN, 0.5],
    [0.1, 0.2, 0.8, 0.3, 0.4, 0.0],
]
POSITIVES = torch.tensor([1, 0, 2], dtype=torch.int32)
NO_TRAINING = torch.zeros(4, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)


def _hits(ranks: torch.Tensor, k: int) -> list[bool]:
    return [int(r) < k for r in ranks.tolist()]


@pytest.mark.parametrize("subset_scoring", [True, False])
def test_a_nan_positive_is_a_miss_at_every_k_in_full_ranking(subset_scoring: bool) -> None:
    """Every K from 1 to the catalogue, capped (as `ncf eval` and training rank) and not."""
    model = Table(TABLE, subset_scoring)
    offsets, seen = NO_TRAINING
    n_items = len(TABLE[0])
    whole = full_ranks(model, 0, 3, n_items, offsets, seen, POSITIVES)
    assert whole.tolist()[1:] == [1, 0]  # user 1: the NaN item beats its positive
    assert whole[0] >= n_items  # past every cut-off
    for k in range(1, n_items + 1):
        capped = full_ranks(model, 0, 3, n_items, offsets, seen, POSITIVES, cap=k)
        assert _hits(capped, k) == [False, k > 1, True], k
        m = sums_to_metrics(metric_sums(capped, [k]), [k])
        assert m[f"hr@{k}"] == pytest.approx((1 + (k > 1)) / 3)
        assert m[f"ndcg@{k}"] == pytest.approx((1 + (1 / math.log2(3) if k > 1 else 0)) / 3)


def test_a_nan_positive_is_a_miss_at_every_k_in_the_sampled_protocol() -> None:
    model = Table(TABLE, True)
    users = torch.arange(3)
    negatives = torch.tensor([[0, 2, 3, 4, 5], [1, 2, 3, 4, 5], [0, 1, 3, 4, 5]])
    ranks = sampled_ranks(model, users, POSITIVES.long(), negatives, max_rows=6)
    assert ranks.tolist()[1:] == [1, 0]
    for k in range(1, 7):  # K = 6: every candidate of the row
        assert _hits(ranks, k) == [False, k > 1, True], k
    # A NaN among the negatives beats the positive whatever the positive scores.
    big = Table([[1e30, NAN, 0.0]], True)
    one = torch.tensor([0])
    assert sampled_ranks(big, one, one, torch.tensor([[1, 2]])).tolist() == [1]


# ---- full-ranking sums over ranks ------------------------------------------------------------


class TwoRanks:
    """A fake two-rank group: each rank runs in its own thread, and `all_reduce_sum` (patched
    over ncfcli.launch.distributed's, which evaluation calls) returns the sum of both ranks' tensors
    for each collective, in call order, as torch.distributed's all-reduce does."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.slots: dict[int, dict[int, torch.Tensor]] = {}
        self.calls = [0, 0]

    def all_reduce_sum(self, t: torch.Tensor, env: DistEnv) -> torch.Tensor:
        if not env.enabled:
            return t
        n = self.calls[env.rank]
        self.calls[env.rank] += 1
        self.slots.setdefault(n, {})[env.rank] = t.clone()
        self.barrier.wait()  # both ranks' tensors are in
        total = self.slots[n][0] + self.slots[n][1]
        self.barrier.wait()  # both have read them
        return total

    def run(self, fn: Callable[[DistEnv], Any]) -> list[Any]:
        """fn(env) on ranks 0 and 1 at once -> their results."""
        results: list[Any] = [None, None]
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                results[r] = fn(DistEnv(rank=r, world_size=2))
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> TwoRanks:
    group = TwoRanks()
    monkeypatch.setattr(distributed, "all_reduce_sum", group.all_reduce_sum)
    return group


def test_training_full_ranking_sums_over_ranks_equal_one_process(
    prepared_dir: Path, two_ranks: TwoRanks, tmp_path: Path
) -> None:
    """--select-metric full-hr@10 on 2 ranks: each ranks its half of the users; the reduced
    sums are one process's, bit for bit (as the sampled ones)."""
    from ncfcli.training.validation import eval_sets, evaluate_split

    data = load_prepared(prepared_dir, CPU)
    model = load_run(make_run(prepared_dir, tmp_path / "run")).model
    cfg = TrainConfig(data_dir=str(prepared_dir))
    full = full_split(data, "validation", CPU, None)

    def score(env: DistEnv) -> dict[str, float]:
        held = eval_sets(cfg, data, env, CPU)["validation"]
        return evaluate_split(model, held, env, 1000, full)

    one = score(DistEnv())
    assert one["full-hr@10"] > 0 and set(one) == {"hr@10", "ndcg@10", "full-hr@10",
                                                  "full-ndcg@10"}  # fmt: skip
    assert two_ranks.run(score) == [one, one]


@pytest.mark.parametrize("full_ranking", [True, False])
def test_ncf_eval_sums_over_ranks_equal_one_process(
    prepared_dir: Path, two_ranks: TwoRanks, full_ranking: bool, tmp_path: Path
) -> None:
    """`ncf eval` under torchrun: users split over 2 ranks, each result is one process's."""
    data = load_prepared(prepared_dir, CPU)
    run = load_run(make_run(prepared_dir, tmp_path / "run"))
    cfg = EvalConfig(ks=(1, 5, 10), full_ranking=full_ranking, batch_rows=700)

    def score(env: DistEnv) -> dict:
        return evaluate(run, data, cfg, CPU, env)

    one = score(DistEnv())
    assert one["users"] == 300 and one["metrics"]["hr@10"] > 0
    assert two_ranks.run(score) == [one, one]


# ---- the epoch chosen on a tie ---------------------------------------------------------------

# Validation figures of four epochs: 2 and 3 tie on both figures; 4 ties on HR@10 alone and
# loses on NDCG@10, the partner that breaks a tie.
TIED = [(0.5, 0.30), (0.6, 0.40), (0.6, 0.40), (0.6, 0.20)]


def test_a_tie_between_epochs_goes_to_the_earlier_one(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real `ncf train` with the validation figures fixed: best.pt, the run's report and
    `ncf inspect`'s re-pick from metrics.jsonl all name epoch 2, not 3."""
    from ncfcli.training import validation as evaluation

    figures = iter(TIED)

    def scored(model: Any, sets: Any, split: str, *args: Any) -> dict[str, float]:
        if split == "test":
            return {"hr@10": 0.1, "ndcg@10": 0.05}
        hr, ndcg = next(figures)
        return {"hr@10": hr, "ndcg@10": ndcg}

    monkeypatch.setattr(evaluation, "score_split", scored)
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", str(prepared_dir), "--out", str(run), "--epochs", "4",
                              "--factors", "8", "--layers", "16,8", "--batch-size", "4096",
                              "--device", "cpu", "--quiet", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert next(figures, None) is None  # every epoch was scored
    assert json.loads(res.stdout.strip().splitlines()[-1])["best_epoch"] == 2
    assert torch.load(run / "best.pt", weights_only=True)["epoch"] == 2
    shown = runner.invoke(app, ["inspect", str(run), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["best_epoch"] == 2


# ---- the scoring memory budget ---------------------------------------------------------------


class Largest(TorchDispatchMode):
    """The largest tensor any op allocates while active (views, which allocate nothing, and
    the model's own tables are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


N_USERS, N_ITEMS, BUDGET = 1500, 300, 1 << 20


def _ncf(**kw: Any) -> torch.nn.Module:
    base = {"n_users": N_USERS, "n_items": N_ITEMS, "layers": (64, 32)}
    return build_model(ModelConfig(**{**base, **kw})).eval()


def _baseline(kind: str) -> torch.nn.Module:
    from ncfcli.model.baselines import Baseline, BaselineConfig

    gen = torch.Generator().manual_seed(0)
    if kind == "als":
        tensors = {"user_factors": torch.randn(N_USERS, 128, generator=gen),
                   "item_factors": torch.randn(N_ITEMS, 128, generator=gen)}  # fmt: skip
    else:  # ease: each user's 3 training items
        tensors = {"offsets": torch.arange(0, 3 * N_USERS + 1, 3),
                   "items": torch.randint(0, N_ITEMS, (3 * N_USERS,), generator=gen),
                   "weights": torch.randn(N_ITEMS, N_ITEMS, generator=gen)}  # fmt: skip
    return Baseline(BaselineConfig(kind, N_USERS, N_ITEMS, factors=128), tensors).eval()


MODELS = {
    "mf-128": lambda: _ncf(kind="mf", factors=128),
    "gmf-128": lambda: _ncf(kind="gmf", factors=128),
    "neumf-order": lambda: _ncf(kind="neumf", factors=64, order_factors=64),
    "mlp-one-size": lambda: _ncf(kind="mlp", layers=(256,)),
    "sequence": lambda: _ncf(kind="gmf", factors=16, sequence_length=30, sequence_factors=64),
    "als-128": lambda: _baseline("als"),
    "ease": lambda: _baseline("ease"),
}


def _users(model: torch.nn.Module) -> int:
    """Users to score: a fifth for a sequence term, whose chunks are small (its encoder), still
    more than one chunk would hold at 16 bytes a pair."""
    return N_USERS // 5 if context_window(model) else N_USERS


def _context(model: torch.nn.Module) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(1)
    window = context_window(model)
    if window:  # a window of the latest items, n_items pads
        return torch.randint(0, N_ITEMS + 1, (N_USERS, window), generator=gen)
    return torch.randint(0, N_ITEMS, (N_USERS,), generator=gen) if takes_context(model) else None


@pytest.mark.parametrize("name", list(MODELS))
def test_a_sampled_chunk_stays_within_the_budget(name: str) -> None:
    """G4: a sampled chunk gathers each pair's item rows ([U, C, factors] a table) and each
    user's encoder runs once; the chunk the budget picks holds no tensor over the budget
    (16 bytes a pair let MF with 128 factors gather 32x the budget)."""
    model = MODELS[name]()
    candidates = 51  # a sixth of the catalogue: EASE's dense row is 6 floats a pair
    rows = budget_rows(model, "cpu", BUDGET, candidates, own_items=True)
    gen = torch.Generator().manual_seed(2)
    items = torch.randint(0, N_ITEMS, (N_USERS, candidates), generator=gen)
    prev = _context(model)
    n = _users(model)
    with Largest() as spy:
        ranks = sampled_ranks(model, torch.arange(n), items[:n, 0], items[:n, 1:], rows,
                              None if prev is None else prev[:n])  # fmt: skip
    assert ranks.shape == (n,)
    assert 0 < spy.bytes <= BUDGET, (name, rows, spy.bytes)


@pytest.mark.parametrize("name", ["sequence", "ease", "mf-128"])
def test_a_full_ranking_chunk_stays_within_the_budget(name: str) -> None:
    """Each user's encoder (or dense row) counted in a full ranking's chunk too."""
    model = MODELS[name]()
    rows = budget_rows(model, "cpu", BUDGET, N_ITEMS)
    offsets, seen = torch.zeros(N_USERS + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    test = torch.randint(0, N_ITEMS, (N_USERS,), generator=torch.Generator().manual_seed(3))
    prev = _context(model)
    with Largest() as spy:
        full_ranks(model, 0, _users(model), N_ITEMS, offsets, seen, test, rows, prev, cap=10)
    assert 0 < spy.bytes <= BUDGET, (name, rows, spy.bytes)


def test_the_budget_on_a_gpu_is_at_most_a_share_of_its_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a GPU: torch.cuda's answers faked. 1 GiB free leaves a 512 MiB budget, not
    4 GiB; with 64 GiB free the configured 4 GiB holds."""
    model = MODELS["mf-128"]()
    gpu = torch.device("cuda")
    per_pair = metrics.pair_bytes(model, gpu, 101, own_items=True)
    assert per_pair == metrics.SCORE_PAIR_BYTES + 4 * (128 + 1)  # Q's rows and the item bias
    for free, budget in ((1 << 30, 1 << 29), (64 << 30, metrics.BUDGET_GPU)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, f=free: (f, 80 << 30))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
        assert budget_rows(model, gpu, None, 101, own_items=True) == budget // per_pair


@pytest.mark.parametrize("full_ranking", [False, True])
def test_ncf_eval_prices_its_protocols_pairs(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_ranking: bool
) -> None:
    """`ncf eval` scores chunks priced for its protocol: the sampled one's gathers per pair."""
    calls: list[int] = []
    for name in ("sampled_ranks", "full_split_ranks"):
        inner = getattr(metrics, name)

        def spy(*args: Any, _inner: Any = inner, **kw: Any) -> Any:
            calls.append(int(args[4]))  # max_rows, fifth in both
            return _inner(*args, **kw)

        monkeypatch.setattr(metrics, name, spy)
    run = make_run(prepared_dir, tmp_path / "run")
    res = runner.invoke(app, ["eval", str(run), "--json", "--device", "cpu"]
                        + (["--full-ranking"] if full_ranking else []))  # fmt: skip
    assert res.exit_code == 0, res.output
    model = load_run(run).model
    priced = (budget_rows(model, "cpu", None, 250) if full_ranking
              else budget_rows(model, "cpu", None, 101, own_items=True))  # fmt: skip
    assert calls == [priced]


# ---- exporting again after the README's quickstart ---------------------------------------------


def _serving_first_command() -> list[str]:
    """docs/serving.md's first command, as written (its comment dropped)."""
    page = (ROOT / "docs" / "serving.md").read_text()
    first = re.findall(r"```bash\n(.*?)```", page, flags=re.S)[0].splitlines()[0]
    return shlex.split(first.split("#")[0])


@pytest.mark.slow
def test_the_serving_page_runs_right_after_the_readme_quickstart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, finding 11: the quickstart exports runs/synthetic; docs/serving.md exports it
    again with --triton. The same checkpoint's unchanged export in the run's own folder is
    replaced without --overwrite; a file the user changed there, or another checkpoint's
    export, still needs it, and is left as it was."""
    from tests.test_readme import BLOCKS, TINY, _steps

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NCF_DEVICE", "cpu")
    monkeypatch.setenv("NCF_CACHE_DIR", str(tmp_path / "cache"))
    _, quickstart = _steps(BLOCKS[0])
    for step in quickstart:
        argv = shlex.split(step)[1:]
        res = runner.invoke(app, argv + (TINY if argv[:2] == ["prepare", "synthetic"] else []))
        assert res.exit_code == 0, f"{step}\n{res.output}"
    serving = _serving_first_command()
    assert serving[:3] == ["ncf", "export", "runs/synthetic"] and "--overwrite" not in serving
    res = runner.invoke(app, serving[1:])
    assert res.exit_code == 0, res.output
    export = tmp_path / "runs" / "synthetic" / "export"
    assert (export / "model.onnx").is_file() and (tmp_path / "models" / "ncf" / "1").is_dir()
    # The user's change to a file of the export: never replaced without --overwrite.
    again = [*serving[1:3], "--onnx"]  # the models/ Triton folder is there now
    user_ids = export / "user_ids.parquet"
    user_ids.write_bytes(user_ids.read_bytes() + b"the user's edit")
    before = user_ids.read_bytes()
    res = runner.invoke(app, again)
    assert res.exit_code == 1 and "add --overwrite" in res.stderr and res.stderr.count("\n") == 1
    assert user_ids.read_bytes() == before
    assert runner.invoke(app, [*again, "--overwrite"]).exit_code == 0
    # Another checkpoint (a run trained on): its export replaces the old one only when told.
    best = tmp_path / "runs" / "synthetic" / "best.pt"
    exported = best.read_bytes()
    res = runner.invoke(app, ["train", "data/synthetic", "--out", "runs/synthetic", "--resume",
                              "--epochs", "25", "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert best.read_bytes() != exported, "the resumed epochs chose no new best epoch"
    graph = (export / "model.onnx").read_bytes()
    res = runner.invoke(app, again)
    assert res.exit_code == 1 and "add --overwrite" in res.stderr
    assert (export / "model.onnx").read_bytes() == graph


def test_recommend_prices_each_users_work_over_the_catalogue(
    prepared_dir: Path, tmp_path: Path
) -> None:
    """`ncf recommend` chunks users by the budget with EASE's dense row per user counted."""
    from ncfcli.serve.recommendation import ListScorer, RecommendConfig

    run = tmp_path / "ease"
    res = runner.invoke(app, ["train", str(prepared_dir), "--out", str(run), "--model", "ease",
                              "--device", "cpu", "--quiet"])  # fmt: skip
    assert res.exit_code == 0, res.output
    loaded = load_run(run)
    data = load_prepared(prepared_dir, CPU)
    scorer = ListScorer(loaded, data, RecommendConfig(), CPU)
    per_pair = metrics.pair_bytes(loaded.model, "cpu", data.n_items)
    assert per_pair == metrics.SCORE_PAIR_BYTES + 4  # a float32 row of every item, per user
    assert scorer.step == (metrics.BUDGET_CPU // per_pair) // data.n_items
