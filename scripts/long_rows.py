"""Chat rows of one long assistant reply each, for long-context runs on generated data (run by hand; not a test).

    python scripts/long_rows.py OUT.jsonl [--rows 4] [--words 180000] [--successors K] [--seed 0]

Each row is a one-line user turn and an assistant reply of `--words` words of the tiny set (words the tiny
tokenizer knows: about one token each), so with `data.truncation=truncate_right` (the default) every packed row
of up to that many tokens is a single document: the case where context parallel's contiguous spans load causal
attention least evenly.

The words are drawn independently, or with `--successors K` from a first-order Markov chain: each word has K
successors (drawn once from the seed), and the next word is one of the current word's K at random. A model can
learn the chain but not predict which successor comes, so the loss has a floor (ln K a word) instead of falling
to zero as on the tiny chat set: what a comparison of training curves at a real model's size needs.
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
    parser.add_argument("--successors", type=int, default=0,
                        help="K > 0: a Markov chain with K successors a word (the loss's floor: ln K a word)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from qwenft.data.tiny_chat import train_words

    words = train_words()
    if args.successors < 0 or args.successors > len(words):
        sys.exit(f"long_rows.py: --successors={args.successors} must be 0 (independent words) or 1..{len(words)}")
    rng = random.Random(args.seed)
    draw = markov(words, args.successors, rng) if args.successors else lambda r, n: r.choices(words, k=n)
    out = Path(args.out)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for _ in range(args.rows):
            reply = " ".join(draw(rng, args.words)) + "."
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    tmp.rename(out)
    print(f"{out}: {args.rows} rows of {args.words} words")


def markov(words: list[str], successors: int, rng: random.Random):
    """A function (rng, n) -> n words of a chain in which each word is followed by one of its `successors`
    words (a table drawn here from `rng`), uniformly."""
    table = {w: rng.sample(words, successors) for w in words}

    def draw(r: random.Random, n: int) -> list[str]:
        out = [r.choice(words)]
        for _ in range(n - 1):
            out.append(r.choice(table[out[-1]]))
        return out

    return draw


if __name__ == "__main__":
    main()
