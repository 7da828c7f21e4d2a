"""A run's data as its config names it: the tokenizer (and a VLM's processor), and the training or validation
stream: chat text from one data.path or a data.sources mixture, or chat with images and video for a model with a
vision tower. `build_job` and `qwenft data prepare` read their data through it."""

from qwenft.conf.schema import Config


def load_preprocessors(cfg: Config, vision: bool, source: str | None = None) -> tuple:
    """(tokenizer, VLM processor or None, what an HF export saves next to the weights) from `source`; default
    data.tokenizer, else model.path, else the built-in tiny tokenizer (tiny_vlm's processor for a VLM)."""
    source = source or cfg.data.tokenizer or cfg.model.path or ("tiny_vlm" if vision else "tiny")
    if vision:
        from qwenft.data.vlm import load_processor

        video = {key: getattr(cfg.data.video, key)
                 for key in ("min_pixels", "max_pixels", "fps", "min_frames", "max_frames", "max_video_bytes")}
        processor = load_processor(source, min_pixels=cfg.data.image.min_pixels, max_pixels=cfg.data.image.max_pixels,
                                   video=video)
        exported = [processor.tokenizer, processor.image_processor, processor.video_processor]
        return processor.tokenizer, processor, [p for p in exported if p is not None]
    from qwenft.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source)
    return tokenizer, None, [tokenizer]


def check_chat_template(tokenizer, cfg: Config) -> None:
    """One line when the tokenizer has no chat template, which renders every data row."""
    if tokenizer.chat_template is None:
        key, value = ("data.tokenizer", cfg.data.tokenizer) if cfg.data.tokenizer else ("model.path", cfg.model.path)
        raise ValueError(f"{key}={value!r}: its tokenizer has no chat template (chat_template.jinja, or chat_template "
                         "in tokenizer_config.json), which renders every data row; set data.tokenizer to a tokenizer "
                         "dir that has one (the instruct checkpoint's)")


def eval_path(dataset: str):
    """eval.dataset as a path: `tiny` the shipped tiny_chat_val.jsonl, `tiny_vlm` the generated tiny VLM set's
    val.jsonl (data.path=tiny_vlm names its training set), else the dataset as given."""
    if dataset == "tiny":
        from qwenft.data.tiny_chat import VAL_PATH

        return VAL_PATH
    if dataset == "tiny_vlm":
        from qwenft.data.tiny_vlm import tiny_vlm_data_dir

        return tiny_vlm_data_dir() / "val.jsonl"
    return dataset


def as_eval_error(e: ValueError, dataset: str, path) -> ValueError:
    """A data reader's error about the validation set, its key named: the reader calls the path it reads data.path
    (`data.path='<path>' ...`, `check data.path`); another message (a bad row's) gets `eval.dataset=...: ` before
    it."""
    message = str(e)
    named = message.replace(f"data.path={str(path)!r}", f"eval.dataset={str(path)!r}").replace(
        "check data.path", "check eval.dataset")
    return ValueError(named if named != message else f"eval.dataset={dataset}: {message}")


def build_data(cfg: Config, model_cfg, microbatch_size: int, dp_rank: int, dp_size: int, path=None,
               num_microbatches: int = 1):
    """(tokenizer, data stream, files to export with the model): chat text, or chat with images when the
    model has a vision tower. `path` (default data.path) lets the validation set be read the same way. A VLM
    stream's data.num_workers threads keep a step's micro batches (`num_microbatches`), and at least 2 per
    worker, made ahead."""
    from qwenft.data.tiny_chat import TRAIN_PATH

    def resolve(p: str) -> str:
        return TRAIN_PATH if p == "tiny" else p

    common = dict(seq_len=cfg.data.seq_len, micro_batch_size=microbatch_size, dp_rank=dp_rank, dp_size=dp_size,
                  seed=cfg.seed, packing=cfg.data.packing, train_on=cfg.data.train_on,
                  truncation=cfg.data.truncation, on_bad_row=cfg.data.on_bad_row)
    caching = dict(cache=cfg.data.cache, cache_dir=cfg.data.cache_dir, num_proc=cfg.data.num_proc)
    tokenizer, processor, preprocessors = load_preprocessors(cfg, model_cfg.vision is not None)
    check_chat_template(tokenizer, cfg)
    if processor is not None:
        from qwenft.data.vlm import build_vlm_data

        if cfg.data.sources:
            raise ValueError("data.sources (a mixture) is for text chat data; a model with a vision tower reads "
                             "one data.path")
        workers = cfg.data.num_workers
        data = build_vlm_data(path or resolve(cfg.data.path), processor,
                              max_image_bytes=cfg.data.image.max_image_bytes, data_format=cfg.data.format,
                              num_workers=workers, prefetch=max(2 * workers, num_microbatches), **common)
        data.cache_note = ("image rows tokenized in memory on every rank (no token cache for images); pixels made "
                           + (f"ahead by {workers} worker thread{'s' if workers > 1 else ''} (data.num_workers)"
                              if workers else "in the training loop (data.num_workers=0)"))
    elif cfg.data.sources and path is None:
        from qwenft.data.mixture import build_mixture_data

        data = build_mixture_data(mixture_sources(cfg), tokenizer, **common, **caching)  # formats: per source
    else:
        from qwenft.data.loader import build_sft_data

        data = build_sft_data(path or resolve(cfg.data.path), tokenizer, data_format=cfg.data.format, **common,
                              **caching)
    return tokenizer, data, preprocessors


def mixture_sources(cfg: Config) -> list:
    """data.sources as `qwenft.data.mixture.Source`s ("tiny" = the shipped set; format null = data.format)."""
    from qwenft.data.mixture import Source, source_names
    from qwenft.data.tiny_chat import TRAIN_PATH

    paths = [TRAIN_PATH if s.path == "tiny" else s.path for s in cfg.data.sources]
    return [Source(name, str(p), s.weight, s.format or cfg.data.format)
            for name, p, s in zip(source_names([str(p) for p in paths]), paths, cfg.data.sources)]
