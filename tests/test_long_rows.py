"""scripts/long_rows.py's Markov rows: every word is followed only by its K successors, all of them in use."""

import importlib.util
import json
import random
import subprocess
import sys
from collections import defaultdict

from helpers import REPO


def _long_rows():
    spec = importlib.util.spec_from_file_location("long_rows", REPO / "scripts" / "long_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_markov_words_follow_the_table():
    words = [f"w{i}" for i in range(20)]
    draw = _long_rows().markov(words, 3, random.Random(0))
    text = draw(random.Random(1), 20_000)
    seen = defaultdict(set)
    for a, b in zip(text, text[1:]):
        seen[a].add(b)
    assert set(seen) <= set(words) and len(seen) >= 10  # words no other word leads to may never appear
    assert all(len(s) == 3 for s in seen.values())  # 3 successors each, every one drawn in 20,000 words


def test_the_script_writes_chat_rows_and_refuses_a_bad_k(tmp_path):
    out = tmp_path / "rows.jsonl"
    script = str(REPO / "scripts" / "long_rows.py")
    subprocess.run([sys.executable, script, str(out), "--rows", "2", "--words", "30", "--successors", "2"],
                   check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["messages"][1]["content"].split()) == 30 for r in rows)
    bad = subprocess.run([sys.executable, script, str(tmp_path / "bad.jsonl"), "--successors", "-1"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--successors=-1 must be 0" in bad.stderr
    assert not (tmp_path / "bad.jsonl").exists()
