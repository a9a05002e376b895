"""The command lines as a user meets them when they get something wrong, and their reference page:
bad input is one line (what was wrong, where the help is), every default is shown once, and
docs/reference/cli.md has every command and subcommand, as the parsers print them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "reference" / "cli.md"
MARKER = re.compile(r"^<!-- cli: (?P<command>[^>]+?) -->$", re.MULTILINE)
# Every command line with subcommands (each must be on the page, and each of its subcommands).
COMMANDS = ("android_sim", "android_sim.datasets", "orchestrator", "device_runtime")
# The benchmarks whose options the page shows (one command each, no subcommands).
BENCHMARKS = ("benchmarks.quality", "benchmarks.nextword", "benchmarks.mixing")
# The page's generator, run in its own process (it sets the environment the pages are made in).
_HELPS = """
import json, sys
sys.path.insert(0, "docs/hooks")
import reference
print(json.dumps({c: reference.cli_help(c) for c in sys.argv[1:]}))
"""


def helps(commands: list[str]) -> dict[str, str]:
    """Each `python -m ...` command's help as the page shows it."""
    done = subprocess.run(
        [sys.executable, "-c", _HELPS, *commands], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, str] = json.loads(done.stdout.splitlines()[-1])
    return found


@pytest.mark.parametrize(
    "args",
    [
        ("android_sim", "run", "--rounds", "abc"),
        ("android_sim", "simulate", "--rounds", "abc"),
        ("android_sim", "nonsense"),
        ("android_sim.datasets", "fetch", "--no-such-option"),
        ("orchestrator", "pause"),
        ("device_runtime", "import"),
        ("model_export", "--num-items", "abc"),
    ],
    ids=" ".join,
)
def test_bad_input_is_one_line_that_says_where_the_help_is(args: tuple[str, ...]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )

    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert ": error: " in lines[0] and lines[0].endswith(" --help)"), lines[0]
    assert "usage:" not in done.stderr and done.stdout == ""


def test_the_page_has_every_command_and_shows_each_default_once() -> None:
    on_page = MARKER.findall(PAGE.read_text())
    tops = helps([f"python -m {c}" for c in COMMANDS])
    wanted = set()
    for command, text in tops.items():
        choices = re.search(r"\{([a-z,-]+)\}", text)
        assert choices, f"{command} --help lists no subcommands"
        wanted |= {command, *(f"{command} {sub}" for sub in choices[1].split(","))}

    shown = helps(on_page)

    assert wanted <= set(on_page), f"docs/reference/cli.md lacks {sorted(wanted - set(on_page))}"
    assert "python -m model_export" in on_page
    assert {f"python -m {b}" for b in BENCHMARKS} <= set(on_page)
    for command, text in shown.items():
        assert "(default: None)" not in text, command
        # One option's help (its lines up to the next option) says its default once at most.
        for option in re.split(r"\n  (?=-)", text):
            assert option.count("(default:") <= 1, (command, option)
