"""Rows of the common SFT layouts -> `{"messages": [...]}` rows, which the chat pipeline reads (`data.format`).

    fmt, found = resolve_format(rows, "auto")   # -> ("sharegpt", {"sharegpt": 400}): the format of most rows
    row = as_messages_row(row, fmt)             # -> {"messages": [...]}, or BadRow("format", ...) naming columns

messages:  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
sharegpt:  {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}],
            "system": "..." (optional; empty = none), "tools": "[{...tool schema...}]" (optional)}
alpaca:    {"instruction": "...", "input": "..." (optional), "output": "...", "system": "..." (optional; empty = none),
            "history": [["earlier instruction", "earlier output"], ...] (optional)}

Every format may have a `tools` column (JSON text or a list of tool schemas), which the chat template lists in
the prompt (`chat.row_tools`), and `images` / `videos` columns, which the image pipeline reads (`vlm.parse_row`:
an image part without a value, or an `<image>` in a turn's text, takes the column's next entry).

A row is of a format when it has that format's columns (a column whose value is null, as Parquet writes a
column a row lacks, is absent): `messages`; `conversations`; `instruction` and `output`. ShareGPT's `from`
maps to a role: human/user -> user, gpt/assistant -> assistant, system -> system, observation/tool -> tool,
and function_call -> an assistant turn whose `tool_calls` holds the call(s) of its `value` (a JSON object
{"name", "arguments"} or a list of them), which the chat template renders as the model's own tool-call text.
"""

import json
from collections import Counter

from qwenft.data.chat import BadRow, UnreadableRow, tool_calls

FORMATS = ("auto", "messages", "sharegpt", "alpaca")
COLUMNS = {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output")}
CARRIED = ("tools", "images", "videos")  # columns a converted row keeps
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "observation": "tool", "tool": "tool", "function_call": "assistant"}


def _has(row: dict, column: str) -> bool:
    return row.get(column) is not None


def arrow_rows(rows: list) -> list:
    """Rows read from Arrow (Parquet, a datasets dir) without their null-valued keys, at every depth. Arrow
    gives every row of a table the same keys in each struct, filling the ones a row lacked with null: a tool
    call's arguments would gain every other call's keys as nulls, rendered into the text the model learns."""
    return [_without_nulls(row) for row in rows]


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def row_format(row) -> str | None:
    """The format whose columns `row` has (messages, then sharegpt, then alpaca), or None."""
    if not isinstance(row, dict):
        return None
    return next((fmt for fmt, columns in COLUMNS.items() if all(_has(row, c) for c in columns)), None)


def resolve_format(rows: list, data_format: str) -> tuple[str, Counter]:
    """The format to read `rows` as, and how many rows have each format's columns. `auto` takes the format of
    most rows (ties: messages, sharegpt, alpaca); a row of another format is later skipped as `format`."""
    if data_format not in FORMATS:
        raise ValueError(f"data.format={data_format!r} is not valid; choose one of {', '.join(FORMATS)}")
    found = Counter(fmt for fmt in map(row_format, rows) if fmt is not None)
    if data_format != "auto":
        return data_format, found
    if found:
        return max(COLUMNS, key=lambda fmt: found[fmt]), found
    first = next((row for row in rows if isinstance(row, dict)), None)
    if first is None:  # no rows, or none readable: the chat pipeline counts them and says so
        return "messages", found
    raise ValueError(f"data.format=auto: no row has the columns of a known format (the first row's columns: "
                     f"{sorted(first)}); messages rows have 'messages', sharegpt rows 'conversations', alpaca rows "
                     f"'instruction' and 'output' (docs/data.md); convert the data or set data.format")


def as_messages_row(row, data_format: str):
    """`row` as a `{"messages": [...]}` row (a messages row as it is), or BadRow("format") when it lacks the
    format's columns. An unreadable row passes through (the chat pipeline counts it as `unreadable`)."""
    if isinstance(row, UnreadableRow):
        return row
    columns = COLUMNS[data_format]
    need = " and ".join(repr(c) for c in columns)
    if not isinstance(row, dict):
        raise BadRow("format", f"row is a {type(row).__name__}, not an object with the {need} of "
                               f"data.format={data_format}")
    if not all(_has(row, c) for c in columns):
        have = sorted(c for c in row if _has(row, c))
        raise BadRow("format", f"row has columns {have}, not the {need} of data.format={data_format}")
    if data_format == "messages":
        return row
    messages = _sharegpt(row) if data_format == "sharegpt" else _alpaca(row)
    system = row.get("system")
    if isinstance(system, str) and not system.strip():  # an empty system column is no system prompt
        system = None
    if system is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages, **{c: row[c] for c in CARRIED if _has(row, c)}}


def _sharegpt(row: dict) -> list[dict]:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise BadRow("no_messages", "row has no non-empty 'conversations' list")
    messages = []
    for i, turn in enumerate(turns):
        source = turn.get("from") if isinstance(turn, dict) else None
        if not isinstance(source, str) or source not in SHAREGPT_ROLES:
            raise BadRow("bad_role", f"conversations turn {i} is from {source!r}; expected one of "
                                     f"{', '.join(SHAREGPT_ROLES)}")
        value = turn.get("value")
        if source == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(value, i)})
        else:
            messages.append({"role": SHAREGPT_ROLES[source], "content": value})
    return messages


def _tool_calls(value, i: int) -> list[dict]:
    """A function_call turn's value, `{"name", "arguments"}` or a list of them, as JSON text or as objects."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise BadRow("bad_tool_call", f"conversations turn {i} (function_call) is not JSON ({e.msg})") from None
    return tool_calls(calls if isinstance(calls, list) else [calls], f"conversations turn {i} (function_call)")


def _alpaca(row: dict) -> list[dict]:
    """History pairs, then the instruction (and `input` after a blank line, when not empty) as the user turn
    and `output` as the assistant's."""
    texts = {c: row.get(c) for c in ("instruction", "input", "output")}
    wrong = next((c for c, v in texts.items() if v is not None and not isinstance(v, str)), None)
    if wrong is not None:
        raise BadRow("bad_content", f"column {wrong!r} is {type(texts[wrong]).__name__}; expected a string")
    history = row.get("history") or []
    if not isinstance(history, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in history):
        raise BadRow("bad_content", "column 'history' is not a list of [instruction, output] pairs")
    messages = [{"role": role, "content": text} for pair in history
                for role, text in zip(("user", "assistant"), pair)]
    prompt = texts["instruction"]
    if texts["input"] and texts["input"].strip():
        prompt += "\n\n" + texts["input"]
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": texts["output"]}]
