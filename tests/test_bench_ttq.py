"""benchmarks/bench_time_to_quality.py on tiny synthetic data: `pytest tests/test_bench_ttq.py`.

The benchmark's table (the default `ncf train` beside ALS, median (min-max) over seeds) carries
the figures `ncf eval` gives the runs it trained; its --profile accounts for the whole process,
the steps of the loop included, as the rows docs/train.md's table is made of.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._cli import hears_ctrl_c

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_time_to_quality.py"
CELL = re.compile(r"^(\d+\.\d+) \((\d+\.\d+)-(\d+\.\d+)\)$")


def _bench(*args: str, dataset: str = "synthetic") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCH), "--datasets", dataset, *args],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_the_table_carries_each_models_test_figures(tmp_path: Path) -> None:
    """One seed: a row for the default, one for ALS at the given point and one at the point
    given for full ranking, each cell a median (min-max) that is one run's figure, the
    default's being `ncf eval`'s of the run it trained (best.pt, sampled and full ranking), in
    the header's order; the lead line is the default's sampled HR@10 less ALS's first row's, and
    its full HR@10 less the full-ranking row's."""
    res = _bench("--seeds", "0", "--als", "16,3,1,5", "--als-full", "8,3,1,5", "--ncf-args",
                 "--epochs 2", "--work", str(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("dataset")))
    assert re.split(r"\s{2,}", lines[head]) == ["dataset", "model", "wall s", "HR@10", "NDCG@10",
                                                "full HR@10", "full NDCG@10"]  # fmt: skip
    rows = [re.split(r"\s{2,}", ln) for ln in lines[head + 1 : head + 4]]
    assert [r[:2] for r in rows] == [["synthetic", "ncf default"], ["synthetic", "als 16,3,1,5"],
                                     ["synthetic", "als 8,3,1,5 (full)"]]  # fmt: skip
    (line,) = [ln for ln in lines if ln.startswith("lead over tuned ALS synthetic: ")]
    sampled, full = (float(x) for x in re.findall(r"HR@10 ([+-]\d\.\d{4})", line))
    figure = [[float(c.split()[0]) for c in r[3:]] for r in rows]
    assert sampled == pytest.approx(figure[0][0] - figure[1][0], abs=2e-4)
    assert full == pytest.approx(figure[0][2] - figure[2][2], abs=2e-4)
    assert line.endswith(("met (>= 0.02 each)", "MISSED (>= 0.02 each)"))
    for row in rows:
        assert len(row) == 7
        for value in row[2:]:
            med, lo, hi = CELL.match(value).groups()  # type: ignore[union-attr]
            assert med == lo == hi  # one seed
        assert float(row[2].split()[0]) > 0
        assert all(0.0 <= float(v.split()[0]) <= 1.0 for v in row[3:])
    assert "load average" in lines[0] and lines[-1].startswith("at the end: ")
    assert f"{os.cpu_count()} CPUs, load average" in lines[-1]
    (run,) = tmp_path.glob("ncf-synthetic-ttq-0-*")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for full, cells in ((False, rows[0][3:5]), (True, rows[0][5:7])):
        cmd = [sys.executable, "-m", "ncfcli", "eval", str(run), "--split", "test", "--k", "10",
               "--json", *(["--full-ranking"] if full else [])]  # fmt: skip
        got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env,
                                        timeout=120).stdout)["metrics"]  # fmt: skip
        assert [float(c.split()[0]) for c in cells] == pytest.approx(
            [got["hr@10"], got["ndcg@10"]], abs=5e-5
        )


def test_the_profile_accounts_for_the_whole_process(tmp_path: Path) -> None:
    """--profile 1 with the sequence term: every step's row is printed, the loop's own steps (the
    kind's and the term's) took time, and the rows that do not overlap (all but the second
    thread's samples) add up to the whole process."""
    res = _bench("--profile", "1", "--work", str(tmp_path), "--ncf-args", "--sequence-length 5")
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("synthetic: 1 epoch(s)"))
    whole = float(re.search(r"the whole process (\d+\.\d+) s", lines[start]).group(1))  # type: ignore[union-attr]
    rows = {}
    for ln in lines[start + 2 :]:
        m = re.match(r"^(.+?)\s{2,}(\d+\.\d+)(?:\s+\d+\.\d+)?(?:\s+(\d+\.\d+)%| +\(--\))?$", ln)
        if m:
            rows[m.group(1)] = (float(m.group(2)), m.group(3))
    for step in ("kind: forward (loss, L2)", "kind: backward", "optimizer (Adam)",
                 "sequence term: its batches", "sequence term: forward (loss)",
                 "sequence term: backward", "calibrate (the term's scale)",
                 "first epoch's samples (critical path)", "validation (sampled; full ranking under a full-* metric)",
                 "data loading", "interpreter, imports (torch, ncfcli), exit"):  # fmt: skip
        assert rows[step][0] > 0, step
    assert "curves.png (once, at the end)" in rows
    top = [(sec, share) for label, (sec, share) in rows.items()
           if not label.startswith("  ") and share is not None]  # fmt: skip
    assert sum(sec for sec, _ in top) == pytest.approx(whole, abs=0.02)
    assert sum(float(share) for _, share in top) == pytest.approx(100.0, abs=0.5)
    assert rows["rest of the process"][0] < 0.5 * whole


def test_an_unseen_csv_is_benchmarked_under_its_files_name(tmp_path: Path) -> None:
    """`--datasets csv --csv PATH`: the log is prepared from PATH, and its rows in the table are
    named by the file's stem; without --csv it is one error line."""
    rows = [("user", "item", "timestamp")]
    rows += [(u, (u * 7 + k * 3) % 150, k) for u in range(60) for k in range(8)]
    log = tmp_path / "shop.csv"
    log.write_text("".join(",".join(map(str, r)) + "\n" for r in rows))
    res = _bench("--csv", str(log), "--seeds", "0", "--no-als", "--ncf-args", "--epochs 1",
                 "--work", str(tmp_path / "work"), dataset="csv")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "== shop" in res.stdout.splitlines()
    assert any(re.match(r"^shop\s{2,}ncf default\s{2,}", ln) for ln in res.stdout.splitlines())
    assert (tmp_path / "work" / "csv-shop-ttq" / "meta.json").is_file()
    res = _bench("--seeds", "0", "--no-als", dataset="csv")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        "error: --datasets csv needs --csv PATH, a file (got None)"
    ]
    res = _bench("--als-full", "8,3,1,5")  # a full-ranking point needs the other one given
    assert res.returncode == 2 and "--als-full needs --als" in res.stderr
    res = _bench("--als", "16,3,1,5", "--als-full", "8,3", "--work", str(tmp_path / "bad"))
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].endswith(
        "error: argument --als-full: '8,3' is not factors,reg,alpha,iterations (four numbers)"
    )
    assert not (tmp_path / "bad").exists()


def test_instacarts_orders_become_user_item_timestamp(tmp_path: Path) -> None:
    """benchmarks/instacart_csv.py: a product's time is its order number x 1000 + its place in
    the cart (the sample's first column is pandas' index; an empty place counts 0); a file
    without Instacart's columns is one error line and writes nothing."""
    sample = tmp_path / "df_sample.csv"
    sample.write_text(
        ",order_id,user_id,order_number,order_dow,add_to_cart_order,product_id\n"
        "0,11,1,1,2,1.0,196\n"
        "1,11,1,1,2,2.0,14084\n"
        "2,12,1,2,3,1.0,196\n"
        "3,13,7,3,0,,55\n"
    )
    out = tmp_path / "orders.csv"
    script = REPO / "benchmarks" / "instacart_csv.py"
    res = subprocess.run([sys.executable, str(script), str(out), "--sample", str(sample)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert out.read_text().splitlines() == [
        "user,item,timestamp", "1,196,1001", "1,14084,1002", "1,196,2001", "7,55,3000",
    ]  # fmt: skip
    assert {p.name for p in tmp_path.iterdir()} == {"df_sample.csv", "orders.csv"}
    bad = tmp_path / "beauty.csv"
    bad.write_text("user,item,timestamp\n1,2,3\n")
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "x.csv"), "--sample",
                          str(bad)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode != 0
    assert len(res.stderr.strip().splitlines()) == 1 and "not Instacart's orders" in res.stderr
    broken = tmp_path / "broken.csv"
    broken.write_text(sample.read_text() + "4,14,7,x,0,1.0,9\n")  # an order number that is not
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "x.csv"), "--sample",
                          str(broken)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode != 0 and res.stderr.strip().splitlines() == [
        f"error: {broken}: line 6: not an order number and a cart place"
    ]
    assert not [p for p in tmp_path.iterdir() if "x.csv" in p.name]  # no temporary file left


def test_a_line_per_user_log_becomes_user_item_timestamp(tmp_path: Path) -> None:
    """benchmarks/sequences_csv.py: each item's time is its place in its user's line (blank
    lines skipped); a token that is not a whole number, or a user's second line, is one error
    line naming the line, and nothing is written."""
    source = tmp_path / "Toys.txt"
    source.write_text("1 5 3 5\n\n2 7\n10 1 2 3\n")
    out = tmp_path / "toys.csv"
    script = REPO / "benchmarks" / "sequences_csv.py"

    def convert(src: Path, dst: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), str(src), str(dst)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    res = convert(source, out)
    assert res.returncode == 0, res.stderr
    assert out.read_text().splitlines() == [
        "user,item,timestamp", "1,5,0", "1,3,1", "1,5,2", "2,7,0", "10,1,0", "10,2,1", "10,3,2",
    ]  # fmt: skip
    assert res.stdout.strip() == f"{out}: 7 rows of 3 users from {source}"
    for text, why in (
        ("1 5 3\n2 x 4\n", "line 2: not a user id and item ids (whole numbers)"),
        ("1 5 3\n\n1 4\n", "line 3: user 1 has a line already"),
        ("1 5 -3\n", "line 1: not a user id and item ids (whole numbers)"),
    ):
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        res = convert(bad, tmp_path / "x.csv")
        assert res.returncode != 0
        assert res.stderr.strip().splitlines() == [f"error: {bad}: {why}"]
        assert not [p for p in tmp_path.iterdir() if "x.csv" in p.name]  # no temporary file left
    res = convert(tmp_path / "missing.txt", tmp_path / "x.csv")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.txt'}: no such file"]
    binary = tmp_path / "toys.bin"
    binary.write_bytes(b"1 2\n\xff\xfe 3\n")
    res = convert(binary, tmp_path / "x.csv")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [f"error: {binary}: not a text file"]
    res = convert(source, tmp_path / "no-folder" / "x.csv")
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith(f"error: cannot write {tmp_path / 'no-folder' / 'x.csv'}: ")
    assert not [p for p in tmp_path.iterdir() if "x.csv" in p.name]  # no temporary file left


def test_ctrl_c_in_a_conversion_leaves_nothing(tmp_path: Path) -> None:
    """benchmarks/sequences_csv.py interrupted while it writes: one line saying nothing was
    written and how to go on, no traceback, and neither the CSV nor its temporary file left."""
    source = tmp_path / "big.txt"
    with source.open("w") as f:
        f.writelines(f"{u} " + " ".join(str((u * 7 + k) % 5000) for k in range(30)) + "\n"
                     for u in range(300_000))  # fmt: skip
    out = tmp_path / "out" / "big.csv"
    out.parent.mkdir()
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "sequences_csv.py"),
                             str(source), str(out)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=hears_ctrl_c)  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(out.parent.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until its temporary file is being written
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip().splitlines() == [
        "interrupted: nothing was written; run the same command again"
    ]
    assert list(out.parent.iterdir()) == []
