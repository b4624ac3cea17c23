"""SGLang's names that dspine relies on exist in every supported release's source (wheels downloaded from
PyPI with --no-deps and read as zips, never imported: 0.5.23 needs a newer torch than this machine has)."""

import subprocess
import sys
from pathlib import Path

import pytest

from dspine.sglang.compat import NAMES, RELEASES, missing_names

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "sglang-wheels"


def _wheel(version: str) -> Path:
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                f"sglang=={version}",
                "-d",
                str(CACHE),
            ],
            check=True,
            timeout=600,
        )
        found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    assert found, f"pip did not fetch sglang {version}"
    return found[0]


@pytest.mark.network  # pip downloads each release's wheel once (cached under .cache/)
@pytest.mark.parametrize("version", RELEASES)
def test_sglang_release_has_every_name_dspine_uses(version):
    assert missing_names(_wheel(version)) == {}


def test_the_check_notices_a_missing_name(tmp_path):
    import zipfile

    fake = tmp_path / "sglang-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        for path in NAMES:
            z.writestr(path, "class DFlashDraftModel: pass\n")
    gone = missing_names(fake)
    assert "self\\.hidden_norm\\s*=" in gone["sglang/srt/models/dflash.py"]
    assert set(gone) == set(NAMES)


def test_names_since_a_release_are_required_from_it_on():
    """The candidate-selector contract (SGLang >= 0.5.23) is checked for 0.5.23 and absent from 0.5.17: the
    plugin takes the selector path only where it exists."""
    from dspine.sglang.compat import SINCE

    gone = missing_names(_wheel("0.5.17"), "0.5.23")
    want = {path: set(p) for path, p in SINCE["0.5.23"].items()}
    assert {path: set(p) & want[path] for path, p in gone.items()} == want
