"""`ncf prepare --engine auto` (ncfcli/data/engines/choose.py): the memory engine where the input
fits the free memory of wherever it is parsed, Dask otherwise: `pytest tests/test_engine_choice.py`.
"""

from __future__ import annotations

import pytest

from ncfcli.data.config import PrepareConfig
from ncfcli.data.engines.choose import choose_engine


class _Backend:
    is_cuda = True

    def __init__(self, gpu_free: int) -> None:
        self.gpu_free = gpu_free

    def free_memory_bytes(self) -> int:
        return self.gpu_free


@pytest.mark.parametrize("cudf", [False, True])
def test_auto_compares_with_host_memory_where_parsing_is_on_the_host(
    cudf: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G10: with --device cuda and no cuDF the file is parsed on the host, so the input must
    fit the host's free memory too, not only the GPU's."""
    monkeypatch.setattr("ncfcli.data.engines.choose.cudf_installed", lambda: cudf)
    monkeypatch.setattr("ncfcli.data.engines.choose.host_available_bytes", lambda: 1 << 30)  # 1 GiB
    monkeypatch.setattr(
        "ncfcli.data.engines.choose.estimate_rows", lambda config: 20_000_000
    )  # 2 GB
    config = PrepareConfig(source="ratings.csv")
    engine, why = choose_engine(config, _Backend(gpu_free=80 << 30))
    if cudf:  # parsed on the GPU: 80 GiB free there
        assert engine == "memory" and "80.0 GiB GPU" in why, why
    else:
        assert engine == "dask" and "RAM free" in why, why
    synthetic = PrepareConfig(source="synthetic", interactions=20_000_000)
    assert choose_engine(synthetic, _Backend(gpu_free=80 << 30))[0] == "dask"  # made by NumPy


def test_a_forced_memory_engine_refuses_generated_rows_past_the_free_ram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MLPerf's preset (1.22B rows, ~114 GiB at the engine's peak per row) with --engine memory
    is one line naming both sizes, before a row is generated; a size that fits goes on."""
    from ncfcli.errors import NcfError

    monkeypatch.setattr("ncfcli.data.engines.choose.host_available_bytes", lambda: 20 << 30)
    with pytest.raises(NcfError, match=r"1,223,962,043 generated rows need ~.*20\.0 GiB") as e:
        choose_engine(
            PrepareConfig(source="synthetic", preset="ml-20mx16x32", engine="memory"), None
        )
    assert "--engine dask" in str(e.value) and "\n" not in str(e.value)
    small = PrepareConfig(source="synthetic", preset="ml-1m", engine="memory")
    assert choose_engine(small, None) == ("memory", "--engine memory")
