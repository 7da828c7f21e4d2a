"""The `tiny` byte-level BPE, trained on the shipped data, so `recipe=tiny` runs with no download.

It trains in < 1 s on the 400 shipped conversations the first time and is cached under a directory named by a
hash of everything that determines it (training data, vocab size, special tokens, template, this recipe's
version), so a changed input can never reuse a stale cache. Ranks that race to build it each write a private
temp directory and rename it into place; the loser discards its copy. The tiny VLM's tokenizer
(qwenft.data.tiny_vlm) is trained by the same function.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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


def tiny_tokenizer_dir(cache_dir: str | os.PathLike | None = None, vocab_size: int = 512) -> Path:
    """The `tiny` tokenizer's dir, trained on the shipped chat set the first time and cached."""
    data = TRAIN_PATH.read_bytes()
    key = json.dumps([_RECIPE_VERSION, vocab_size, SPECIAL_TOKENS, TINY_CHAT_TEMPLATE]).encode()
    digest = hashlib.sha256(key + data).hexdigest()[:16]
    rows = lambda: [json.loads(line) for line in data.decode("utf-8").splitlines()]  # noqa: E731
    return cached_dir(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"tiny-{digest}",
                      lambda tmp: train_tiny_tokenizer(rows(), vocab_size).save_pretrained(tmp))


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
