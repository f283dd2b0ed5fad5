"""GOMP_SPINCOUNT: set from the settings before llama.cpp (and so libgomp) loads, never over an operator's choice."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tandem.config import DraftSettings, TargetSettings, limit_omp_spin
from tandem.launch import ROOT


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    return monkeypatch


def test_default_and_lowest_of_colocated_models(clean_env: pytest.MonkeyPatch) -> None:
    limit_omp_spin(TargetSettings())
    assert os.environ["GOMP_SPINCOUNT"] == "10000"
    clean_env.delenv("GOMP_SPINCOUNT")
    limit_omp_spin(TargetSettings(omp_spin_count=50000), DraftSettings(omp_spin_count=2000))
    assert os.environ["GOMP_SPINCOUNT"] == "2000"


def test_minus_one_keeps_libgomp_default(clean_env: pytest.MonkeyPatch) -> None:
    limit_omp_spin(TargetSettings(omp_spin_count=-1), DraftSettings(omp_spin_count=-1))
    assert "GOMP_SPINCOUNT" not in os.environ
    with pytest.raises(ValueError):
        TargetSettings(omp_spin_count=-2)


@pytest.mark.parametrize("variable", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_environment_wins(clean_env: pytest.MonkeyPatch, variable: str) -> None:
    clean_env.setenv(variable, "passive" if variable == "OMP_WAIT_POLICY" else "123")
    limit_omp_spin(TargetSettings(omp_spin_count=7))
    assert os.environ.get("GOMP_SPINCOUNT") == (None if variable == "OMP_WAIT_POLICY" else "123")


ENTRY_POINTS = {
    # The services' entry point.
    "service": """
        import tandem.cli as cli
        from tandem.config import TargetSettings

        async def run(settings):
            report()

        cli.service_main(TargetSettings, "omp-spin-test", run, ["--omp-spin-count", "4321"])
    """,
    # The co-located gateway's: the target and a model draft in one process, the lowest count of the two.
    "colocated": """
        from services.gateway.__main__ import colocated_models
        from tandem.config import GatewaySettings

        os.environ.update(TANDEM_TARGET_OMP_SPIN_COUNT="9000", TANDEM_DRAFT_OMP_SPIN_COUNT="4321")
        colocated_models(GatewaySettings(local_ngram=False, draft="127.0.0.1:1"), None)
        report()
    """,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_entry_points_set_it_before_libgomp_loads(entry: str) -> None:
    """Both entry points: the variable is set while libgomp is not yet mapped, and llama.cpp, loaded after it, maps
    libgomp (so it read the variable at load)."""
    script = textwrap.dedent(
        """
        import os
        import tandem.config as config

        def mapped():
            return "libgomp" in open("/proc/self/maps").read()

        seen = {}
        original = config.limit_omp_spin
        def spy(*models):
            seen["gomp_loaded_before"] = mapped()
            original(*models)
        config.limit_omp_spin = spy

        def report():
            print(os.environ.get("GOMP_SPINCOUNT"), seen["gomp_loaded_before"], mapped())
        """
    ) + textwrap.dedent(ENTRY_POINTS[entry])
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["4321", "False", "True"], out.stderr[-2000:]
