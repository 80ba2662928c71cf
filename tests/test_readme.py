"""The Python examples of the README and the docs run as written; their commands use the project's
environment and valid flags."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
#: the README and the user docs it sends a reader to: their examples run and their commands parse
#: (docs/architecture.md's snippets are fragments of the code it describes, not examples)
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md"),
    *sorted((ROOT / "docs" / "papers").glob("*.md")),
]
README = "\n".join(p.read_text() for p in PAGES)
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
BASH = re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


# The examples train small federations end to end (5-12 s each from an empty compilation cache): slow.
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README+docs[python block {index}]", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()  # each example prints its result


def test_readme_commands_use_the_projects_environment():
    """Before: `python -m experiments.run ...` (the system interpreter, no sidejax) after the quick start."""
    bare = [m.start() for m in re.finditer(r"(?<![\w/.])python3? -m ", README)]
    assert not bare, [README[i : i + 60] for i in bare]
    assert len(re.findall(r"\.venv/bin/python -m experiments\.", README)) >= 10


def test_readme_cli_commands_parse():
    """Every experiments.run command in the README has valid flags and choices."""
    from experiments.run import build_parser

    commands = [
        shlex.split(line, comments=True)
        for block in BASH
        for line in block.replace("\\\n", " ").splitlines()
        if "-m experiments.run" in line
    ]
    assert len(commands) >= 8
    for argv in commands:
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value before the command
            argv = argv[1:]
        if argv and argv[-1] == "&":  # started in the background (the processes of a several-host run)
            argv = argv[:-1]
        assert argv[:3] == [".venv/bin/python", "-m", "experiments.run"], argv
        if "--help" not in argv:
            build_parser().parse_args(argv[3:])  # argparse exits (SystemExit) on a bad flag or choice


def test_readme_preset_example_is_the_shipped_preset():
    """The README's TOML example is ``demo_digits_fedpm_klms`` (its description shortened)."""
    import tomllib

    from experiments.config import config_from_dict, load_preset

    (block,) = re.findall(r"```toml\n(.*?)```", README, flags=re.S)
    values = tomllib.loads(block)
    values.pop("description")
    assert config_from_dict(values) == load_preset("demo_digits_fedpm_klms")
