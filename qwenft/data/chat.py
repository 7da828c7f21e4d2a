"""Chat rows -> token ids + training labels, through the tokenizer's own chat template.

Which tokens are the assistant's is found without `{% generation %}` tags (Qwen's templates have none):
the conversation is rendered to text once, and each assistant turn's span is located in that text:
it starts where the text has the whole of `render(messages[:i], add_generation_prompt=True)` (so a
template-inserted `<think>\n\n</think>\n\n` in front of the reply is learned, as the model must generate it;
the generation prompt itself is not), else after the lines of the generation prompt's header that the text
renders whole (a thinking prompt's `<think>\n` is absent from turns rendered without reasoning); it ends after
the `<|im_end|>` (or `eos_token`) that closes the reply. The text is then tokenized with offsets, in pieces cut
at each reply's start (so no token spans a prompt's end and its reply, as at inference), and a token is a target
when it starts inside a span. Working on characters, not on token-id diffs of prefixes, keeps it right when the
template renders earlier turns differently once later turns exist (Qwen3 drops reasoning from old assistant
turns).

Labels come out pre-shifted: `labels[t]` is the target for the logits at position `t`, i.e. the id of
token `t + 1` when that token is a target, else IGNORE_INDEX; a document's last position is always IGNORE_INDEX.
"""

import json
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from qwenft.constants import IGNORE_INDEX

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "last_turn", "all")
TRUNCATION = ("drop", "truncate_right")
ON_BAD_ROW = ("skip", "error")


@dataclass(frozen=True)
class UnreadableRow:
    """A source row that could not even be parsed (bad JSON, bad UTF-8); it is a bad row like any other."""
    problem: str


class BadRow(ValueError):
    """A row the pipeline cannot train on; `reason` is a short stable key used for the skip counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class Document:
    input_ids: list[int]  # or a 1-D int64 array (the token cache's documents)
    labels: list[int]  # pre-shifted, see the module docstring; an array where input_ids is one


def check_choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; expected one of {', '.join(valid)}")


def normalize_messages(row) -> list[dict]:
    """The row's messages as `[{"role", "content": str}]` (an assistant's `tool_calls` and `reasoning_content`
    kept), or BadRow saying what is wrong with it."""
    if isinstance(row, UnreadableRow):
        raise BadRow("unreadable", row.problem)
    if not isinstance(row, dict):
        raise BadRow("no_messages", f"row is a {type(row).__name__}, not an object with a 'messages' list")
    if not isinstance(row.get("messages"), list) or not row["messages"]:
        raise BadRow("no_messages", "row has no non-empty 'messages' list")
    for column in ("images", "videos"):
        if row.get(column):
            raise BadRow("image_content", f"row has {column!r} (image/video rows are not supported by the text SFT "
                                          "pipeline)")
    messages = []
    for i, message in enumerate(row["messages"]):
        if not isinstance(message, dict):
            raise BadRow("bad_role", f"message {i} is a {type(message).__name__}, not an object with 'role' and "
                                     "'content'")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRow("bad_role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is not None and not isinstance(calls, list):
            raise BadRow("bad_tool_call", f"message {i} tool_calls is {type(calls).__name__}; expected a list")
        calls = tool_calls(calls, f"message {i}") if calls else None
        content = message.get("content")
        content = _content_text("" if content is None and calls else content, i)
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow("undecodable", f"message {i} content is not valid text ({e.reason})") from None
        if not content.strip() and not calls:
            raise BadRow("empty_content", f"message {i} ({role}) has empty content")
        messages.append({"role": role, "content": content, **({"tool_calls": calls} if calls else {}),
                         **reasoning_of(message, i)})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant", "conversation has no assistant turn to learn from")
    return messages


def reasoning_of(message: dict, i: int) -> dict:
    """`{"reasoning_content": str}` of an assistant message that has one (not empty), else {}."""
    reasoning = message.get("reasoning_content") if message.get("role") == "assistant" else None
    if reasoning is not None and not isinstance(reasoning, str):
        raise BadRow("bad_content", f"message {i} reasoning_content is {type(reasoning).__name__}; expected a string")
    return {"reasoning_content": reasoning} if reasoning and reasoning.strip() else {}


def tool_calls(calls: list, where: str) -> list[dict]:
    """Tool calls as chat templates take them, `{"type": "function", "function": {"name", "arguments"}}` with
    the arguments an object (Qwen3.5's template iterates them), from that layout or a bare `{"name",
    "arguments"}`; arguments given as JSON text are parsed."""
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            raise BadRow("bad_tool_call", f"{where} has a tool call {str(call)[:60]!r}; expected "
                                          "{\"name\": str, \"arguments\": {...}}")
        out.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _content_text(content, i: int) -> str:
    """A string, or a list of `{"type": "text", "text": ...}` parts joined with no separator."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRow("bad_content", f"message {i} content is {type(content).__name__}; expected a string "
                                    "or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "image_url", "video"):
            raise BadRow("image_content", f"message {i} has a {kind} part; image/video rows are not "
                                          "supported by the text SFT pipeline")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRow("bad_content", f"message {i} has a content part {str(part)[:60]!r}; expected "
                                        "{'type': 'text', 'text': str}")
        texts.append(part["text"])
    return "".join(texts)


def row_tools(row) -> list[dict] | None:
    """The row's `tools` column (the tool schemas the template lists in the prompt): a list of objects, or JSON
    text of one; None when the row has none."""
    tools = row.get("tools") if isinstance(row, dict) else None
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRow("bad_tool_call", f"column 'tools' is not JSON ({e.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow("bad_tool_call", f"column 'tools' is {str(tools)[:60]!r}; expected a list of tool schemas "
                                      "(JSON objects)")
    return tools


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's raise_exception() in the template, e.g. "No user query found"
        raise BadRow("template", f"the chat template rejected the conversation: {e}") from None


def assistant_spans(tokenizer, messages: list[dict],
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (with `tools` listed, as the template does) and the [start, end) character
    spans of its assistant replies.

    A reply is taken as the template renders it: from where `render(messages[:i], add_generation_prompt=True)`
    stops agreeing with the full text (or, where the two disagree before the previous reply ended, after the
    generation prompt's header), to the turn-closing marker after its answer. Qwen3-style templates move `<think>`
    reasoning in the content into a block of their own, re-spaced, and drop it from turns before the last user
    query. The reply must hold the message's answer (the content after any `</think>`), tool calls and, after the
    last user query, reasoning (`_check_rendered`)."""
    text = _render(tokenizer, messages, add_generation_prompt=False, tools=tools)
    # Base Qwen checkpoints set eos_token to <|endoftext|>, yet chat turns still close with <|im_end|>.
    turn_ends = [m for m in ("<|im_end|>", tokenizer.eos_token) if m]
    last_query = last_user_query(messages)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        answer = reply_answer(message)
        if i:
            prompt = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
            shared = len(os.path.commonprefix([prompt, text]))  # where the rendering of the reply begins
            start = shared if shared == len(prompt) and cursor <= shared else _after_header(
                tokenizer, messages[:i], prompt, text, cursor, shared, i, tools)
        else:  # a conversation that opens with the assistant: there is no prompt to compare
            start = text.find(answer) if answer else -1
            if start < 0:
                raise BadRow("template", f"the chat template does not render assistant message {i} verbatim")
        at = text.find(answer, start)
        if at < 0:
            raise BadRow("template", f"the chat template does not render assistant message {i} verbatim")
        after = _past_marked_arguments(text, message, at + len(answer), turn_ends, i)
        stop = min((e for e in (text.find(m, after) for m in turn_ends) if e >= 0), default=-1)
        if stop < 0:
            raise BadRow("template", f"the chat template does not close assistant message {i} with "
                                     f"{' or '.join(turn_ends)}")
        _check_rendered(text[start:stop], message, i, after_last_query=i > last_query)
        end = stop + next(len(m) for m in turn_ends if text.startswith(m, stop))
        spans.append((start, end))
        cursor = end
    return text, spans


def _past_marked_arguments(text: str, message: dict, at: int, turn_ends: list[str], i: int) -> int:
    """Where the search for reply i's closing marker starts: `at` (after its answer), or past the last tool call
    argument that itself holds a marker (code that writes `<|im_end|>`), which would otherwise end the reply
    inside the call. The argument is found as the template renders it: verbatim (XML-style parameters) or as a
    JSON string (`tojson`); BadRow when it is neither."""
    for call in message.get("tool_calls") or []:
        arguments = call["function"].get("arguments")
        for value in arguments.values() if isinstance(arguments, dict) else [arguments]:
            raw = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            if not any(m in raw for m in turn_ends):
                continue
            found = [(f, len(form)) for form in dict.fromkeys((raw, json.dumps(raw, ensure_ascii=False)[1:-1]))
                     if (f := text.find(form, at)) >= 0]
            if not found:
                raise BadRow("template", f"a tool call argument of assistant message {i} holds a turn marker "
                                         f"({' or '.join(turn_ends)}) and the chat template renders it otherwise")
            at = min(f + n for f, n in found)
    return at


def last_user_query(messages: list[dict]) -> int:
    """The index of the last user turn that is not a tool result wrapped as one (`<tool_response>...`), as Qwen's
    templates find it; -1 without one. The replies after it are rendered with their reasoning."""
    def is_tool_result(content) -> bool:
        content = content.strip() if isinstance(content, str) else ""  # trimmed, as the templates test it
        return content.startswith("<tool_response>") and content.endswith("</tool_response>")

    return max((i for i, m in enumerate(messages) if m["role"] == "user" and not is_tool_result(m["content"])),
               default=-1)


def reply_answer(message: dict) -> str:
    """An assistant message's answer: its content after any `</think>`, stripped."""
    return message["content"].rsplit("</think>", 1)[-1].strip()


def _after_header(tokenizer, before: list[dict], prompt: str, text: str, cursor: int, shared: int, i: int,
                  tools) -> int:
    """Where reply i starts when the text does not hold its whole prompt: after the generation prompt's header (what
    `add_generation_prompt` appends: its first line, then each further line the text renders whole, such as a
    thinking template's `<think>` for the turns it renders with reasoning). Never inside a line of it: a reply that
    opens with `<tool_call>` or `<table>` agrees with `<think>` for a character or two. The header is the prompt's
    own where the text agrees with the prompt that far, else the first one past the previous reply (the prompt
    renders earlier turns otherwise, as thinking templates do with the tool turns of an earlier query)."""
    header = prompt[len(os.path.commonprefix([prompt, _render(tokenizer, before, False, tools)])):]
    lines = header.splitlines(keepends=True) or [""]
    at = len(prompt) - len(header)
    if not (cursor <= at and shared >= at + len(lines[0])):
        at = text.find(lines[0], cursor) if lines[0] else -1
        if at < 0:
            raise BadRow("template", f"the chat template does not render assistant message {i} after its "
                                     "generation prompt")
    at += len(lines[0])
    for line in lines[1:]:
        if not text.startswith(line, at):
            break
        at += len(line)
    return at


def _check_rendered(reply: str, message: dict, i: int, after_last_query: bool) -> None:
    """BadRow unless the rendered reply holds the message's tool calls and, for a turn after the last user query
    (the turns Qwen's templates render with their reasoning), its reasoning."""
    content = message["content"]
    calls = message.get("tool_calls") or []
    if not all(c["function"]["name"] in reply for c in calls):
        raise BadRow("template", f"the chat template does not render the tool calls of assistant message {i}")
    reasoning = message.get("reasoning_content")
    if reasoning is None and "</think>" in content:
        reasoning = content.rsplit("</think>", 1)[0].split("<think>")[-1]
    if after_last_query and reasoning and reasoning.strip() not in reply:
        raise BadRow("template", f"the chat template does not render the reasoning of assistant message {i} "
                                 "(reasoning_content, or <think> in its content)")


def tokenize_messages(tokenizer, messages: list[dict], train_on: str = "assistant",
                      tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is a training target (`train_on`:
    assistant = every reply, last_turn = the replies after the last user message, all = every token).

    The text is tokenized in pieces cut where each reply starts, so that no token spans a prompt's end and its
    reply's start: the prompt's tokens are those the model is given at inference, where the generation prompt is
    tokenized alone (Qwen's BPE would otherwise merge a thinking prompt's `<think>\n` newline with the `\n` of an
    empty reasoning block, a token the model never sees after its prompt)."""
    text, spans = assistant_spans(tokenizer, messages, tools)
    cuts = [0] + sorted({s for s, _ in spans} - {0}) + [len(text)]
    pieces = [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    enc = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True)
    ids = [i for piece in enc["input_ids"] for i in piece]
    if train_on == "all":
        return ids, [True] * len(ids)
    if train_on == "last_turn":
        last_query = last_user_query(messages)
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans = [span for i, span in zip(replies, spans) if i > last_query]
        if not spans:
            raise BadRow("no_last_turn", "data.train_on=last_turn: no assistant reply after the last user turn")
    starts = np.array([cut + start for cut, offsets in zip(cuts, enc["offset_mapping"]) for start, _ in offsets],
                      dtype=np.int64)
    is_target = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        is_target |= (starts >= s) & (starts < e)
    return ids, is_target.tolist()


def row_tokens(row, tokenizer, train_on: str, data_format: str) -> tuple[list[int], list[bool]]:
    """One source row, read as `data_format` (`formats.as_messages_row`), as token ids and per token whether it
    is a target; BadRow when the row cannot be trained on. The one row -> tokens step of `tokenize_rows` and of
    the token cache's shards (`cache.tokenize_shard`)."""
    from qwenft.data.formats import as_messages_row  # here: formats imports this module

    row = as_messages_row(row, data_format)
    return tokenize_messages(tokenizer, normalize_messages(row), train_on, row_tools(row))


def shift_labels(ids: list[int], is_target: list[bool]) -> list[int]:
    return [nxt if target else IGNORE_INDEX for nxt, target in zip(ids[1:], is_target[1:])] + [IGNORE_INDEX]


class SkipCounts(Counter):
    """Skipped rows per reason, and `first[reason]`: (index, message) of the first row skipped for it."""

    def __init__(self, counts=(), first: dict | None = None):
        super().__init__(counts)
        self.first = {reason: tuple(bad) for reason, bad in (first or {}).items()}

    def add(self, reason: str, index: int, detail: str) -> None:
        self[reason] += 1
        self.first.setdefault(reason, (index, detail))

    def describe(self) -> str:
        """The counts and the first skipped row of each reason, for an error that every row was skipped."""
        firsts = "; ".join(f"data row {index} ({reason}): {detail}"
                           for reason, (index, detail) in sorted(self.first.items(), key=lambda kv: kv[1][0]))
        return f"skipped: {dict(self)}" + (f"; {firsts}" if firsts else "")


def parse_rows(rows, parse, on_bad_row: str, skipped: SkipCounts):
    """Yield (index, `parse(row)`) for each row; a row whose parse raises BadRow is counted in `skipped`, or with
    `on_bad_row=error` stops the run with a one-line ValueError naming the row's index."""
    for index, row in enumerate(rows):
        try:
            yield index, parse(row)
        except BadRow as e:
            if on_bad_row == "error":
                raise ValueError(f"data row {index}: {e} (set data.on_bad_row=skip to skip such rows)") from None
            skipped.add(e.reason, index, str(e))


def tokenize_rows(rows, tokenizer, seq_len: int, train_on: str = "assistant",
                  truncation: str = "truncate_right", on_bad_row: str = "skip",
                  data_format: str = "messages") -> tuple[list[Document], SkipCounts]:
    """Documents for every usable row, read as `data_format` (`formats.as_messages_row`), and how many rows
    were skipped per reason (with the first of each).

    Skip reasons: the `BadRow.reason` keys (`unreadable`, `format`, `no_messages`, `bad_role`, `bad_content`,
    `bad_tool_call`, `image_content`, `undecodable`, `empty_content`, `no_assistant`, `template`, `no_last_turn`),
    `too_long` (dropped by `truncation=drop`) and `no_target_left` (truncation cut away every assistant token).
    With `on_bad_row=error` the first bad row raises a one-line ValueError naming its index; overlong rows
    follow `truncation`, not `on_bad_row`.
    """
    check_choice("data.train_on", train_on, TRAIN_ON)
    check_choice("data.truncation", truncation, TRUNCATION)
    check_choice("data.on_bad_row", on_bad_row, ON_BAD_ROW)
    docs, skipped = [], SkipCounts()

    def tokenize(row):
        return row_tokens(row, tokenizer, train_on, data_format)

    for index, (ids, is_target) in parse_rows(rows, tokenize, on_bad_row, skipped):
        if len(ids) > seq_len:
            if truncation == "drop":
                skipped.add("too_long", index, f"{len(ids)} tokens > data.seq_len={seq_len}")
                continue
            ids, is_target = ids[:seq_len], is_target[:seq_len]
        labels = shift_labels(ids, is_target)
        if all(label == IGNORE_INDEX for label in labels):
            skipped.add("no_target_left", index, f"truncation to data.seq_len={seq_len} left no learned token")
            continue
        docs.append(Document(ids, labels))
    return docs, skipped
