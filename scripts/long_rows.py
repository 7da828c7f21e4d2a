"""Chat rows of one long assistant reply each, for long-context runs on generated data (run by hand; not a test).

    python scripts/long_rows.py OUT.jsonl [--rows 4] [--words 180000] [--seed 0]

Each row is a one-line user turn and an assistant reply of `--words` words of the tiny set (words the tiny
tokenizer knows: about one token each), so with `data.truncation=truncate_right` (the default) every packed row
of up to that many tokens is a single document: the case where context parallel's contiguous spans load causal
attention least evenly.
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--words", type=int, default=180_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from qwenft.data.tiny_chat import train_words

    words = train_words()
    rng = random.Random(args.seed)
    out = Path(args.out)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for _ in range(args.rows):
            reply = " ".join(rng.choices(words, k=args.words)) + "."
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    tmp.rename(out)
    print(f"{out}: {args.rows} rows of {args.words} words")


if __name__ == "__main__":
    main()
