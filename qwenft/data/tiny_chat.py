"""Generator of the shipped tiny chat dataset (`qwenft/data/assets/tiny_chat*.jsonl`).

The conversations are short and rule-based (arithmetic, colour and animal facts, reversing words,
counting, a few two-turn chats), so a tiny randomly initialised model's loss visibly falls within
~100 steps. The output is committed; regenerate it with

    python3 -m qwenft.data.tiny_chat

which is deterministic (a fixed seed, no hash-order dependence): rerunning it must not change the files.
"""

import json
import random
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
TRAIN_PATH = ASSETS / "tiny_chat.jsonl"
VAL_PATH = ASSETS / "tiny_chat_val.jsonl"

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
COLOURS = {
    "the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
    "a tomato": "red", "an orange": "orange", "a plum": "purple", "the sun": "yellow", "milk": "white",
    "a leaf": "green", "blood": "red",
}
ANIMAL_SOUNDS = {
    "a cow": "moo", "a dog": "woof", "a cat": "meow", "a duck": "quack", "a sheep": "baa",
    "a pig": "oink", "a horse": "neigh", "an owl": "hoot", "a frog": "ribbit", "a lion": "roar",
}
WORDS = ["cat", "dog", "sun", "tree", "book", "milk", "fish", "bird", "star", "moon", "lamp", "rain",
         "road", "ship", "cake", "door", "hand", "king", "rose", "wind"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly."]


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    op = rng.choice(["plus", "minus", "times"])
    if op == "minus" and b > a:
        a, b = b, a
    result = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return f"What is {a} {op} {b}?", f"{a} {op} {b} is {result}."


def _colour(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(sorted(COLOURS))
    return f"What colour is {thing}?", f"{thing[0].upper()}{thing[1:]} is {COLOURS[thing]}."


def _animal(rng: random.Random) -> tuple[str, str]:
    animal = rng.choice(sorted(ANIMAL_SOUNDS))
    return f"What sound does {animal} make?", f"{animal[0].upper()}{animal[1:]} says {ANIMAL_SOUNDS[animal]}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word {word}.", word[::-1]


def _count(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 6)
    stop = start + rng.randint(2, 4)
    return f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + "."


def _spell(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 10)
    return f"Write {n} as a word.", NUMBER_WORDS[n]


TASKS = [_arithmetic, _colour, _animal, _reverse, _count, _spell]


def conversation(rng: random.Random) -> dict:
    """One conversation: optional system prompt, then one turn (75%) or two turns."""
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(1 if rng.random() < 0.75 else 2):
        question, answer = rng.choice(TASKS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def generate(n_train: int = 400, n_val: int = 40, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct conversations; the validation rows never occur in the training rows."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_val:
        row = conversation(rng)
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def train_words() -> list[str]:
    """The distinct words of the shipped training set (punctuation stripped), sorted: words the tiny tokenizer
    knows, for generating larger synthetic chat data (scripts/data_cache_bench.py, scripts/long_rows.py)."""
    text = " ".join(m["content"] for line in open(TRAIN_PATH) for m in json.loads(line)["messages"])
    return sorted(set(text.replace("?", " ").replace(".", " ").replace(",", " ").split()))


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    train, val = generate()
    write_jsonl(train, TRAIN_PATH)
    write_jsonl(val, VAL_PATH)
    print(f"wrote {len(train)} rows to {TRAIN_PATH} and {len(val)} rows to {VAL_PATH}")


if __name__ == "__main__":
    main()
