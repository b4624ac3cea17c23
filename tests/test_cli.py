"""The `dspine` command line on the real target."""

import json
import subprocess
import sys

import pytest

from dspine.checkpoint import save_drafter
from dspine.cli import main


def test_help_explains_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "dspine.cli", "generate", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for opt in (
        "--target",
        "--drafter",
        "--method",
        "--prompt",
        "--chat",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--stop",
        "--seed",
        "--json",
    ):
        assert opt in out


def test_generate_dspine_on_real_target(tmp_path, smollm2_drafters, capsys):
    ckpt = save_drafter(smollm2_drafters["dspine"][1], tmp_path / "dspine")
    rc = main(
        [
            "generate",
            "--drafter",
            str(ckpt),
            "--method",
            "dspine",
            "--max-tokens",
            "24",
            "--json",
            "--prompt",
            "What is the capital of France?",
        ]
    )
    assert rc == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["method"] == "dspine" and spec["text"].strip() and 1.0 <= spec["tau"] <= 16
    assert (
        main(
            ["generate", "--method", "ar", "--max-tokens", "24", "--json", "--prompt", "What is the capital of France?"]
        )
        == 0
    )
    ar = json.loads(capsys.readouterr().out)
    assert ar["text"] == spec["text"] and "tau" not in ar


def test_generate_errors(tmp_path, smollm2_drafters, capsys):
    ckpt = save_drafter(smollm2_drafters["dflash"][0], tmp_path / "dflash")
    assert main(["generate", "--drafter", str(ckpt), "--method", "dspine", "--prompt", "hi"]) == 2
    assert "is a 'dflash' drafter" in capsys.readouterr().err
    assert main(["generate", "--prompt", "   "]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--drafter", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_draft_lens_and_spec_max_batch_are_parsed_or_refused_clearly(capsys):
    from dspine.cli import UsageError, _draft_lens

    assert _draft_lens("8,3,3:4,3:4:2,3::1") == [8, 3, (3, 4, None), (3, 4, 2), (3, None, 1)]
    assert _draft_lens("t0000.1.01:5:2,t1") == [("0000.01.1", 5, 2), ("1", None, None)]  # draft trees
    assert _draft_lens("3:4:g,t0000.1:5:g,2::g") == [(3, 4, "g"), ("0000.1", 5, "g"), (2, None, "g")]  # by goodput
    for bad, why in (
        ("t0x", "rank digits"),
        ("t0:0", ">= 1"),
        ("3:4:2:1", "is not D, D:S or D:S:M"),
        ("3:4:h", "is not D, D:S or D:S:M"),
        ("3:4:g:1", "is not D, D:S or D:S:M"),
        ("x", "is not D, D:S or D:S:M"),
        ("3:0", ">= 1"),
        (":4", ">= 1"),
    ):
        with pytest.raises(UsageError, match=why):
            _draft_lens(bad)
    assert main(["serve", "--drafter", "none", "--spec-max-batch", "2"]) == 2
    assert "--spec-max-batch needs a drafter" in capsys.readouterr().err
    assert main(["serve", "--drafter", "none", "--draft-policy", "goodput"]) == 2
    assert "--draft-policy needs a drafter" in capsys.readouterr().err
    assert main(["serve", "--drafter", "none", "--prefix-cache-tokens", "-1"]) == 2
    assert "--prefix-cache-tokens -1: 0 (off) or more" in capsys.readouterr().err
