"""ncf never replaces what it did not write: `pytest tests/test_out_safety.py`.

A folder of the user's own files given as --out (to prepare, train or export, with or without
--overwrite) is byte-for-byte untouched, and the command ends with one error line. The root,
home and current folders and the input's own folder are refused. ncf's own earlier output is
replaced only with --overwrite, and not when the user has put a file of their own in it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli import fsutil
from ncfcli.cli import app
from ncfcli.errors import NcfError
from ncfcli.fsutil import (
    MARKER,
    atomic_dir,
    check_out_dir,
    check_out_file,
    record_written,
    remove_output,
    write_marker,
)
from tests._runs import make_run

runner = CliRunner()
TINY = ["--users", "40", "--items", "60", "--interactions", "400", "--eval-negatives", "5"]
SMALL_TRAIN = ["--device", "cpu", "--factors", "4", "--layers", "8", "4", "--batch-size", "256",
               "--neg-per-pos", "1", "--epochs", "1", "-q"]  # fmt: skip


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result: Any) -> str:
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder): equal means untouched."""
    out: dict[str, bytes | None] = {".": None}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), folder)] = None
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = Path(p).read_bytes()
    return out


def users_folder(path: Path, *names: str) -> Path:
    """A folder of the user's own files (a nested one too), some named as ncf names its own."""
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("my only copy\n")
    (path / "notes").mkdir()
    (path / "notes" / "todo.txt").write_bytes(b"\x00\x01binary")
    for name in names:
        (path / name).write_text(f"the user's {name}\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "data"
    res = ncf("prepare", "synthetic", *TINY, "--out", out, "--device", "cpu", "-q")
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(data, tmp_path_factory.mktemp("safety") / "run")


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    ("command", "names"),
    [
        ("prepare", ["meta.json", "train_users.npy"]),
        ("train", ["config.json", "best.pt"]),
        ("export", ["model.onnx", "model.json"]),
        ("export-sidecar", ["user_ids.parquet"]),
        ("triton", ["config.pbtxt"]),
    ],
)
def test_a_folder_of_the_users_files_is_untouched(
    data: Path, run: Path, tmp_path: Path, command: str, names: list[str], overwrite: bool
) -> None:
    target = tmp_path / "important"
    args: list[Any] = {
        "prepare": ["prepare", "synthetic", *TINY, "--device", "cpu", "-q", "--out", target],
        "train": ["train", data, *SMALL_TRAIN, "--out", target],
        "export": ["export", run, "--onnx", "--out", target / "model.onnx"],
        "export-sidecar": ["export", run, "--onnx", "--out", target / "mine.onnx"],
        "triton": ["export", run, "--onnx", "--out", tmp_path / "e" / "m.onnx",
                   "--triton", tmp_path, "--name", "important"],
    }[command]  # fmt: skip
    users_folder(target, *names)
    before = snapshot(target)
    result = ncf(*args, *(["--overwrite"] if overwrite else []))
    line = one_error_line(result)
    assert "ncf did not write" in line, line
    assert snapshot(target) == before


@pytest.mark.parametrize("command", ["prepare", "train"])
def test_special_folders_are_refused(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    home = users_folder(tmp_path / "home")
    cwd = users_folder(home / "work")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    before = snapshot(home)
    run_args = {"prepare": ["prepare", "synthetic", *TINY, "--device", "cpu", "-q"],
                "train": ["train", data, *SMALL_TRAIN]}[command]  # fmt: skip
    for out, says in [(".", "current folder"), ("..", "home folder"), ("~", "home folder"),
                      (str(home), "home folder"), ("/", "root folder")]:  # fmt: skip
        for extra in ([], ["--overwrite"]):
            line = one_error_line(ncf(*run_args, "--out", out, *extra))
            assert says in line, (out, line)
    assert snapshot(home) == before


def test_a_file_or_a_link_as_out_is_refused(data: Path, tmp_path: Path) -> None:
    users_folder(tmp_path / "mine")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    before = snapshot(tmp_path)
    for out, says in ((tmp_path / "notes.txt", "is a file"), (tmp_path / "link", "symbolic link")):
        for args in (["prepare", "synthetic", *TINY, "--device", "cpu", "-q"],
                     ["train", data, *SMALL_TRAIN]):  # fmt: skip
            assert says in one_error_line(ncf(*args, "--out", out, "--overwrite"))
    assert snapshot(tmp_path) == before


def test_an_out_that_cannot_be_made_is_one_line(data: Path, run: Path, tmp_path: Path) -> None:
    """A folder under a file (the OS refuses it, as a path on a read-only or missing mount
    would): one `error: PATH: REASON` line, the path the user gave, nothing written."""
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    under = tmp_path / "notes.txt" / "sub"
    for args in (["prepare", "synthetic", *TINY, "--device", "cpu", "-q", "--out", under],
                 ["train", data, *SMALL_TRAIN, "--out", under],
                 ["tune", data, "--trials", "1", "--max-epochs", "1", "-q", "--out", under]):  # fmt: skip
        if args[0] == "tune":
            pytest.importorskip("optuna")
        line = one_error_line(ncf(*args))
        assert line.startswith(f"error: {tmp_path / 'notes.txt'}"), line
        assert ".tmp-" not in line and "Traceback" not in line, line
    assert snapshot(tmp_path) == before


def test_file_system_errors_name_the_path_the_user_gave() -> None:
    """ncf's temporary names are shown as the target they stand for; the system's reason is
    kept; an error that holds its path only in its text (pyarrow's) is its first line."""
    import errno

    from ncfcli.fsutil import file_system_line

    full = OSError(errno.ENOSPC, "No space left on device", "/data/runs/.u.tmp-3f2a/best.pt")
    assert file_system_line(full) == "/data/runs/u/best.pt: No space left on device"
    named = FileNotFoundError(errno.ENOENT, "No such file or directory", ".out.parquet.tmp-12")
    assert file_system_line(named) == "out.parquet: No such file or directory"
    text = FileNotFoundError("[Errno 2] Failed to open local file '/m/.x.parquet.tmp-27728'.\nmore")
    assert file_system_line(text) == "Failed to open local file '/m/x.parquet'."
    moved = OSError(errno.EXDEV, "Invalid cross-device link", "/a/.r.tmp-1", None, "/b/r")
    assert file_system_line(moved) == "/a/r -> /b/r: Invalid cross-device link"


def test_a_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fills the disk, as the OS says it (ENOSPC, EDQUOT) or as NumPy does (a
    short write, "N requested and M written", no errno, nothing left free): one line naming the
    target, the temporary file or folder gone. Another error, or a short write with room left,
    is not called a full disk."""
    import errno
    import shutil
    from collections import namedtuple

    from ncfcli import fsutil
    from ncfcli.errors import NcfError

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 1000}
    monkeypatch.setattr(shutil, "disk_usage", lambda where: usage(10**9, 10**9, free["bytes"]))
    short = OSError("625000 requested and 40928 written")
    for error in (short, OSError(errno.ENOSPC, "No space left on device"),
                  OSError(errno.EDQUOT, "Disk quota exceeded")):  # fmt: skip
        with pytest.raises(NcfError, match="its disk is full") as said:
            with fsutil.atomic_dir(tmp_path / "data", "dataset") as tmp:
                (tmp / "part.npy").write_bytes(b"x")
                raise error
        assert str(said.value).startswith(f"cannot write {tmp_path / 'data'}: "), said.value
        with pytest.raises(NcfError, match=f"cannot write {tmp_path / 'm.json'}: its disk"):
            with fsutil.atomic_path(tmp_path / "m.json") as tmp:
                tmp.write_bytes(b"{")
                raise error
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(PermissionError):
        with fsutil.atomic_path(tmp_path / "m.json"):
            raise PermissionError(errno.EACCES, "Permission denied")
    free["bytes"] = 10**9  # a short write with room left: another cause, its own error
    with pytest.raises(OSError, match="requested and"):
        with fsutil.atomic_dir(tmp_path / "data", "dataset"):
            raise short
    assert list(tmp_path.iterdir()) == []


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ncf ... | head`: the pipe's reader gone, the command exits 1 without a word (no error
    line about a pipe the user closed on purpose, no traceback)."""
    import typer

    from ncfcli.cli import user_errors

    @user_errors
    def printing() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(typer.Exit) as stop:
        printing()
    assert stop.value.exit_code == 1
    assert capsys.readouterr().err == ""


def test_the_inputs_own_folder_is_refused(data: Path, tmp_path: Path) -> None:
    src = tmp_path / "ml"
    src.mkdir()
    (src / "u.data").write_text("".join(f"{u}\t{i}\t5\t{u * i}\n" for u in range(1, 9)
                                        for i in range(1, 7)))  # fmt: skip
    before = snapshot(tmp_path)
    for out in (src, tmp_path, src / "u.data"):
        res = ncf("prepare", src / "u.data", "--eval-negatives", 1, "--out", out, "--overwrite",
                  "--device", "cpu", "-q")  # fmt: skip
        assert "holds the input" in one_error_line(res)
    # a folder holding the run's dataset is not a run folder either
    res = ncf("train", data, *SMALL_TRAIN, "--out", data.parent, "--overwrite")
    assert "holds the input" in one_error_line(res)
    assert snapshot(tmp_path) == before


def test_prepare_replaces_its_own_dataset_only_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "d"
    first = ncf("prepare", "synthetic", *TINY, "--out", out, "--device", "cpu", "--json")
    assert first.exit_code == 0, first.output
    assert json.loads((out / MARKER).read_text())["kind"] == "dataset"
    before = snapshot(out)
    again = ncf("prepare", "synthetic", *TINY, "--seed", 1, "--out", out, "--device", "cpu", "-q")
    assert "add --overwrite" in one_error_line(again)
    assert snapshot(out) == before
    replaced = ncf("prepare", "synthetic", *TINY, "--seed", 1, "--out", out, "--overwrite",
                   "--device", "cpu", "-q")  # fmt: skip
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((out / "meta.json").read_text())["seed"] == 1
    # A file of the user's inside ncf's folder makes it the user's folder too.
    (out / "my-analysis.ipynb").write_text("{}")
    before = snapshot(out)
    res = ncf("prepare", "synthetic", *TINY, "--out", out, "--overwrite", "--device", "cpu", "-q")
    assert "'my-analysis.ipynb'" in one_error_line(res)
    assert snapshot(out) == before
    # A run is not a dataset: --overwrite does not turn one into the other.
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text("{}")
    write_marker(run, "run", ["config.json"])
    before = snapshot(run)
    res = ncf("prepare", "synthetic", *TINY, "--out", run, "--overwrite", "--device", "cpu", "-q")
    assert "holds a training run, not a prepared dataset" in one_error_line(res)
    assert snapshot(run) == before


def test_train_replaces_its_own_run_only_with_overwrite(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert ncf("train", data, *SMALL_TRAIN, "--out", out).exit_code == 0
    before = snapshot(out)
    assert "--resume" in one_error_line(ncf("train", data, *SMALL_TRAIN, "--out", out))
    assert snapshot(out) == before
    assert ncf("eval", out, "--k", 5, "--device", "cpu").exit_code == 0  # ncf's eval.json too
    res = ncf("train", data, *SMALL_TRAIN, "--seed", 5, "--out", out, "--overwrite")
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["seed"] == 5 and config["resumes"] == []
    assert not (out / "eval.json").exists()  # the replaced run's results went with it
    (out / "checkpoints" / "keep-me.txt").write_text("mine")
    before = snapshot(out)
    res = ncf("train", data, *SMALL_TRAIN, "--out", out, "--overwrite")
    assert "'checkpoints/keep-me.txt'" in one_error_line(res)
    assert snapshot(out) == before
    # a dataset folder is not a run folder
    res = ncf("train", data, *SMALL_TRAIN, "--out", data, "--overwrite")
    assert "holds" in one_error_line(res)


def test_a_run_folder_another_live_run_writes_is_refused(data: Path, tmp_path: Path) -> None:
    """Two runs given one --out at once: the later one found the earlier one's new folder
    unstarted and replaced it, then both wrote it. A folder a live run holds (its flock, here
    held by the test as that run would) is refused by train, --overwrite, --resume and a
    baseline alike, and stays as it was; once the run ends, it is free."""
    from ncfcli.rundir.record import RunDirLock, make_run_dir

    run = tmp_path / "run"
    res = ncf("train", data, *SMALL_TRAIN, "--out", run)
    assert res.exit_code == 0, res.output
    before = snapshot(run)
    with RunDirLock(run):
        for extra in ([], ["--overwrite"], ["--resume"], ["--model", "pop", "--overwrite"]):
            args = ["train", data, "--out", run, *extra]
            args += [] if "--resume" in extra or "pop" in extra else SMALL_TRAIN
            line = one_error_line(ncf(*args))
            assert "is being written by another ncf run that is still going" in line, line
        assert snapshot(run) == before
        # the earlier run's folder made while this run started: held before anything goes
        with pytest.raises(NcfError, match="another ncf run"):
            make_run_dir(run, replace=True, lock=RunDirLock(run))
        assert snapshot(run) == before
    res = ncf("train", data, *SMALL_TRAIN, "--out", run, "--overwrite")
    assert res.exit_code == 0, res.output


def test_a_file_system_without_locks_runs_unlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock refused for want of locks (NFS without its lock daemon: ENOLCK) is no other run:
    the run goes on unlocked, where only a lock held elsewhere (EWOULDBLOCK) is one line."""
    import errno
    import fcntl

    from ncfcli.rundir.record import RunDirLock

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with RunDirLock(tmp_path) as lock:
        assert lock.fd is None


def test_a_new_run_holds_its_folder_while_it_trains(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose --out is new holds the folder from when it makes it: a second run started
    meanwhile is refused (its check saw no folder, or the first one's unstarted)."""
    from ncfcli.rundir.record import RunDirLock
    from ncfcli.training import optim

    run, seen = tmp_path / "new", []
    real = optim.pointwise_loss

    def loss_and_look(*args: Any, **kwargs: Any) -> Any:
        if not seen:
            try:
                RunDirLock(run).take()
                seen.append("free")
            except NcfError:
                seen.append("held")
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "pointwise_loss", loss_and_look)
    res = ncf("train", data, *SMALL_TRAIN, "--out", run)
    assert res.exit_code == 0, res.output
    assert seen == ["held"]


def test_export_replaces_its_own_files_only_with_overwrite(run: Path, tmp_path: Path) -> None:
    theirs = users_folder(tmp_path / "mine")  # a folder of the user's files: refused, untouched
    before = snapshot(theirs)
    assert "which ncf did not write" in one_error_line(
        ncf("export", run, "--onnx", "--out", theirs / "ncf.onnx")
    )
    assert snapshot(theirs) == before
    out = tmp_path / "models" / "ncf.onnx"
    first = ncf("export", run, "--onnx", "--out", out, "--json")
    assert first.exit_code == 0, first.output
    before = snapshot(out.parent)
    again = ncf("export", run, "--onnx", "--out", out)
    assert "add --overwrite" in one_error_line(again)
    assert snapshot(out.parent) == before
    res = ncf("export", run, "--onnx", "--out", out, "--overwrite", "--json")
    assert res.exit_code == 0, res.output


def test_the_single_file_helper(tmp_path: Path) -> None:
    """The check other commands' single-file outputs use (recommend --out recs.parquet)."""
    from ncfcli.errors import NcfError

    recs = tmp_path / "recs.parquet"
    assert check_out_file(recs, overwrite=False) is False  # new: fine
    recs.write_bytes(b"user's")
    with pytest.raises(NcfError, match="ncf did not write it"):
        check_out_file(recs, overwrite=True)
    mine = tmp_path / "ncf.parquet"
    mine.write_bytes(b"ncf's")
    record_written(tmp_path, [mine.name])
    with pytest.raises(NcfError, match="add --overwrite"):
        check_out_file(mine, overwrite=False)
    assert check_out_file(mine, overwrite=True) is True
    with pytest.raises(NcfError, match="ncf did not write it"):  # the record names only its own
        check_out_file(recs, overwrite=True)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o755), (0o077, 0o700)])
def test_created_folders_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    """A dataset (written under a temporary name, then renamed) gets a plain mkdir's mode."""
    old = os.umask(umask)
    try:
        res = ncf("prepare", "synthetic", *TINY, "--out", tmp_path / "d", "--device", "cpu", "-q")
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "d").stat().st_mode & 0o777 == mode


# ---- the record's rules, one by one -------------------------------------------------------------


def _run_like(folder: Path, *extra: str) -> Path:
    """A folder as `ncf train` leaves it: its record listing two files and checkpoints/ (with a
    record of its own); `extra` names more files put in it."""
    (folder / "checkpoints").mkdir(parents=True)
    write_marker(folder / "checkpoints", "checkpoints", ["*.pt"])
    (folder / "checkpoints" / "last.pt").write_text("w")
    for name in ("best.pt", "metrics.csv", *extra):
        (folder / name).write_text(name)
    write_marker(folder, "run", ["best.pt", "metrics.csv", "checkpoints"])
    return folder


def test_ncfs_leftovers_neither_block_nor_count_as_the_users(tmp_path: Path) -> None:
    """A crash's leftover (ncf's own `.NAME.tmp-XXXX` or `.NAME.old-XXXX`) in ncf's output does
    not stop --overwrite, and a folder holding nothing else is an empty one; a user's file
    whose name merely looks alike (no leading dot) is the user's."""
    run = _run_like(tmp_path / "run", ".best.pt.tmp-4242")
    assert check_out_dir(run, "run", overwrite=True) is True
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / ".run.old-77").mkdir()
    assert check_out_dir(tmp_path / "crashed", "run", overwrite=False) is False
    mine = _run_like(tmp_path / "mine", "notes.tmp-2024")
    with pytest.raises(NcfError, match="holds 'notes.tmp-2024', which ncf did not write"):
        check_out_dir(mine, "run", overwrite=True)


def test_a_listed_folder_without_ncfs_record_is_the_users(tmp_path: Path) -> None:
    """checkpoints/ is ncf's only while it holds ncf's record: the user's own folder of that
    name is refused, and nothing is changed."""
    run = _run_like(tmp_path / "run")
    (run / "checkpoints" / MARKER).unlink()
    with pytest.raises(NcfError, match="holds 'checkpoints/', which ncf did not write"):
        check_out_dir(run, "run", overwrite=True)
    assert (run / "checkpoints" / "last.pt").read_text() == "w"


def test_removing_ncfs_output_unlinks_a_link_and_keeps_what_it_points_to(tmp_path: Path) -> None:
    """An entry of the record that is a link to a folder is removed as a link: the folder it
    points to, and the user's files there, stay."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("the user's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "data").symlink_to(theirs, target_is_directory=True)
    write_marker(out, "files", ["data"])
    remove_output(out)
    assert not (out / "data").exists() and (theirs / "keep.txt").read_text() == "the user's"


def test_folders_above_home_or_the_current_one_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "top" / "home" / "me"
    cwd = tmp_path / "elsewhere" / "work" / "deep"
    for folder in (home, cwd):
        folder.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    for out, says in [(home.parent, "home folder"), (tmp_path / "top", "home folder"),
                      (cwd.parent, "current folder"), (cwd.parent.parent, "current folder")]:  # fmt: skip
        with pytest.raises(NcfError, match=says):
            check_out_dir(out, "run", overwrite=True)


def test_output_that_cannot_be_put_in_place_leaves_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing ncf's output moves the old one aside, the new one in, then removes the old:
    where the new one cannot move in, the old one is back where it was, whole."""
    run = _run_like(tmp_path / "run")
    real = os.replace

    def second_fails(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".run.tmp-"):
            raise PermissionError(13, "Permission denied", str(dst))
        real(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", second_fails)
    with pytest.raises(PermissionError), atomic_dir(run, "run") as tmp:
        (tmp / "best.pt").write_text("new")
    assert (run / "best.pt").read_text() == "best.pt"
    assert (run / "checkpoints" / "last.pt").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_run_folder_is_replaced_unasked_only_where_nothing_in_it_can_be_resumed(
    tmp_path: Path,
) -> None:
    """A run that saved no checkpoint (it failed or was killed in its first epoch) is replaced
    without --overwrite; one holding best.pt or last.pt is not, nor a run from before ncf
    recorded its output, which only --resume continues."""
    from ncfcli.rundir.record import check_run_dir

    data = tmp_path / "data"
    data.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    write_marker(run, "run", ["config.json", "best.pt", "checkpoints"])
    assert check_run_dir(run, overwrite=False, data_dir=str(data)) is True
    (run / "best.pt").write_text("w")
    with pytest.raises(NcfError, match="add --resume to continue it, --overwrite to replace"):
        check_run_dir(run, overwrite=False, data_dir=str(data))
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "last.pt").write_text("w")
    with pytest.raises(NcfError, match="already holds a run: add --resume to continue it"):
        check_run_dir(old, overwrite=True, data_dir=str(data))
