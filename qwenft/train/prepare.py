"""`qwenft data prepare`: build a recipe's token caches ahead of training (e.g. on a login node before a
SLURM job), with the same tokenizer, settings and cache directory a `qwenft train` of it would use."""

import time
from pathlib import Path

from qwenft.conf.schema import Config


def data_sources(cfg: Config) -> list[tuple]:
    """The run's datasets as (`qwenft.data.mixture.Source`, whether it is the validation set): data.sources, else
    data.path as one source; then eval.dataset when the run validates (eval.every_steps)."""
    from qwenft.data.mixture import Source
    from qwenft.data.tiny_chat import TRAIN_PATH
    from qwenft.train.data_setup import eval_path, mixture_sources

    def named(path) -> str:
        return Path(path).stem if Path(path).suffix else Path(path).name

    if cfg.data.sources:
        sources = [(source, False) for source in mixture_sources(cfg)]
    else:
        path = str(TRAIN_PATH) if cfg.data.path == "tiny" else cfg.data.path
        sources = [(Source(named(path), path, 1.0, cfg.data.format), False)]
    if cfg.eval.every_steps and cfg.eval.dataset:
        path = str(eval_path(cfg.eval.dataset))
        sources.append((Source(f"eval.dataset {named(path)}", path, 1.0, cfg.data.format), True))
    return sources


def prepare(cfg: Config) -> list[dict]:
    """Open (building where missing) the token cache of every source; per source its numbers."""
    from qwenft.data.cache import open_cache
    from qwenft.data.loader import check_source
    from qwenft.train.build import model_config
    from qwenft.train.data_setup import as_eval_error, check_chat_template, load_preprocessors

    if model_config(cfg).vision is not None:
        raise ValueError(f"model {cfg.model.path or cfg.model.name} has a vision tower: image rows are tokenized "
                         f"in memory at the start of training, there is no token cache to prepare")
    if not cfg.data.cache:
        raise ValueError("data.cache=false: training tokenizes in memory and reads no cache; drop data.cache=false "
                         "to prepare one")
    tokenizer, _, _ = load_preprocessors(cfg, vision=False)
    check_chat_template(tokenizer, cfg)
    report = []
    for source, is_eval in data_sources(cfg):
        start = time.perf_counter()
        try:
            check_source(source.path)
            docs, built = open_cache(source.path, tokenizer, cfg.data.seq_len, cfg.data.train_on,
                                     cfg.data.truncation, source.format, cfg.data.cache_dir, cfg.data.num_proc)
            if cfg.data.on_bad_row == "error":
                docs.raise_first_bad_row()
        except ValueError as e:
            raise as_eval_error(e, cfg.eval.dataset, source.path) if is_eval else e from None
        meta = docs.meta
        if is_eval and not meta["documents"]:  # as training's start would refuse it
            raise ValueError(f"eval.dataset={cfg.eval.dataset}: no usable documents (skipped: {meta['skipped']}); "
                             f"check eval.dataset, data.seq_len and data.truncation")
        report.append({"name": source.name, "path": source.path, "format": docs.format, "eval": is_eval,
                       "cache": str(docs.directory), "built": built,
                       "seconds": round(time.perf_counter() - start, 1), "num_proc": meta["num_proc"],
                       "rows": meta["rows"], "documents": meta["documents"], "tokens": meta["tokens"],
                       "skipped": meta["skipped"]})
    return report


def format_report(report: list[dict]) -> str:
    lines = []
    for r in report:
        procs = f"{r['num_proc']} process{'es' if r['num_proc'] > 1 else ''}"
        how = f"built in {r['seconds']:.1f} s with {procs}" if r["built"] else "already built"
        skipped = ", ".join(f"{k} {v}" for k, v in r["skipped"].items()) or "none"
        lines += [f"{r['name']}: {r['path']} ({r['format']} rows)",
                  f"  cache {r['cache']} ({how})",
                  f"  {r['rows']} rows: {r['documents']} documents, {r['tokens']} tokens; skipped rows: {skipped}"]
    training = [r for r in report if not r["eval"]]
    if len(training) > 1:  # the training sources': the validation set is not trained on
        lines.append(f"total: {sum(r['documents'] for r in training)} documents, "
                     f"{sum(r['tokens'] for r in training)} tokens")
    return "\n".join(lines)
