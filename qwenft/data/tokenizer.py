"""Tokenizers: a real checkpoint's tokenizer, or the `tiny` byte-level BPE trained on the shipped data.

`load_tokenizer("tiny")` lets `recipe=tiny` run with no download: it trains a small BPE (< 1 s on the
400 shipped conversations) the first time and caches it under a directory named by a hash of everything
that determines it (training data, vocab size, special tokens, template, this recipe's version), so a
changed input can never reuse a stale cache. Ranks that race to build it each write a private temp
directory and rename it into place; the loser discards its copy.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qwenft.data.tiny_chat import TRAIN_PATH

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0, 1, 2

# Qwen's layout without the tool/thinking branches: <|im_start|>role\ncontent<|im_end|>\n per message.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_RECIPE_VERSION = "1"  # bump when the training recipe below changes, to invalidate old caches
DEFAULT_CACHE_DIR = Path("~/.cache/qwenft/tokenizers")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
BUILT_IN = ("tiny", "tiny_vlm")  # names load_tokenizer generates (and caches) itself rather than a dir's files


def load_tokenizer(path_or_name: str, cache_dir: str | os.PathLike | None = None,
                   vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """`"tiny"` -> the cached (trained on first use) tiny BPE; `"tiny_vlm"` -> the tiny VLM processor's
    tokenizer (`qwenft.data.tiny_vlm`); anything else -> AutoTokenizer on that path.

    `vocab_size` only matters for `"tiny"`.
    """
    if path_or_name == "tiny_vlm":  # the tiny VLM's tokenizer, part of its processor dir
        from qwenft.data.tiny_vlm import tiny_vlm_processor_dir

        return AutoTokenizer.from_pretrained(tiny_vlm_processor_dir(cache_dir))
    if path_or_name != "tiny":
        path = Path(path_or_name)
        if not path.is_dir():
            raise ValueError(f"tokenizer dir {str(path)!r} does not exist; set data.tokenizer to a tokenizer "
                             f"dir, or to 'tiny'")
        if not any((path / f).exists() for f in TOKENIZER_FILES):
            raise ValueError(f"{str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); set "
                             f"data.tokenizer to a tokenizer dir (default: model.path, else 'tiny')")
        return AutoTokenizer.from_pretrained(path)
    data = TRAIN_PATH.read_bytes()
    key = json.dumps([_RECIPE_VERSION, vocab_size, SPECIAL_TOKENS, TINY_CHAT_TEMPLATE]).encode()
    digest = hashlib.sha256(key + data).hexdigest()[:16]
    rows = lambda: [json.loads(line) for line in data.decode("utf-8").splitlines()]  # noqa: E731
    out = cached_dir(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"tiny-{digest}",
                     lambda tmp: train_tiny_tokenizer(rows(), vocab_size).save_pretrained(tmp))
    return AutoTokenizer.from_pretrained(out)


def cached_dir(out: Path, write) -> Path:
    """`out`, created by `write(tmp_dir)` the first time; a private temp dir renamed into place, so ranks
    that race each build a copy and all but the first discard theirs."""
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        write(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another rank renamed first: its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def train_tiny_tokenizer(rows: list[dict], vocab_size: int = 512, special_tokens: list[str] = SPECIAL_TOKENS,
                         chat_template: str = TINY_CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the rows' role names and (string) contents, with Qwen's special tokens and template.

    `special_tokens` get ids 0, 1, ... in order and must start with `SPECIAL_TOKENS` (pad, im_start, im_end).
    """
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"tokenizer vocab_size={vocab_size} is below the {256 + len(special_tokens)} "
                         "ids needed for all bytes plus the special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = (f"{m['role']}\n{m['content']}" for row in rows for m in row["messages"])
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=IM_END,
        additional_special_tokens=[t for t in special_tokens if t not in (PAD_TOKEN, IM_END)],
        chat_template=chat_template,
    )
