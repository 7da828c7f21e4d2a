# A user mistake's one line starts with ERROR_PREFIX (qwenft.cli._fail). LINE_TO_LAUNCHER is set by qwenft's torchrun
# (qwenft.launch.torchrun) for its workers: the line then goes into the worker's torchrun error file, for the launcher
# to print once.
ERROR_PREFIX = "qwenft: error: "
LINE_TO_LAUNCHER = "QWENFT_ERROR_LINE_TO_LAUNCHER"


def with_rank(line: str, rank) -> str:
    """`line` as printed for a rank's mistake: the rank named unless it is rank 0."""
    return line if int(rank) == 0 else f"{line} (rank {rank})"
