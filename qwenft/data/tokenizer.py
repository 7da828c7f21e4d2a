"""Tokenizers: a real checkpoint's tokenizer, or a built-in one generated at first use (`tiny`: a BPE
trained on the shipped chat set, qwenft.data.tiny_tokenizer; `tiny_vlm`: the tiny VLM processor's,
qwenft.data.tiny_vlm)."""

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qwenft.data.tiny_tokenizer import tiny_tokenizer_dir

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
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir(cache_dir, vocab_size))
