"""data.format: ShareGPT and Alpaca rows become the conversations written out by hand here (role mapping,
system column, tool calls), `auto` picks the format by the columns, and rows of another format are skipped as
`format` (or named, columns included, in error mode)."""

import json

import pytest
import torch

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import tokenize_rows
from qwenft.data.formats import as_messages_row, resolve_format
from qwenft.data.loader import build_sft_data
from qwenft.data.tokenizer import load_tokenizer

# A Qwen3-style template with tool turns: the tool schemas in a first system turn, calls as <tool_call> JSON
# after the content, tool results inside a user turn.
TOOL_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + m.content }}
{%- for call in m.tool_calls or [] %}
{{- '<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson
    + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SHAREGPT = {"system": "Answer briefly.", "conversations": [
    {"from": "human", "value": "What is 3 plus 4?"},
    {"from": "gpt", "value": "3 plus 4 is 7."},
    {"from": "human", "value": "Reverse the word cat."},
    {"from": "gpt", "value": "tac"}]}
SHAREGPT_MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7."},
    {"role": "user", "content": "Reverse the word cat."},
    {"role": "assistant", "content": "tac"}]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_ROW = {"tools": json.dumps(TOOLS), "conversations": [
    {"from": "system", "value": "You may call get_weather."},
    {"from": "human", "value": "How warm is Paris?"},
    {"from": "function_call", "value": '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'},
    {"from": "observation", "value": '{"celsius": 21}'},
    {"from": "gpt", "value": "It is 21 degrees."}]}
TOOL_MESSAGES = [
    {"role": "system", "content": "You may call get_weather."},
    {"role": "user", "content": "How warm is Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"celsius": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."}]

ALPACA = [
    ({"instruction": "Reverse the word.", "input": "cat", "output": "tac"},
     [{"role": "user", "content": "Reverse the word.\n\ncat"}, {"role": "assistant", "content": "tac"}]),
    ({"instruction": "What is 3 plus 4?", "input": "", "output": "3 plus 4 is 7.", "system": "Answer briefly."},
     [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3 plus 4?"},
      {"role": "assistant", "content": "3 plus 4 is 7."}]),
    ({"instruction": "And 2 plus 2?", "output": "2 plus 2 is 4.", "history": [["What is 3 plus 4?", "7."]]},
     [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."},
      {"role": "user", "content": "And 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 is 4."}]),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("tiny", tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory):
    tok = load_tokenizer("tiny", tmp_path_factory.mktemp("tok_tools"))
    tok.chat_template = TOOL_TEMPLATE
    return tok


def labelled_text(doc, tok) -> str:
    labels = torch.tensor(doc.labels)
    return tok.decode(labels[labels != IGNORE_INDEX])


def test_sharegpt_rows_are_their_conversations(tok):
    assert as_messages_row(SHAREGPT, "sharegpt") == {"messages": SHAREGPT_MESSAGES}
    got, skipped = tokenize_rows([SHAREGPT], tok, seq_len=256, data_format="sharegpt")
    (want,), _ = tokenize_rows([{"messages": SHAREGPT_MESSAGES}], tok, seq_len=256)
    assert not skipped and got[0] == want
    assert got[0].input_ids == tok.apply_chat_template(SHAREGPT_MESSAGES, tokenize=True)["input_ids"]
    assert labelled_text(got[0], tok) == "3 plus 4 is 7.<|im_end|>tac<|im_end|>"


def test_sharegpt_role_names():
    """Every `from` value, and the `system` column left out when the conversation has its own system turn."""
    turns = [{"from": source, "value": f"text {i}"} for i, source in enumerate(
        ("system", "human", "gpt", "user", "assistant", "observation", "tool"))]
    row = as_messages_row({"conversations": turns, "system": "ignored: a system turn is there"}, "sharegpt")
    assert [(m["role"], m["content"]) for m in row["messages"]] == [
        ("system", "text 0"), ("user", "text 1"), ("assistant", "text 2"), ("user", "text 3"),
        ("assistant", "text 4"), ("tool", "text 5"), ("tool", "text 6")]


def test_sharegpt_tool_turns_are_learned_as_the_template_renders_them(tool_tok):
    """function_call -> an assistant tool call (arguments given as JSON text become an object), observation ->
    a tool turn; the rendered call and the final answer are learned, the tool's answer is not."""
    assert as_messages_row(TOOL_ROW, "sharegpt") == {"messages": TOOL_MESSAGES, "tools": json.dumps(TOOLS)}
    (doc,), skipped = tokenize_rows([TOOL_ROW], tool_tok, seq_len=1024, data_format="sharegpt")
    assert not skipped
    assert doc.input_ids == tool_tok.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, tokenize=True)["input_ids"]
    assert "# Tools" in tool_tok.decode(doc.input_ids)  # the schemas are in the prompt, and not learned
    assert labelled_text(doc, tool_tok) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                            '</tool_call><|im_end|>It is 21 degrees.<|im_end|>')
    # a list of calls in one turn; a template without tool support is a `template` row, never a silent empty turn
    two = {"conversations": [TOOL_ROW["conversations"][1], {"from": "function_call", "value": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]}]}
    (doc,), _ = tokenize_rows([two], tool_tok, seq_len=256, data_format="sharegpt")
    assert labelled_text(doc, tool_tok).count("<tool_call>") == 2
    docs, skipped = tokenize_rows([TOOL_ROW], load_tokenizer("tiny"), seq_len=256, data_format="sharegpt")
    assert docs == [] and skipped == {"template": 1}


@pytest.mark.parametrize("case", range(len(ALPACA)))
def test_alpaca_rows_are_their_conversations(tok, case):
    row, messages = ALPACA[case]
    assert as_messages_row(row, "alpaca") == {"messages": messages}
    (got,), skipped = tokenize_rows([row], tok, seq_len=256, data_format="alpaca")
    assert not skipped
    assert got.input_ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    replies = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert labelled_text(got, tok) == replies


def test_auto_takes_the_format_of_most_rows_by_their_columns():
    alpaca = [row for row, _ in ALPACA]
    assert resolve_format([SHAREGPT, SHAREGPT, alpaca[0]], "auto") == ("sharegpt", {"sharegpt": 2, "alpaca": 1})
    assert resolve_format(alpaca, "auto")[0] == "alpaca"
    assert resolve_format([{"messages": []}, SHAREGPT, {"messages": None}], "auto")[0] == "messages"
    # a null column is an absent one (Parquet fills the columns a row lacks with nulls)
    assert resolve_format([{**SHAREGPT, "messages": None, "instruction": None}], "auto")[0] == "sharegpt"
    assert resolve_format([SHAREGPT], "alpaca")[0] == "alpaca"  # an explicit format is kept
    with pytest.raises(ValueError) as info:
        resolve_format([{"prompt": "a", "completion": "b"}], "auto")
    assert str(info.value) == (
        "data.format=auto: no row has the columns of a known format (the first row's columns: ['completion', "
        "'prompt']); messages rows have 'messages', sharegpt rows 'conversations', alpaca rows 'instruction' and "
        "'output' (docs/data.md); convert the data or set data.format")


def test_rows_of_another_format_are_skipped_as_format(tok):
    alpaca_row = ALPACA[0][0]
    rows = [SHAREGPT, alpaca_row, {"messages": SHAREGPT_MESSAGES}, SHAREGPT, [1, 2]]
    data = build_sft_data(rows, tok, seq_len=256, micro_batch_size=1)  # auto: sharegpt, 2 of 5 rows
    assert data.format == "sharegpt" and data.num_documents == 2 and data.skipped == {"format": 3}
    with pytest.raises(ValueError) as info:
        tokenize_rows(rows, tok, seq_len=256, on_bad_row="error", data_format="sharegpt")
    assert str(info.value) == ("data row 1: row has columns ['input', 'instruction', 'output'], not the "
                               "'conversations' of data.format=sharegpt (set data.on_bad_row=skip to skip such rows)")
    with pytest.raises(ValueError) as info:
        tokenize_rows([SHAREGPT], tok, seq_len=256, on_bad_row="error", data_format="alpaca")
    assert str(info.value) == ("data row 0: row has columns ['conversations', 'system'], not the 'instruction' and "
                               "'output' of data.format=alpaca (set data.on_bad_row=skip to skip such rows)")


BAD_ROWS = [
    ({"conversations": []}, "no_messages"),
    ({"conversations": [{"from": "bot", "value": "x"}, {"from": "gpt", "value": "y"}]}, "bad_role"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": 3}]}, "bad_content"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{oops"}]},
     "bad_tool_call"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": '{"arguments": {}}'}]},
     "bad_tool_call"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "no_assistant"),
    ({"instruction": "x", "input": "", "output": "y", "messages": None, "conversations": None}, "format"),
    ({**SHAREGPT, "tools": "[{oops"}, "bad_tool_call"),
    ({**SHAREGPT, "tools": '{"name": "f"}'}, "bad_tool_call"),
]


def test_bad_sharegpt_rows_are_counted(tok):
    rows = [SHAREGPT] + [row for row, _ in BAD_ROWS]
    docs, skipped = tokenize_rows(rows, tok, seq_len=256, data_format="sharegpt")
    expected = {}
    for _, reason in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    assert len(docs) == 1 and dict(skipped) == expected
    docs, skipped = tokenize_rows([{"instruction": "x", "output": 5}], tok, seq_len=256, data_format="alpaca")
    assert docs == [] and skipped == {"bad_content": 1}


@pytest.mark.distributed
@pytest.mark.slow
def test_training_on_a_sharegpt_file_logs_the_format(tmp_path):
    """The tiny set as ShareGPT JSONL with one Alpaca row among it: `qwenft train` reads it as sharegpt, says
    so in the data line, and counts the Alpaca row as `format`."""
    from distributed import run_distributed
    from helpers import tiny_overrides, train

    from qwenft.data.tiny_chat import TRAIN_PATH

    names = {"system": "system", "user": "human", "assistant": "gpt"}
    rows = [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in json.loads(line)["messages"]]}
            for line in TRAIN_PATH.read_text().splitlines()]
    rows.insert(5, ALPACA[0][0])
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    run_distributed(train, 1, tiny_overrides(run_dir, f"data.path={path}", "train.max_steps=1",
                                             "train.global_batch_size=2", "checkpoint.export_hf=false"))
    line = next(line for line in (run_dir / "train.log").read_text().splitlines() if " data: " in line
                and " packed rows " in line)  # not the token cache's "data: tokenizing ..."
    assert f"data: sharegpt rows (data.format=auto, found by their columns); {len(rows) - 1} documents," in line
    assert "skipped rows: {'format': 1}; token cache " in line, line



@pytest.mark.parametrize("system", ["", "  \n"])
def test_an_empty_system_column_is_no_system_prompt(tok, system):
    """LLaMA-Factory's ShareGPT and Alpaca files often carry `"system": ""`: the row trains as without one."""
    sharegpt = {key: value for key, value in SHAREGPT.items() if key != "system"}
    for row, fmt, messages in [({**sharegpt, "system": system}, "sharegpt", SHAREGPT_MESSAGES[1:]),
                               ({**ALPACA[0][0], "system": system}, "alpaca", ALPACA[0][1])]:
        assert as_messages_row(row, fmt) == {"messages": messages}
        docs, skipped = tokenize_rows([row], tok, seq_len=256, data_format=fmt)
        assert len(docs) == 1 and not skipped


def test_a_turn_of_the_wrong_type_is_a_bad_row_with_its_index(tok):
    rows = [{"conversations": [{"from": ["human"], "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"messages": [["user", "hi"], {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": {"a": 1}, "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            "just text"]
    formats = ["sharegpt", "messages", "messages", "messages"]
    details = ["turn 0 is from ['human']", "message 0 is a list, not an object", "message 0 has role {'a': 1}",
               "row is a str, not an object with the 'messages'"]
    for row, fmt, detail in zip(rows, formats, details):
        docs, skipped = tokenize_rows([row], tok, seq_len=256, data_format=fmt)
        assert not docs and len(skipped) == 1 and detail in skipped.describe(), skipped.describe()


def test_arrow_rows_lose_the_null_keys_arrow_gives_them(tool_tok, tmp_path):
    """Parquet and datasets dirs give every row's struct the keys of all rows, nulls where a row had none: two
    tool calls with different arguments (and two tool schemas) train as they do from JSONL."""
    import datasets
    import pyarrow
    import pyarrow.parquet

    from qwenft.data import cache as cache_lib
    from qwenft.data.loader import load_rows

    def row(name, arguments):
        schema = {"name": name, "parameters": {"type": "object", "properties": {k: {"type": "string"}
                                                                               for k in arguments}}}
        return {"tools": [schema], "messages": [
            {"role": "user", "content": f"Use {name}."},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "content": "done"}, {"role": "assistant", "content": "Done."}]}

    rows = [row("get_weather", {"city": "Paris"}), row("add", {"a": "1", "b": "2"})]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    want, _ = tokenize_rows(load_rows(jsonl), tool_tok, seq_len=1024)
    assert '"arguments": {"city": "Paris"}' in labelled_text(want[0], tool_tok)
    for path in (tmp_path / "rows.parquet", tmp_path / "ds"):
        assert load_rows(path) == rows == cache_lib.head_rows(path)
        assert [r for shard in cache_lib.plan_shards(path) for r in cache_lib.shard_rows(shard)] == rows
        got, skipped = tokenize_rows(load_rows(path), tool_tok, seq_len=1024)
        assert not skipped and got == want


def test_a_utf8_bom_is_not_part_of_the_first_row(tok, tmp_path):
    from qwenft.data import cache as cache_lib
    from qwenft.data.loader import load_rows

    rows = [SHAREGPT, {**SHAREGPT, "system": "Be terse."}]
    bom = b"\xef\xbb\xbf"
    jsonl, array = tmp_path / "bom.jsonl", tmp_path / "bom.json"
    jsonl.write_bytes(bom + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    array.write_bytes(bom + json.dumps(rows, indent=1).encode())
    for path in (jsonl, array):
        assert load_rows(path) == rows == cache_lib.head_rows(path)
        assert [r for shard in cache_lib.plan_shards(path) for r in cache_lib.shard_rows(shard)] == rows
        data = build_sft_data(path, tok, 128, 1, cache_dir=tmp_path / "cache", num_proc=1)
        assert data.num_documents == 2 and not data.skipped
