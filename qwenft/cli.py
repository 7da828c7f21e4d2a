"""`qwenft` command line: dispatch a subcommand on the config that qwenft.conf composes."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

from qwenft.conf import RECIPES_ENV, ConfigError, compose, group_options, list_recipes, load_run_config, to_yaml
from qwenft.conf.layout import Layout
from qwenft.conf.schema import Config
from qwenft.launch import ERROR_PREFIX, LINE_TO_LAUNCHER, with_rank

USAGE = f"""usage: qwenft <command> [recipe=NAME] [key=value ...]

commands:
  train     train a recipe (torchrun ... qwenft train, or launcher.nproc_per_node=N to start N workers)
  show      print the resolved config of a recipe after overrides
  slurm     write an sbatch script for launcher.nodes nodes and submit it (--dry-run: print it); docs/slurm.md
  recipes   list recipes, one line each
  data      data prepare [recipe=NAME] data.path=... (or data.sources=...): tokenize into the token cache
            ahead of training and print documents, tokens and skipped rows per source; docs/data.md
  plan      per-rank GPU memory of the recipe's whole mesh, planned on this machine (--json: as JSON)
  export    {{export_usage}}
            a run's training checkpoint (any mesh) as HF safetensors + tokenizer files; a LoRA run's as a peft
            adapter dir, or with merged=true merged into the run's model.path; docs/checkpointing.md

overrides (Hydra syntax): a.b=v sets a key, group=option picks a config group option, ~a.b resets a key.
keys: `qwenft show [recipe=NAME]` prints every key with its value; docs/cli.md says what each does
config groups: {{groups}}
recipes: {{recipes}}
extra recipe dir: ${RECIPES_ENV}=DIR (YAML files in DIR become recipes; they shadow built-in ones)
docs: docs/cli.md, docs/recipes.md, docs/slurm.md
"""


def _help() -> str:
    return USAGE.format(export_usage=EXPORT_USAGE.removeprefix("qwenft export "),
                        groups="; ".join(f"{g}={{{','.join(o)}}}" for g, o in group_options().items()),
                        recipes=", ".join(list_recipes()))


def _starts_local_workers(cfg: Config, environ: Mapping[str, str]) -> bool:
    """Whether `qwenft train` starts launcher.nproc_per_node workers itself: not in a process that already is one
    rank, started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or as a task of an srun step of several tasks
    (SLURM_STEP_ID and SLURM_PROCID, which qwenft.distributed.slurm_env maps to a rank when training starts). The
    sbatch shell (no SLURM_STEP_ID) and an srun step of one task are a plain machine's process."""
    if cfg.launcher.nproc_per_node <= 1 or any(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return False
    step_tasks = environ.get("SLURM_STEP_NUM_TASKS", "1")
    return not ("SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ and step_tasks != "1")


def _local_workers_command(cfg: Config, overrides: list[str], run_dir: str) -> list[str]:
    """torch.distributed.run (qwenft's wrapper) starting launcher.nproc_per_node workers of `qwenft train` with the
    user's overrides, run_dir fixed (every worker writes to the same dir) as Hydra reads it back."""
    from qwenft.launch.overrides import hydra_value, without

    return [sys.executable, "-m", "qwenft.launch.torchrun", "--standalone",
            f"--nproc-per-node={cfg.launcher.nproc_per_node}", "-m", "qwenft", "train",
            *without(overrides, "run_dir"), f"run_dir={hydra_value(run_dir)}"]


def _launch_local_workers(cfg: Config, overrides: list[str]) -> int:
    """Plain `qwenft train launcher.nproc_per_node=N`: start N workers through torch.distributed.run."""
    from qwenft.conf.layout import resolve_layout
    from qwenft.launch import signals
    from qwenft.launch.slurm import SHUTDOWN_TIMEOUT
    from qwenft.train.rundir import default_run_dir

    nproc = cfg.launcher.nproc_per_node
    # the mesh against the workers before any starts (each would stop on it without naming the launcher key)
    resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, nproc,
                   ranks=f"launcher.nproc_per_node={nproc} starts {nproc} ranks", ep=cfg.mesh.ep, cp=cfg.mesh.cp)
    run_dir = cfg.run_dir or default_run_dir(cfg.recipe)
    cmd = _local_workers_command(cfg, overrides, run_dir)
    signals.clear_marker(Path(run_dir))
    # how long torchrun lets its workers save after it passes a SIGTERM on (its default, 30 s, is short for a
    # large model's checkpoint), as the SLURM script sets it
    env = {SHUTDOWN_TIMEOUT: str(cfg.launcher.signal_seconds), **os.environ}
    proc = subprocess.Popen(cmd, env=env, preexec_fn=signals.stop_with_parent())
    # SIGTERM/SIGUSR1 here reach the workers as SIGTERM through torchrun (it forwards SIGTERM, not SIGUSR1). A
    # terminal's Ctrl-C reaches this process and torchrun (one process group), which passes it to the workers; this
    # one waits for them (a Python handler: SIG_IGN would be handed down to torchrun and its workers).
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signal.SIGTERM)) for s in signals.SIGNALS}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    # the wrapper passes the workers' 75 and 130 on; on SIGTERM torchrun exits 1, and the marker says they stopped
    stopped = code not in (0, signals.EXIT_INTERRUPTED) and signals.preempted(Path(run_dir))
    return signals.EXIT_PREEMPTED if stopped else code


def _slurm(args: list[str]) -> int:
    """`qwenft slurm`: the checks `qwenft train` runs at its start, on the job's world size; then run_dir/slurm.sh,
    sbatch, and run_dir/config.yaml for a new run dir. --dry-run only prints the script."""
    from qwenft.launch import slurm
    from qwenft.train.rundir import default_run_dir

    overrides = [a for a in args if a != "--dry-run"]
    cfg = compose(overrides)
    layout = slurm.check(cfg, overrides)
    notes = [slurm.ignored_nproc(cfg, overrides), _check_as_train_starts(cfg, layout, overrides)]
    run_dir = str(Path(cfg.run_dir or default_run_dir(cfg.recipe)).resolve())
    script = slurm.render(cfg, overrides, run_dir, workdir=os.getcwd())
    for note in filter(None, notes):
        print(f"qwenft: note: {note}", file=sys.stderr)
    if "--dry-run" in args:
        print(script, end="")
        return 0
    for name in slurm.missing_secrets(cfg):
        print(f"qwenft: warning: launcher.env.{name} is passed by name but not set in this shell", file=sys.stderr)
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found on PATH; run qwenft slurm on a SLURM login node "
                          "(or add --dry-run to print the script)")
    # a refused submission leaves no trace: the dirs it made go, an earlier slurm.sh comes back
    made = next((d for d in reversed([Path(run_dir), *Path(run_dir).parents]) if not d.exists()), None)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    script_path = Path(run_dir) / "slurm.sh"
    before = script_path.read_text() if script_path.is_file() else None
    script_path.write_text(script)
    try:
        job_id = slurm.submit(str(script_path))
    except ValueError:
        if made is not None:
            shutil.rmtree(made)
        elif before is not None:
            script_path.write_text(before)
        else:
            script_path.unlink()
        raise
    config = Path(run_dir) / "config.yaml"
    if not config.exists():  # a run dir's own config.yaml stays as its run wrote it: the job checks and rewrites it
        config.write_text(to_yaml(cfg, run_dir=run_dir))
    print(f"submitted job {job_id}: {script_path}, log {run_dir}/slurm-{job_id}.out")
    return 0


def _check_as_train_starts(cfg: Config, layout: Layout, overrides: list[str]) -> str | None:
    """What `qwenft train` checks at its start before it builds anything (build.build_job), on the job's layout:
    the model's config, LoRA targets, the batch split, head counts and layers over the mesh, the kernels. Raises
    train's one line (with the job's ranks where the layout matters). A model.path this machine cannot read (a
    container's mount) leaves the model's checks to the job's start: the note saying so, else None."""
    from qwenft.launch.slurm import ranks
    from qwenft.train.build import check_what_trains, model_config
    from qwenft.train.spec import checked_batching, resolve_spec

    readable = not cfg.model.path or Path(cfg.model.path).exists()  # a file there: train's one line about it
    model_cfg = model_config(cfg) if readable else None
    try:  # the packages the job needs (torchao, fla) are the job's machine's (or container's), not this one's
        if model_cfg is None:
            checked_batching(cfg, layout, packages_here=False)
        else:
            check_what_trains(cfg, model_cfg, resolve_spec(cfg, layout, model_cfg,
                                                           "cuda" if cfg.launcher.gpus_per_node else "cpu",
                                                           packages_here=False))
    except ValueError as e:
        cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
        where = f"{ranks(cfg, overrides)[1]} = pp {layout.pp} x dp {layout.dp}{cp} x tp {layout.tp}"
        raise ValueError(f"{e} (the job: {where})") from e
    return None if readable else (f"model.path={cfg.model.path} is not on this machine (a container's mount?): "
                                  f"the job checks the model against the mesh when it starts")


EXPORT_USAGE = ("qwenft export run_dir=DIR out=DIR [checkpoint=latest|best|STEP_DIR] [dtype=bfloat16|float32] "
                "[tokenizer=DIR] [merged=false|true]")


def _export_checkpoint(ckpt_root: Path, value: str) -> Path:
    """checkpoint=latest|best|STEP_DIR (a path, or a step dir name under the run's checkpoints/) -> its path."""
    from qwenft.checkpoint import files

    if value in ("latest", "best"):
        name, text = files.read_pointer(ckpt_root, value), files.pointer_text(ckpt_root, value)
        if text is None:
            how = "checkpoint.keep_best=true" if value == "best" else "checkpoint.every_steps=N"
            raise ConfigError(f"checkpoint={value}: there is no {ckpt_root / value} (the run saved no such checkpoint; "
                              f"train with {how}, or give checkpoint=STEP_DIR)")
        if name is None:
            raise ConfigError(f"checkpoint={value}: {ckpt_root / value} names no step dir ({text[:40]!r}); give "
                              f"checkpoint=STEP_DIR")
        problems = files.damage(ckpt_root / name)
        if problems and not (ckpt_root / name).is_dir():  # named a moment ago: the run's rotation deleted it
            raise ConfigError(str(files.rotated_away(ckpt_root / name, problems)))
        if problems:
            raise ConfigError(f"checkpoint={value}: {ckpt_root / name} is incomplete or corrupt "
                              f"({files.summary(problems)}); give another checkpoint=STEP_DIR")
        return ckpt_root / name
    if value in ("auto", "none"):
        raise ConfigError(f"checkpoint={value} is not valid; choose latest, best or a step-NNNNNN dir")
    path = Path(value) if Path(value).is_dir() or not (ckpt_root / value).is_dir() else ckpt_root / value
    return files.find(str(path), ckpt_root, key="checkpoint", valid="latest or best")[0]


def _export(args: list[str]) -> int:
    """`qwenft export`: a run's DCP checkpoint, saved on any mesh, as an HF checkpoint written by one CPU
    process through the same writer as checkpoint.export_hf. A LoRA run's checkpoint holds only what it trained:
    its adapters are written as a peft adapter dir, or with merged=true merged into the run's base (model.path).
    Every input is checked before anything is read or written, and an existing non-empty `out` is refused."""
    import torch

    from qwenft.checkpoint import dcp, files, hf_export, mtp
    from qwenft.data.tokenizer import BUILT_IN, TOKENIZER_FILES
    from qwenft.models.lora import in_adapter_dir
    from qwenft.train.data_setup import load_preprocessors
    from qwenft.train.peft_setup import checkpoint_lora

    opts = {"run_dir": None, "out": None, "checkpoint": "latest", "dtype": None, "tokenizer": None, "merged": "false"}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in opts:
            raise ConfigError(f"export does not take {arg!r}; usage: {EXPORT_USAGE}")
        opts[key] = value
    missing = [key for key in ("run_dir", "out") if not opts[key]]
    if missing:
        raise ConfigError(f"export needs {' and '.join(f'{k}=DIR' for k in missing)}; usage: {EXPORT_USAGE}")
    run_dir, out = Path(opts["run_dir"]), Path(opts["out"])
    cfg = load_run_config(run_dir)
    dtype = opts["dtype"] or cfg.checkpoint.export_dtype
    if dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"dtype={dtype!r} is not valid; choose one of bfloat16, float32")
    if opts["merged"] not in ("false", "true"):
        raise ConfigError(f"merged={opts['merged']!r} is not valid; choose one of false, true")
    merged = opts["merged"] == "true"
    path = _export_checkpoint(run_dir / "checkpoints", opts["checkpoint"])
    if not path.is_dir():  # verified a moment ago: a live run's rotation (checkpoint.keep) has deleted it since
        raise files.rotated_away(path)
    meta = files.read_meta(path)
    saved_peft = meta.get("peft") or {"method": "none"}
    lora = checkpoint_lora(saved_peft, cfg) if saved_peft["method"] != "none" else None
    if merged and lora is None:
        raise ConfigError(f"merged=true merges a LoRA run's adapters, but {path} is a full finetuning checkpoint; "
                          f"drop merged=true")
    if merged and not (cfg.model.path and Path(cfg.model.path).is_dir()):
        raise ConfigError(f"model.path={cfg.model.path} (from {run_dir / 'config.yaml'}) "
                          f"{'does not exist' if cfg.model.path else 'is unset (the run trained a random-init base)'}"
                          f": merged=true needs the run's base model there; restore it, or export the adapters "
                          f"alone without merged=true")
    hf_export.check_out_dir(out)
    model_cfg = files.model_config_from_meta(meta)
    if lora is not None and not merged and cfg.model.mtp != "keep":
        raise ConfigError(f"{path} trained the MTP head with peft={saved_peft['method']} (model.mtp={cfg.model.mtp}), "
                          f"which a peft adapter dir cannot carry; export it with merged=true")
    if lora is not None and not merged:
        state = dcp.load_model_state(path, model_cfg, getattr(torch, dtype), lora, mtp=cfg.model.mtp)
        tied = model_cfg.tie_word_embeddings
        hf_export.write_peft_adapter({k: v for k, v in state.items() if in_adapter_dir(k, lora, tied)}, model_cfg,
                                     lora, cfg.model.path or cfg.model.name, out)
        print(f"exported the LoRA adapters of {path} ({dtype}, peft format) to {out}")
        return 0
    source, key = next(((v, k) for k, v in (("tokenizer", opts["tokenizer"]), ("data.tokenizer", cfg.data.tokenizer),
                                             ("model.path", cfg.model.path)) if v), (None, None))
    if source not in (None, *BUILT_IN) and not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        where = "" if key == "tokenizer" else f" (from {run_dir / 'config.yaml'})"
        raise ConfigError(f"{key}={source}{where} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) to export "
                          f"with the model; pass tokenizer=DIR, a dir with the run's tokenizer")
    _, _, preprocessors = load_preprocessors(cfg, model_cfg.vision is not None, source)
    head = mtp.read(run_dir)  # the source's MTP head, kept in the run dir at its start
    if merged:
        trained = dcp.load_model_state(path, model_cfg, torch.float32, lora, mtp=cfg.model.mtp)
        state = hf_export.merge_into_base(trained, model_cfg, lora, Path(cfg.model.path), cfg.seed,
                                          getattr(torch, dtype), mtp=cfg.model.mtp)
    else:
        state = dcp.load_model_state(path, model_cfg, getattr(torch, dtype), mtp=cfg.model.mtp)
    source_dir = cfg.model.path if cfg.model.path and Path(cfg.model.path).is_dir() else None
    if cfg.model.path and source_dir is None:
        print(f"note: model.path={cfg.model.path} (from {run_dir / 'config.yaml'}) does not exist; the export's "
              f"generation_config.json has the tokenizer's end ids but not the base model's sampling defaults",
              file=sys.stderr)
    hf_export.write_hf(state, model_cfg, preprocessors, out, source_dir, mtp_head=head)
    trained = sum(k.startswith(mtp.MTP_PREFIX) for k in state)
    print(f"exported {path} ({dtype}{', adapters merged into ' + cfg.model.path if merged else ''}) to {out}, "
          + (f"with the MTP head the run trained (model.mtp={cfg.model.mtp}, {trained} tensors)" if trained else
             f"with the MTP head kept from {head.source} ({len(head.tensors)} tensors)" if head else
             "without an MTP head (the run kept none: a random init, or none in its model.path)"))
    return 0


def _plan(args: list[str]) -> int:
    """`qwenft plan`: every rank's memory for the recipe's mesh, as a table (or JSON with --json; plan.json=PATH
    writes it too). Keys only `train` needs (data.path, ...) may stay unset."""
    import json

    from qwenft.train import auto_ac, plan

    cfg = compose([a for a in args if a != "--json"], missing_ok=True)
    cfg, plans, auto_note = auto_ac.planned(cfg)
    report = plan.to_json(plans, cfg)
    if auto_note:
        report["settings"]["auto"] = auto_note
    if cfg.plan.json:
        Path(cfg.plan.json).write_text(json.dumps(report, indent=1) + "\n")
    table = plan.format_table(plans, cfg) + (f"\n{auto_note}" if auto_note else "")
    print(json.dumps(report, indent=1) if "--json" in args else table)
    return 0


def _data(args: list[str]) -> int:
    """`qwenft data prepare`: the recipe's token caches, built where missing, and their numbers."""
    from qwenft.train import prepare

    if not args or args[0] != "prepare":
        raise ConfigError(f"data takes a subcommand: qwenft data prepare [recipe=NAME] data.path=... "
                          f"(got {' '.join(args[:1]) or 'none'})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    print(prepare.format_report(prepare.prepare(compose(args[1:]))))
    return 0


_joined_group = False  # set once this process has been in a torch.distributed process group


def entry() -> None:
    """The `qwenft` command (and `python -m qwenft`): `main`, then exit with its code. A process that joined a
    process group (a distributed training worker), or stops on a user fault (exit code 2) or a Ctrl-C (130) after
    importing torch.distributed, leaves at once, without the interpreter's teardown: its lines are printed,
    train.log and the metrics closed and the group destroyed by then, and the interpreter's freeing of the rest has
    aborted in gloo's C++ teardown ("terminate called without an active exception", SIGABRT) now and then under
    load, after a finished run too, which torchrun and SLURM would report as a failed one."""
    code = main()
    if _joined_group or (code in (2, 130) and "torch.distributed" in sys.modules):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    global _joined_group
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_help())
        return 0
    command, args = argv[0], argv[1:]
    if "-h" in args or "--help" in args:
        print(_help())
        return 0
    try:
        if command == "recipes":
            for name, description in list_recipes().items():
                print(f"{name:28s} {description}")
            return 0
        if command == "slurm":
            return _slurm(args)
        if command == "export":
            return _export(args)
        if command == "plan":
            return _plan(args)
        if command == "data":
            return _data(args)
        if command not in ("train", "show"):
            raise ConfigError(f"unknown command {command!r}; commands: train, show, slurm, export, plan, data, "
                              f"recipes")
        cfg = compose(args, missing_ok=command == "show")
        if command == "show":
            print(to_yaml(cfg, interpolations=False), end="")
            from omegaconf import OmegaConf

            missing = OmegaConf.missing_keys(OmegaConf.structured(cfg))
            missing = sorted(missing - {"data.path"} if cfg.data.sources else missing)  # a mixture replaces it
            if missing:
                print(f"qwenft: required before train: {', '.join(missing)}", file=sys.stderr)
            return 0
        if _starts_local_workers(cfg, os.environ):
            return _launch_local_workers(cfg, args)
        from qwenft.launch import signals
        from qwenft.train.runner import run

        import torch.distributed as dist

        try:
            result = run(cfg, command_args=args)
        finally:
            if dist.is_initialized():
                _joined_group = True
                dist.destroy_process_group()
        return signals.EXIT_PREEMPTED if result.preempted else 0
    except KeyboardInterrupt as e:  # a second Ctrl-C in training (signals.Interrupted: its line), or one before it
        from qwenft.launch.signals import EXIT_INTERRUPTED

        message = str(e) or ("stopped by Ctrl-C before training started; no checkpoint was saved"
                             if command == "train" else "stopped by Ctrl-C")
        if os.environ.get("RANK", "0") == "0":
            print(f"qwenft: {message}", file=sys.stderr)
        _log_to_file(logging.WARNING, message)
        return EXIT_INTERRUPTED
    except ValueError as e:  # ConfigError, and user mistakes found while building (mesh, data, checkpoints)
        return _fail(e, str(e))
    except OSError as e:  # a file fault not caught closer to its key: name the file
        if e.filename is None:
            _log_traceback(e)
            raise
        return _fail(e, f"{e.filename}: {e.strerror or e}; check the path and its permissions")
    except Exception as e:  # a crash: its traceback on stderr as usual, and in train.log too
        _log_traceback(e)
        raise


def _fail(e: BaseException, message: str) -> int:
    """A user-fixable fault: one line, the traceback in train.log when the run got that far; exit code 2.

    Under qwenft's torchrun (`qwenft.launch.torchrun`: launcher.nproc_per_node, SLURM) every rank writes the line
    into its torchrun error file instead, and the launcher prints the first failed rank's, once: a fault of one
    rank alone (a path missing on its node) is shown as well as one that every rank meets (a rank that cannot
    write the file prints its line itself). Under another launcher, rank 0 prints it (the ranks' lines would
    repeat it once each)."""
    line = f"{ERROR_PREFIX}{message}"
    rank = os.environ.get("RANK", "0")
    if os.environ.get(LINE_TO_LAUNCHER):
        if not _to_error_file(line):  # the launcher will not see it: this rank's own line, then
            print(with_rank(line, rank), file=sys.stderr)
    elif rank == "0":
        print(line, file=sys.stderr)
    _log_traceback(e)
    return 2


def _to_error_file(line: str) -> bool:
    """`line` into this worker's torchrun error file (the message torchrun's agent reads back), whole or not at all
    (the agent fails on a half-written one); False when there is none or it cannot be written."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    partial = Path(f"{error_file}.partial")
    try:
        partial.write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        os.replace(partial, error_file)
    except OSError:
        partial.unlink(missing_ok=True)
        return False
    return True


def _log_traceback(e: BaseException) -> None:
    """The traceback into train.log only (the console shows the one line), when this rank has train.log open."""
    _log_to_file(logging.ERROR, f"{ERROR_PREFIX}%s", e, exc_info=(type(e), e, e.__traceback__))


def _log_to_file(level: int, message: str, *args, exc_info=None) -> None:
    """A record into train.log only, when this rank has it open; then closes it (the run is over)."""
    log = logging.getLogger("qwenft")
    files = [h for h in log.handlers if isinstance(h, logging.FileHandler)]
    record = logging.LogRecord("qwenft", level, __file__, 0, message, args, exc_info)
    for handler in files:
        handler.handle(record)
        handler.close()  # the run is over; a later run in this process (tests) opens its own
        log.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
