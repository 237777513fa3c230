"""The Dockerfile can only install torch's CUDA 12 build and loads one CUDA runtime:
`pytest tests/test_dockerfile.py`.

Its install step is read as text and checked with `bash -n` (issue 19's F8: pip could pick
PyPI's CUDA 13 torch; two libcudart could load in either import order). No image is built.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _dockerfile_script() -> str:
    text = (REPO / "Dockerfile").read_text()
    match = re.search(r"^RUN <<'EOF'\n(.*?)^EOF$", text, re.S | re.M)
    assert match, "the Dockerfile's install step is one heredoc RUN"
    return match.group(1)


def test_f8_torch_comes_from_the_pytorch_index_alone_and_stays() -> None:
    script = _dockerfile_script()
    torch_line = re.search(r'pip install [^\n]*"torch==\$\{TORCH_VERSION\}\+\$\{TORCH_CUDA\}"'
                           r'[^\n]*\n[^\n]*', script)  # fmt: skip
    assert torch_line, script
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"' in torch_line.group(0)
    assert "--extra-index-url" not in script  # it would let pip see PyPI's CUDA 13 torch
    pin = re.search(r'echo "torch==\$\{TORCH_VERSION\}\+\$\{TORCH_CUDA\}" >(\S+)', script)
    assert pin, script
    assert re.search(rf"pip install [^\n]*-c {re.escape(pin.group(1))} -e '\.\[", script)


def test_f8_the_install_script_parses_and_checks_one_cuda_runtime() -> None:
    script = _dockerfile_script()
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    check = re.search(r"<<'PY'\n(.*?)^PY$", script, re.S | re.M)
    assert check, script
    compile(check.group(1), "one_cudart.py", "exec")
    assert "python /tmp/one_cudart.py torch cudf cupy" in script
    assert "python /tmp/one_cudart.py cudf cupy torch" in script  # both import orders
    assert 'ln -sf "$(readlink -f "$env_rt")" "$rt"' in script
