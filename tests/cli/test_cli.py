"""The ``sparrow`` command line: help for every command, ``config show``, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparrow_nemo import cli, commands
from sparrow_nemo.grpo.recipe import load_config

SPARROW = Path(sys.executable).with_name("sparrow")


def run_sparrow(*argv: str) -> subprocess.CompletedProcess[str]:
    """The installed console script (the entry point in pyproject.toml) in a subprocess."""
    assert SPARROW.is_file(), (
        f"console script {SPARROW} missing: is the package installed (pip install -e .)?"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(SPARROW), *argv], capture_output=True, text=True, timeout=120, env=env)


def test_misspelled_key_exits_2_with_one_line_suggestion() -> None:
    done = run_sparrow("config", "show", "sparsity.treshold=0.9")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "sparsity.treshold" in lines[0] and "did you mean 'sparsity.threshold'?" in lines[0]


def test_top_level_help_lists_every_command() -> None:
    done = run_sparrow("--help")
    assert done.returncode == 0
    for name in ("train", "calibrate", "bench", "plan", "eval", "config", "experiment"):
        assert f"\n    {name}" in done.stdout


def test_commands_are_discovered_from_their_modules() -> None:
    assert [m.NAME for m in commands.discover()] == [
        "bench",
        "calibrate",
        "config",
        "data",
        "eval",
        "experiment",
        "export",
        "plan",
        "train",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["train"],
        ["calibrate"],
        ["bench"],
        ["bench", "rollout"],
        ["plan"],
        ["eval"],
        ["config"],
        ["config", "show"],
        ["experiment"],
    ],
)
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: sparrow {' '.join(argv)}")
    if argv[-1] not in ("bench", "config"):  # leaf commands take a recipe and overrides
        assert "--config RECIPE" in out and "KEY=VALUE" in out


def test_config_show_prints_the_resolved_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "show", "--config", "qwen3_8b_math", "sparsity.threshold=0.88"]) == 0
    out = capsys.readouterr().out
    expected = load_config("qwen3_8b_math", ["sparsity.threshold=0.88"])
    assert out.splitlines()[0] == f"# sparrow config 'qwen3_8b_math', hash {expected.hash()}"
    assert yaml.safe_load(out) == expected.to_dict()


def test_config_show_defaults_to_the_tiny_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "show"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == load_config("tiny_cpu").to_dict()


def test_commands_validate_the_recipe_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--config", "tiny_cpu", "grpo.loss.clip_high=0.1"]) == 2
    err = capsys.readouterr().err
    assert err == "config error: grpo.loss.clip_high=0.1 (from command line) - expected >= clip_low (0.2)\n"


def test_missing_recipe_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["config", "show", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recipe '" in err and "not found" in err


def test_yaml_error_is_one_line_with_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("trainer:\n  seed: [1\n")
    assert cli.main(["config", "show", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.yaml line 3" in err


def test_bad_input_is_one_line_without_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPARROW_DEBUG", raising=False)
    argv = ["train", "--run-dir", str(tmp_path / "run"), "++reward.options.mode=all"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "sparrow train: reward.options ['mode']: the synthetic task's reward takes no options"
    )
    assert "Traceback" not in err and len(err.splitlines()) == 1
    monkeypatch.setenv("SPARROW_DEBUG", "1")
    with pytest.raises(ValueError, match="takes no options"):
        cli.main(argv)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: p.write_text("x"), "exists and is not a folder"),
        (lambda p: (p.symlink_to(p.with_name("b")), p.with_name("b").symlink_to(p)), "a symbolic link loop"),
        (lambda p: p.symlink_to(p.with_name("nowhere")), "a symbolic link to nothing"),
    ],
    ids=["a file", "a symlink loop", "a dangling link"],
)
def test_a_run_dir_that_is_no_folder_is_one_line(
    make, said: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before anything is built (no warm-start, no model): one line naming the path."""
    monkeypatch.delenv("SPARROW_DEBUG", raising=False)
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "a"
    make(run)
    for path in (run, run / "sub"):
        assert cli.main(["train", "--run-dir", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"sparrow train: run folder {path}"), err
        assert said in err or (path.name == "sub" and "Not a directory" in err), err
    assert not (tmp_path / "cache").exists()
