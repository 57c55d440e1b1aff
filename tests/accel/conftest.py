"""Every accelerator test calibrates into its own cache folder, with the off switch unset."""
import pytest

from seqlab.accel import apply as accel_apply
from seqlab.accel import calibrate


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(accel_apply.DISABLE_ENV, raising=False)
