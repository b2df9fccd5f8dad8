"""The console script: version, help, and every command's --help."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

import batchgen
from batchgen.cli import COMMANDS, main


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"batchgen, version {batchgen.__version__}"


def test_help_lists_every_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_help(name: str):
    result = CliRunner().invoke(main, [name, "--help"], prog_name="batchgen")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: batchgen {name} ")
    # a docstring, not just the option list
    assert len(result.output.split("Options:")[0].strip().splitlines()) >= 3


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "batchgen", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"batchgen, version {batchgen.__version__}"


def test_unknown_command_is_a_clean_error():
    result = CliRunner().invoke(main, ["frobnicate"])
    assert result.exit_code == 2
    assert "No such command 'frobnicate'" in result.output
