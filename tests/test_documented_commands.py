"""Every `qwenft` command printed in README.md and docs/*.md runs as written, as far as this CPU can run it:

- `recipes`, `show`, `plan`: run as written; `slurm`: run with --dry-run (no cluster);
- `train` (and `torchrun ... qwenft train`): their config composed and validated as `qwenft train` does, the
  mesh laid out on the world size torchrun gives (a training run of each would take hours here; the user
  files they name, /ckpt/..., /data/..., do not exist here);
- `$ qwenft ...` lines followed by a `qwenft: error: ...` line: that exact line and exit code 2.
Templates (`recipe=X`, `…`, `[overrides]`) and `export` (it needs a trained run) are left out."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEMPLATE = re.compile(r"…|\.\.\.|(?:^|\s)\[|<|=[A-Z]\b|\bX\b")  # a word-initial [ is an optional part


def _commands() -> list[tuple[str, str, str | None]]:
    """(where, command, the error line shown after it or None) from the docs' fenced blocks."""
    found = []
    for doc in DOCS:
        lines, in_block = doc.read_text().splitlines(), False
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                in_block = not in_block
            elif in_block and re.match(r"\s*(\$ )?(qwenft|torchrun) ", line):
                where = f"{doc.name}:{i + 1}"
                text = line.strip()
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                shown = text.startswith("$ ")
                text = text.removeprefix("$ ")
                command = re.split(r"\s+#", text, maxsplit=1)[0].split(" || ")[0].strip()
                error = None
                if shown and i + 1 < len(lines) and lines[i + 1].startswith("qwenft: error: "):
                    error = lines[i + 1]
                found.append((where, command, error))
            i += 1
    return found


def _runnable(command: str) -> bool:
    if TEMPLATE.search(command) or "scripts/" in command:
        return False
    words = shlex.split(command)
    sub = words[words.index("qwenft") + 1] if "qwenft" in words else None
    return sub in ("recipes", "show", "plan", "slurm", "train")


def _unique(found: list[tuple[str, str, str | None]]) -> list[tuple[str, str, str | None]]:
    """One entry per distinct (command, error line), its `where` naming every place that prints it."""
    places: dict = {}
    for where, command, error in found:
        places.setdefault((command, error), []).append(where)
    return [("+".join(wheres), command, error) for (command, error), wheres in places.items()]


COMMANDS = _unique([c for c in _commands() if _runnable(c[1])])


def test_the_docs_have_commands():
    assert len(COMMANDS) > 20
    assert any("slurm" in c for _, c, _ in COMMANDS) and any(e for _, _, e in COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("where, command, error", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_documented_command_runs_as_written(where, command, error, tmp_path, monkeypatch, capsys):
    """In this process through qwenft.cli.main, what the `qwenft` command calls (a subprocess would add ~4 s of
    imports to each; tests/test_cli.py and tests/test_slurm.py run the command itself); `slurm` with a PATH that
    has no SLURM, as the docs' outputs assume."""
    words = shlex.split(command)
    at = words.index("qwenft")
    sub, args = words[at + 1], words[at + 2:]
    world = next((int(w.split("=")[1]) for w in words[:at] if w.startswith("--nproc-per-node=")), None)
    if "--nproc-per-node" in words[:at]:
        world = int(words[words.index("--nproc-per-node") + 1])
    if sub == "slurm" and "--dry-run" not in args and error is None:
        args = [*args, "--dry-run"]
    if sub == "train":  # compose and validate as train does (show), then lay the mesh out on torchrun's world
        sub = "show"
    from qwenft.cli import main

    if sub == "slurm":
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no SLURM here, as the docs' outputs assume
    monkeypatch.chdir(tmp_path)  # files the command writes (plan.json=..., slurm's run dir) land here
    monkeypatch.delenv("RANK", raising=False)
    code = main([sub, *args])
    printed = capsys.readouterr()
    out = subprocess.CompletedProcess([sub, *args], code, printed.out, printed.err)
    if error is not None and world is None:
        assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == error, (where, out.stderr[-2000:])
        return
    assert out.returncode == 0, (where, command, out.stderr[-2000:])
    if world is not None or words[at + 1] == "train":
        from qwenft.conf import compose
        from qwenft.conf.layout import resolve_layout

        cfg = compose(args, missing_ok=True)
        nproc = world or cfg.launcher.nproc_per_node
        if error is not None:
            with pytest.raises(ValueError) as e:
                resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, nproc)
            assert f"qwenft: error: {e.value}" == error, where
        else:
            resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, nproc)
