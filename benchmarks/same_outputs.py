"""Same outputs, old code against new (issue 33): digests of what 5 small configs write.

    python benchmarks/same_outputs.py --out DIGESTS.json [--work DIR] [--configs a,b]
    python benchmarks/same_outputs.py --compare OLD.json NEW.json

The first form runs each config through the public CLI only, as `python -m ncfcli ...`
subprocesses with this process's environment and working directory, so the code under test is
whichever ncfcli that environment imports (PYTHONPATH, or the current directory): this script
never imports ncfcli, and works unchanged against any checkout. It prints which ncfcli the
subprocesses import. Everything runs on the CPU, on a synthetic source of 4,000 rows, 1-2
epochs: about 2 minutes on 2 cores.

The configs, each with its own prepared dataset (so `--configs` may pick any of them):
  default         memory-engine prepare; `ncf train` with its defaults (MF with the order term
                  here); eval sampled and --full-ranking; recommend --exclude-seen; export --onnx
  neumf_order     --model neumf --order-factors 16; eval of the last checkpoint on validation;
                  export --session --triton
  mf_sequence     --model mf --sequence-length 5; eval; export; recommend --all-users (Parquet)
  dask            prepare --engine dask --workers 1 (its dataset's bytes); a 1-epoch train
  baseline_nproc  prepare --no-validation; --model ease and eval; a 2-process (gloo) NCF train

What is recorded, per config, as (key -> value) leaves compared exactly:
  - data/...: sha256 of every file of the prepared dataset. meta.json is hashed as parsed JSON
    without its `created` time (the only key that changes run to run).
  - the --json stdout of every command, and metrics.jsonl, config.json, eval.json, model.json,
    flattened to one leaf per number or string.
  - best.pt and checkpoints/last.pt, loaded with torch (weights_only=True): a digest of each
    tensor's dtype, shape and bytes, keyed by its path (model/..., optimizer/state/...), and
    every other leaf's value.
  - each .onnx file as its graph: nodes, initializers, inputs, outputs, opsets, serialized
    deterministically after dropping each node's metadata_props and doc_string, plus one digest
    per initializer. The file's own bytes are not compared: torch's exporter writes, per node,
    the Python stack trace (absolute paths of ncfcli's source files and line numbers) and the
    module classes' qualified names, which a move of modules changes with no change to the
    graph. Those bytes' digest is kept under `info` (same checkout: same bytes).
  - the recommend Parquet's content (schema and rows), not its bytes.
Dropped everywhere, as they differ run to run or machine to machine: wall-clock seconds and
throughputs (seconds, train_seconds, samples_per_second), times of day (created, evaluated),
the Dask workers' memory figures, and the shard's `why` (it quotes free RAM). Absolute paths
under --work read `<work>`, so two runs may use different work folders. model.json's
checkpoint_sha256 and the .onnx digest in its `written` are dropped: best.pt embeds the
dataset's absolute path, and the .onnx file the source paths above.

`--compare` prints every (config, key) that differs or exists on one side only and exits 1;
else it prints `identical: N digests over M configs` and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FORMAT = "ncfcli-same-outputs"
SOURCE = ["synthetic", "--users", "200", "--items", "400", "--rows", "4000"]
SMALL = ["--factors", "16", "--layers", "32,16,8"]
CPU = ["--device", "cpu"]
# Leaf keys that hold wall-clock time, throughput, a time of day or this machine's memory.
VOLATILE = re.compile(
    r"(^|/)(seconds|train_seconds|samples_per_second|created|evaluated"
    r"|peak_rss_bytes|memory_limit|spilled_bytes|shard/why)$"
)
# model.json: digests of files whose bytes embed absolute paths (see the module docstring).
PATH_BOUND = re.compile(r"^(checkpoint_sha256|written/[^/]*\.onnx)$")

Leaves = dict[str, Any]


class CliFailed(RuntimeError):
    """A `python -m ncfcli` command exited non-zero."""


class Runner:
    """Runs one config's commands under `work` and gathers its leaves."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.digests: Leaves = {}
        self.info: Leaves = {}
        self.commands: list[str] = []

    def path(self, name: str) -> str:
        return str(self.work / name)

    def ncf(self, key: str, *args: str, ok: tuple[int, ...] = (0,)) -> Any:
        """Run `python -m ncfcli ARGS`; record its --json stdout (one object, or one a line)."""
        cmd = [sys.executable, "-m", "ncfcli", *args]
        self.commands.append(" ".join(args).replace(str(self.work), "<work>"))
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if done.returncode not in ok:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise CliFailed(f"exit {done.returncode}: {' '.join(cmd)}\n{tail}")
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if lines and key:
            self.add(key, lines[0] if len(lines) == 1 else lines)
        return lines

    def add(self, prefix: str, obj: Any) -> None:
        for key, value in flatten(obj, prefix):
            if not VOLATILE.search(key):
                self.digests[key] = self.normal(value)

    def normal(self, value: Any) -> Any:
        """Absolute paths under the work folder read <work>."""
        if isinstance(value, str):
            return value.replace(str(self.work), "<work>")
        return value

    def add_json_file(self, prefix: str, path: Path, drop: re.Pattern[str] | None = None) -> None:
        obj = json.loads(path.read_text())
        leaves = dict(flatten(obj, ""))
        kept = {k: v for k, v in leaves.items() if not (drop and drop.search(k))}
        for key, value in kept.items():
            if not VOLATILE.search(key):
                self.digests[f"{prefix}/{key}"] = self.normal(value)

    def add_jsonl(self, prefix: str, path: Path) -> None:
        for i, line in enumerate(path.read_text().splitlines()):
            self.add(f"{prefix}/{i}", json.loads(line))


def flatten(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of nested dicts and lists; an empty container is a leaf."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple) and obj:
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}/{i}" if prefix else str(i))
    else:
        yield prefix, obj if not isinstance(obj, tuple) else list(obj)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    return sha256(path.read_bytes())


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------- readers of outputs


def dataset(r: Runner, prefix: str, folder: Path) -> None:
    """sha256 of every file of a prepared dataset; meta.json without its `created` time."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == "meta.json":
            meta = json.loads(path.read_text())
            meta.pop("created", None)
            r.digests[f"{prefix}/{rel}"] = sha256(canonical(meta))
        else:
            r.digests[f"{prefix}/{rel}"] = file_sha256(path)


def tensor_digest(t: Any) -> str:
    """dtype, shape and the raw bytes of a tensor (any dtype, bf16 included)."""
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{str(t.dtype)}{list(t.shape)}:{sha256(raw)}"


def checkpoint(r: Runner, prefix: str, path: Path) -> None:
    """Every leaf of a checkpoint: tensors as digests, numbers and strings as they are."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            r.digests[key] = tensor_digest(obj)
        elif isinstance(obj, dict) and obj:
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, list | tuple) and obj:
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")
        elif not VOLATILE.search(key):
            r.digests[key] = r.normal(obj if not isinstance(obj, tuple) else list(obj))

    walk(state, prefix)


def run_outputs(r: Runner, prefix: str, run: Path) -> None:
    """A run folder: metrics.jsonl, config.json, best.pt and the last checkpoint."""
    r.add_jsonl(f"{prefix}/metrics.jsonl", run / "metrics.jsonl")
    r.add_json_file(f"{prefix}/config.json", run / "config.json")
    checkpoint(r, f"{prefix}/best.pt", run / "best.pt")
    checkpoint(r, f"{prefix}/last.pt", run / "checkpoints" / "last.pt")


def onnx_graph(r: Runner, prefix: str, path: Path) -> None:
    """The graph without per-node debug metadata (source paths, line numbers), see docstring."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    r.info[f"{prefix}/bytes"] = file_sha256(path)

    def strip(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
            for attr in node.attribute:
                for sub in [attr.g, *attr.graphs]:
                    strip(sub)

    strip(model.graph)
    for function in model.functions:
        for node in function.node:
            del node.metadata_props[:]
            node.doc_string = ""
    r.digests[f"{prefix}/graph"] = sha256(model.SerializeToString(deterministic=True))
    r.digests[f"{prefix}/nodes"] = len(model.graph.node)
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        r.digests[f"{prefix}/initializer/{init.name}"] = (
            f"{array.dtype}{list(array.shape)}:{sha256(array.tobytes())}"
        )


def export_folder(r: Runner, prefix: str, folder: Path) -> None:
    """An export or Triton folder: .onnx as graphs, .json flattened, other files' bytes."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f"{prefix}/{path.relative_to(folder).as_posix()}"
        if path.suffix == ".onnx":
            onnx_graph(r, rel, path)
        elif path.name == "model.json":
            r.add_json_file(rel, path, drop=PATH_BOUND)
        else:
            r.digests[rel] = file_sha256(path)


def parquet_content(r: Runner, prefix: str, path: Path) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    meta.pop("pandas", None)  # pandas' own bookkeeping (its version), not ncf's content
    schema = [(f.name, str(f.type)) for f in table.schema]
    r.digests[f"{prefix}/rows"] = table.num_rows
    r.digests[f"{prefix}/schema"] = sha256(canonical([schema, meta]))
    r.digests[f"{prefix}/content"] = sha256(canonical(table.to_pydict()))


# ---------------------------------------------------------------- the five configs


def prepare(r: Runner, name: str, *extra: str) -> Path:
    out = r.work / name
    r.ncf(f"prepare/{name}", "prepare", *SOURCE, *extra, *CPU, "--out", str(out), "--json", "-q")
    dataset(r, f"data/{name}", out)
    return out


def train(r: Runner, data: Path, name: str, *extra: str) -> Path:
    out = r.work / name
    r.ncf(f"train/{name}", "train", str(data), *extra, *CPU, "--out", str(out), "--json", "-q")
    run_outputs(r, f"run/{name}", out)
    return out


def evaluate(r: Runner, run: Path, key: str, *extra: str) -> None:
    r.ncf(f"eval/{key}", "eval", str(run), *extra, *CPU, "--json", "-q")
    # eval.json gathers every eval of the run: each read supersedes the last.
    r.add_json_file(f"run/{run.name}/eval.json", run / "eval.json")


def export(r: Runner, run: Path, key: str, *extra: str) -> None:
    r.ncf(f"export/{key}", "export", str(run), "--onnx", *extra, "--json", "-q")
    export_folder(r, f"export/{key}", run / "export")


def config_default(r: Runner) -> None:
    data = prepare(r, "data", "--engine", "memory")
    run = train(r, data, "run", "--epochs", "2")
    evaluate(r, run, "sampled")
    evaluate(r, run, "full", "--full-ranking")
    r.ncf(
        "recommend", "recommend", str(run), "-u", "1", "-u", "7", "--exclude-seen", *CPU, "--json"
    )
    export(r, run, "run")


def config_neumf_order(r: Runner) -> None:
    data = prepare(r, "data", "--engine", "memory", "--seed", "1")
    run = train(r, data, "run", "--model", "neumf", "--order-factors", "16", *SMALL, "-e", "2")
    evaluate(
        r, run, "last_validation", "--split", "validation", "--checkpoint", "last", "-k", "5,10"
    )
    triton = r.work / "triton"
    export(r, run, "run", "--session", "--triton", str(triton))
    export_folder(r, "triton", triton)


def config_mf_sequence(r: Runner) -> None:
    data = prepare(r, "data", "--engine", "memory")
    run = train(
        r, data, "run", "--model", "mf", "--sequence-length", "5", "--sequence-factors", "16",
        "--factors", "16", "--epochs", "2",
    )  # fmt: skip
    evaluate(r, run, "sampled")
    export(r, run, "run")
    recs = r.work / "recs.parquet"
    r.ncf("", "recommend", str(run), "--all-users", "--out", str(recs), *CPU, "-q")
    parquet_content(r, "recommend/recs.parquet", recs)


def config_dask(r: Runner) -> None:
    data = prepare(r, "data", "--engine", "dask", "--workers", "1")
    train(r, data, "run", *SMALL, "--epochs", "1")


def config_baseline_nproc(r: Runner) -> None:
    data = prepare(r, "data", "--engine", "memory", "--no-validation")
    run = train(r, data, "ease", "--model", "ease")
    evaluate(r, run, "ease")
    train(r, data, "nproc2", "--nproc", "2", *SMALL, "--epochs", "2")


CONFIGS: dict[str, Callable[[Runner], None]] = {
    "default": config_default,
    "neumf_order": config_neumf_order,
    "mf_sequence": config_mf_sequence,
    "dask": config_dask,
    "baseline_nproc": config_baseline_nproc,
}


# ---------------------------------------------------------------- main


def which_ncfcli() -> str:
    code = "import ncfcli; print(ncfcli.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


def record(out: Path, work: Path, names: list[str]) -> int:
    module = which_ncfcli()
    print(f"ncfcli under test: {module}", flush=True)
    result: dict[str, Any] = {"format": FORMAT, "version": 1, "ncfcli": module, "configs": {}}
    for name in names:
        folder = work / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        runner = Runner(folder.resolve())
        start = time.perf_counter()
        try:
            CONFIGS[name](runner)
        except CliFailed as err:
            print(f"{name}: {err}", file=sys.stderr)
            return 2
        result["configs"][name] = {
            "commands": runner.commands,
            "digests": runner.digests,
            "info": runner.info,
        }
        took = time.perf_counter() - start
        print(f"{name}: {len(runner.digests)} digests, {took:.1f}s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    total = sum(len(c["digests"]) for c in result["configs"].values())
    print(f"wrote {out}: {total} digests over {len(names)} configs")
    return 0


def compare(old_path: Path, new_path: Path) -> int:
    old = json.loads(old_path.read_text())["configs"]
    new = json.loads(new_path.read_text())["configs"]
    differences = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"{name}: config only in {'old' if name in old else 'new'}")
            differences += 1
            continue
        a, b = old[name]["digests"], new[name]["digests"]
        for key in sorted(set(a) | set(b)):
            if key not in b:
                print(f"{name} {key}: only in old ({a[key]!r})")
            elif key not in a:
                print(f"{name} {key}: only in new ({b[key]!r})")
            elif a[key] != b[key] or type(a[key]) is not type(b[key]):
                print(f"{name} {key}: {a[key]!r} -> {b[key]!r}")
            else:
                continue
            differences += 1
    if differences:
        print(f"{differences} differences")
        return 1
    total = sum(len(c["digests"]) for c in old.values())
    print(f"identical: {total} digests over {len(old)} configs")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON file of the digests to write")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder of the runs")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("--out or --compare is required")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"same_outputs_{os.getpid()}"
    return record(args.out, work, names)


if __name__ == "__main__":
    sys.exit(main())
