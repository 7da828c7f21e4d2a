"""Chat SFT data pipeline: masking, packing, truncation, sharding, resume, bad rows, readers, tokenizer."""

import json
import multiprocessing
import time

import pytest
import torch
from transformers import AutoTokenizer

from qwenft.constants import IGNORE_INDEX
from qwenft.data.chat import tokenize_rows
from qwenft.data.loader import FINGERPRINT_BYTES, build_sft_data, fingerprint, load_rows
from qwenft.data.tiny_chat import TRAIN_PATH, VAL_PATH
from qwenft.data.tokenizer import load_tokenizer

# An assistant turn's `content` and `reasoning`: its reasoning_content, or the <think> block opening its content.
REASONING_SPLIT = """{%- set content = m.content %}
{%- set reasoning = m.reasoning_content or '' %}
{%- if '</think>' in content %}
{%- set reasoning = reasoning or content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
"""
# Qwen3's structure (trimmed of tools): an assistant turn's reasoning is its `reasoning_content`, or the
# `<think>` block that opens its content, moved into a block of the template's own spacing; turns after the last
# user query keep it (an empty block when there is none), earlier ones are rendered without it.
QWEN_LIKE_TEMPLATE = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
""" + REASONING_SPLIT + """{%- if loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.strip() + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content.strip() + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
# The same with a generation prompt that opens the reasoning block, as thinking-by-default templates do.
THINKING_PROMPT_TEMPLATE = QWEN_LIKE_TEMPLATE.replace("""{{- '<|im_start|>assistant\\n' }}{%- endif %}""",
                                                      """{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}""")

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7."},
    {"role": "user", "content": "Reverse the word cat."},
    {"role": "assistant", "content": "tac"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer("tiny", tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def qwen_like_tok(tmp_path_factory):
    tok = load_tokenizer("tiny", tmp_path_factory.mktemp("tok_qwen"))
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


def rows_of(batch, tok):
    """Per row: the documents as decoded text, split where position_ids restart (i.e. cu_seqlens)."""
    cu = batch["cu_seqlens"].tolist()
    flat = batch["input_ids"].reshape(-1)
    return [tok.decode(flat[a:b]) for a, b in zip(cu[:-1], cu[1:])]


def labelled_text(doc_labels, tok):
    labels = torch.tensor(doc_labels)
    return tok.decode(labels[labels != IGNORE_INDEX])


def test_only_assistant_replies_and_im_end_are_labelled(tok):
    docs, skipped = tokenize_rows([{"messages": CONVERSATION}], tok, seq_len=256)
    (doc,) = docs
    assert not skipped
    # Reference ids: transformers' own apply_chat_template tokenization.
    assert doc.input_ids == tok.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
    assert labelled_text(doc.labels, tok) == "3 plus 4 is 7.<|im_end|>tac<|im_end|>"
    # Pre-shifted: a label is the next input token.
    for t, label in enumerate(doc.labels):
        if label != IGNORE_INDEX:
            assert label == doc.input_ids[t + 1]
    assert doc.labels[-1] == IGNORE_INDEX


def test_masking_with_qwen_like_template_learns_the_think_block_of_the_final_turn(qwen_like_tok):
    messages = CONVERSATION + [{"role": "user", "content": "Write 4 as a word."},
                               {"role": "assistant", "content": "four"}]
    docs, _ = tokenize_rows([{"messages": messages}], qwen_like_tok, seq_len=256)
    assert labelled_text(docs[0].labels, qwen_like_tok) == (
        "3 plus 4 is 7.<|im_end|>tac<|im_end|><think>\n\n</think>\n\nfour<|im_end|>")


THINKING = [{"role": "user", "content": "What is 3 plus 4?"},
            {"role": "assistant", "content": "<think>3 and 4 make 7.</think>7."},
            {"role": "user", "content": "And 2 plus 2?"}]


@pytest.mark.parametrize("template", ["qwen_like", "thinking_prompt"])
def test_reasoning_is_learned_as_the_template_renders_it(qwen_like_tok, template):
    """Reasoning in `reasoning_content` or as a `<think>` block in the content: the final turn is learned with
    the template's reasoning block (but for what the generation prompt already holds), an earlier turn as the
    template renders it, without; data.train_on=last_turn learns the final turn alone."""
    if template == "thinking_prompt":
        qwen_like_tok.chat_template = THINKING_PROMPT_TEMPLATE
    opened = "" if template == "thinking_prompt" else "<think>\n"
    try:
        final = {"role": "assistant", "content": "4.", "reasoning_content": "2 and 2 make 4."}
        inline = {"role": "assistant", "content": "<think>\n2 and 2 make 4.\n</think>\n\n4."}
        for last in (final, inline):
            (doc,), skipped = tokenize_rows([{"messages": THINKING + [last]}], qwen_like_tok, seq_len=256)
            assert not skipped
            assert qwen_like_tok.decode(doc.input_ids).count("7.") == 1  # the old turn's reasoning is not rendered
            assert labelled_text(doc.labels, qwen_like_tok) == (
                f"7.<|im_end|>{opened}2 and 2 make 4.\n</think>\n\n4.<|im_end|>")
            (doc,), _ = tokenize_rows([{"messages": THINKING + [last]}], qwen_like_tok, seq_len=256,
                                      train_on="last_turn")
            assert labelled_text(doc.labels, qwen_like_tok) == f"{opened}2 and 2 make 4.\n</think>\n\n4.<|im_end|>"
    finally:
        qwen_like_tok.chat_template = QWEN_LIKE_TEMPLATE


# QWEN_LIKE_TEMPLATE with tools: calls as <tool_call> JSON after the content, tool results in a user turn, and
# the last user query found past the tool results, as Qwen3's template does.
QWEN_TOOLS_TEMPLATE = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' and not m.content.startswith('<tool_response>') %}
{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}
""" + REASONING_SPLIT + """{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query %}{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}
{{- content.strip() }}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def test_tool_turns_with_reasoning_before_a_later_user_turn_are_learned_as_rendered(tmp_path):
    """Turns with tool calls and reasoning, then a later user turn: the prompt for a tool turn renders the one
    before it with reasoning (it follows that prompt's last query) while the full text renders it without; each
    call is still learned as the full text renders it, and no tool result is."""
    tok = load_tokenizer("tiny", tmp_path)
    tok.chat_template = QWEN_TOOLS_TEMPLATE

    def call(q):
        return [{"function": {"name": "search", "arguments": {"q": q}}}]

    messages = [{"role": "user", "content": "find X"},
                {"role": "assistant", "content": "", "reasoning_content": "search first", "tool_calls": call("X")},
                {"role": "tool", "content": "search: no results"},
                {"role": "assistant", "content": "<think>retry</think>", "tool_calls": call("X*")},
                {"role": "tool", "content": "found X in search"},
                {"role": "assistant", "content": "X is here.", "reasoning_content": "done"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "You're welcome."}]
    (doc,), skipped = tokenize_rows([{"messages": messages}], tok, seq_len=512)
    assert not skipped
    calls = ['\n<tool_call>\n{"name": "search", "arguments": {"q": "%s"}}\n</tool_call><|im_end|>' % q for q in ("X", "X*")]
    assert labelled_text(doc.labels, tok) == (
        f"{calls[0]}{calls[1]}X is here.<|im_end|><think>\n\n</think>\n\nYou're welcome.<|im_end|>")
    (doc,), _ = tokenize_rows([{"messages": messages[:6]}], tok, seq_len=512, train_on="last_turn")
    assert labelled_text(doc.labels, tok) == (  # after the one user query: every turn, with its reasoning
        '<think>\nsearch first\n</think>\n\n' + calls[0] + '<think>\nretry\n</think>\n\n' + calls[1]
        + "<think>\ndone\n</think>\n\nX is here.<|im_end|>")


# QWEN_TOOLS_TEMPLATE as thinking-by-default templates write it: a generation prompt that opens the reasoning
# block (`<think>\n`), and a call as XML-style text right after the header when the reply has no content.
THINKING_TOOLS_TEMPLATE = QWEN_TOOLS_TEMPLATE.replace(
    """{{- '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}""",
    """{{- ('\\n\\n' if content.strip() else '') + '<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for k, v in call.function.arguments.items() %}{{- '<parameter=' + k + '>\\n' + v + '\\n</parameter>\\n' }}{%- endfor %}
{{- '</function>\\n</tool_call>' }}""").replace("""{{- '<|im_start|>assistant\\n' }}{%- endif %}""",
                                              """{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}""")
assert THINKING_TOOLS_TEMPLATE.count("<function=") == 1 and THINKING_TOOLS_TEMPLATE.endswith("<think>\\n' }}{%- endif %}\n")


def test_earlier_replies_under_a_thinking_prompt_are_learned_from_their_first_character(tmp_path):
    """A thinking generation prompt (`<think>\\n`) with replies the template renders without reasoning (before the
    last user query): a tool turn of an earlier query, which the prompts of later replies render with reasoning,
    does not hide the replies after it, and a reply opening with `<` (a call, a table) starts at its `<`, not one
    or two characters into it where it agrees with `<think>`."""
    tok = load_tokenizer("tiny", tmp_path)
    tok.chat_template = THINKING_TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "find X"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "search", "arguments": {"q": "X"}}}]},
                {"role": "tool", "content": "found X in the drawer"},
                {"role": "assistant", "content": "X is in the drawer."},
                {"role": "user", "content": "as a table"},
                {"role": "assistant", "content": "<table>X</table>"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "You're welcome."}]
    (doc,), skipped = tokenize_rows([{"messages": messages}], tok, seq_len=512)
    assert not skipped
    assert labelled_text(doc.labels, tok) == (
        "<tool_call>\n<function=search>\n<parameter=q>\nX\n</parameter>\n</function>\n</tool_call><|im_end|>"
        "X is in the drawer.<|im_end|><table>X</table><|im_end|>\n</think>\n\nYou're welcome.<|im_end|>")


def test_the_prompt_is_tokenized_as_at_inference(tmp_path):
    """Where the tokenizer would merge the generation prompt's last characters with the reply's first (here a
    `\\n\\n` token, as Qwen's BPE has, across `<think>\\n` and an empty reasoning block's `\\n`), the prompt keeps
    the tokens it has when tokenized alone, as at inference, and the reply's first token is learned."""
    tok = load_tokenizer("tiny", tmp_path)
    tok.chat_template = THINKING_TOOLS_TEMPLATE
    tok.add_tokens(["\n\n"])
    messages = CONVERSATION[1:]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert "<think>\n\n</think>" in text and "\n\n" in tok.convert_ids_to_tokens(tok(text)["input_ids"])
    (doc,), _ = tokenize_rows([{"messages": messages}], tok, seq_len=256)
    prompt = tok(tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))["input_ids"]
    assert doc.input_ids[:len(prompt)] == prompt
    assert tok.decode(doc.input_ids[len(prompt)]) == "\n" and doc.labels[len(prompt) - 1] == doc.input_ids[len(prompt)]
    assert labelled_text(doc.labels, tok) == "3 plus 4 is 7.<|im_end|>\n</think>\n\ntac<|im_end|>"


def test_a_reply_that_writes_the_turn_marker_is_learned_whole(tok):
    reply = "Each turn ends with <|im_end|> then a newline."
    (doc,), skipped = tokenize_rows([{"messages": [{"role": "user", "content": "How do turns end?"},
                                                   {"role": "assistant", "content": reply}]}], tok, seq_len=256)
    assert not skipped and labelled_text(doc.labels, tok) == reply + "<|im_end|>"


@pytest.mark.parametrize("code", ["print('<|im_end|>')", "end = '<|im_end|>'\nprint(end)"])
def test_a_tool_call_whose_argument_writes_the_turn_marker_is_learned_whole(tmp_path, code):
    """A tool call's argument holding `<|im_end|>` (verbatim, or JSON-escaped where it has a newline): the reply
    ends at the marker after the call, not inside it."""
    tok = load_tokenizer("tiny", tmp_path)
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    call = {"function": {"name": "run", "arguments": {"code": code}}}
    messages = [{"role": "user", "content": "print the marker"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "<|im_end|>"},
                {"role": "assistant", "content": "Done."}]
    (doc,), skipped = tokenize_rows([{"messages": messages}], tok, seq_len=512)
    assert not skipped
    rendered = json.dumps({"name": "run", "arguments": {"code": code}}, ensure_ascii=False)
    empty_think = "<think>\n\n</think>\n\n"
    assert labelled_text(doc.labels, tok) == (f"{empty_think}\n<tool_call>\n{rendered}\n</tool_call><|im_end|>"
                                              f"{empty_think}Done.<|im_end|>")


def test_a_tool_result_sent_as_a_user_turn_is_no_query_with_spaces_around_it():
    """Qwen's templates trim a user turn before testing for `<tool_response>`: so does the last query's search."""
    from qwenft.data.chat import last_user_query

    messages = [{"role": "user", "content": "find X"}, {"role": "assistant", "content": "searching"},
                {"role": "user", "content": "\n<tool_response>\nX\n</tool_response> "}]
    assert last_user_query(messages) == 0


def test_last_turn_without_a_reply_after_the_last_user_turn_is_a_bad_row(tok):
    row = {"messages": CONVERSATION[:3] + [{"role": "user", "content": "Thanks."}]}
    docs, skipped = tokenize_rows([row], tok, seq_len=256, train_on="last_turn")
    assert not docs and skipped == {"no_last_turn": 1}
    with pytest.raises(ValueError, match="data row 0: data.train_on=last_turn: no assistant reply after the last "
                                         "user turn"):
        tokenize_rows([row], tok, seq_len=256, train_on="last_turn", on_bad_row="error")


def test_reasoning_the_template_drops_from_the_final_turn_is_a_bad_row(tok):
    """The tiny template has no reasoning branch: the final turn's reasoning_content would be lost."""
    row = {"messages": THINKING + [{"role": "assistant", "content": "4.", "reasoning_content": "2 and 2 make 4."}]}
    docs, skipped = tokenize_rows([row], tok, seq_len=256)
    assert not docs and skipped == {"template": 1}
    assert "reasoning of assistant message 3" in skipped.describe()
    with pytest.raises(ValueError, match="reasoning_content is int"):
        tokenize_rows([{"messages": THINKING[:1] + [{"role": "assistant", "content": "7.", "reasoning_content": 7}]}],
                      tok, seq_len=256, on_bad_row="error")


def test_im_end_is_labelled_when_eos_is_endoftext(tmp_path):
    base_like = load_tokenizer("tiny", tmp_path)
    base_like.eos_token = "<|endoftext|>"  # as in Qwen base checkpoints
    (doc,), _ = tokenize_rows([{"messages": CONVERSATION}], base_like, seq_len=256)
    assert labelled_text(doc.labels, base_like) == "3 plus 4 is 7.<|im_end|>tac<|im_end|>"


def test_train_on_all_labels_every_next_token(tok):
    (doc,), _ = tokenize_rows([{"messages": CONVERSATION}], tok, seq_len=256, train_on="all")
    assert doc.labels == doc.input_ids[1:] + [IGNORE_INDEX]


def test_content_parts_are_flattened_to_text(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 3 "}, {"type": "text", "text": "plus 4?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "3 plus 4 is 7."}]}]
    (doc,), _ = tokenize_rows([{"messages": parts}], tok, seq_len=256)
    assert doc.input_ids == tok.apply_chat_template(CONVERSATION[1:3], tokenize=True)["input_ids"]


def test_packed_rows_keep_document_boundaries(tok):
    data = build_sft_data(TRAIN_PATH, tok, seq_len=128, micro_batch_size=3)
    rows = load_rows(TRAIN_PATH)
    expected_texts = {tok.apply_chat_template(r["messages"], tokenize=False) for r in rows}
    for _ in range(5):
        batch = next(data)
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        assert ids.shape == labels.shape == pos.shape == (3, 128) and batch["cu_seqlens"].dtype == torch.int32
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == 3 * 128 and all(r * 128 in cu for r in range(3))
        flat_ids, flat_labels, flat_pos = ids.reshape(-1), labels.reshape(-1), pos.reshape(-1)
        for a, b in zip(cu[:-1], cu[1:]):
            assert flat_pos[a:b].tolist() == list(range(b - a))  # positions restart per segment
            assert flat_labels[b - 1] == IGNORE_INDEX  # nothing predicts into the next segment
            seg_labels = flat_labels[a:b - 1]
            mask = seg_labels != IGNORE_INDEX
            assert torch.equal(seg_labels[mask], flat_ids[a + 1:b][mask])
        for text in rows_of(batch, tok):
            if not text.startswith("<|endoftext|>"):
                assert text in expected_texts  # every segment is one whole conversation
            else:
                assert set(text.split("<|endoftext|>")) == {""}


def test_pad_mode_holds_one_document_per_row(tok):
    data = build_sft_data(TRAIN_PATH, tok, seq_len=64, micro_batch_size=4, packing="pad")
    batch = next(data)
    lengths = [len(data.docs[d[0]].input_ids) for d in data.epoch_rows(0)[:4]]
    expected_cu = [0]
    for r, length in enumerate(lengths):
        expected_cu += [r * 64 + length, (r + 1) * 64] if length < 64 else [(r + 1) * 64]
    assert batch["cu_seqlens"].tolist() == expected_cu
    for r, length in enumerate(lengths):
        assert (batch["input_ids"][r, length:] == tok.pad_token_id).all()
        assert (batch["labels"][r, length - 1:] == IGNORE_INDEX).all()
        assert batch["padding_mask"][r].tolist() == [t >= length for t in range(64)]  # the tail after the document
    assert 0 < batch["padding_mask"].sum() < batch["padding_mask"].numel()


def test_truncation_policies(tok):
    long_row = {"messages": CONVERSATION}
    full = tok.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
    docs, skipped = tokenize_rows([long_row], tok, seq_len=len(full) - 1, truncation="drop")
    assert docs == [] and skipped == {"too_long": 1}
    (whole,), _ = tokenize_rows([long_row], tok, seq_len=len(full))
    keep = len(full) - 3  # cuts "tac<|im_end|>\n" inside the last reply
    (doc,), skipped = tokenize_rows([long_row], tok, seq_len=keep, truncation="truncate_right")
    assert doc.input_ids == full[:keep] and not skipped
    assert doc.labels == whole.labels[:keep - 1] + [IGNORE_INDEX]
    assert labelled_text(doc.labels, tok).startswith("3 plus 4 is 7.<|im_end|>t")
    docs, skipped = tokenize_rows([long_row], tok, seq_len=10, truncation="truncate_right")
    assert docs == [] and skipped == {"no_target_left": 1}


BAD_ROWS = [
    ({"text": "hello"}, "format"),
    ({"messages": []}, "no_messages"),
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "bad_role"),
    ({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}, "bad_role"),
    ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}, "bad_content"),
    ({"messages": [{"role": "user", "content": "bad \ud800"}, {"role": "assistant", "content": "y"}]}, "undecodable"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"name": ""}]}]},
     "bad_tool_call"),
    # the tiny template has no tool branch: the call would vanish from the rendering
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"name": "f", "arguments": {}}]}]}, "template"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]},
                   {"role": "assistant", "content": "y"}]}, "image_content"),
]


def test_bad_rows_are_skipped_and_counted(tok):
    rows = [{"messages": CONVERSATION}] + [row for row, _ in BAD_ROWS]
    docs, skipped = tokenize_rows(rows, tok, seq_len=256, on_bad_row="skip")
    assert len(docs) == 1
    expected = {}
    for _, reason in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(skipped) == expected
    data = build_sft_data(rows, tok, seq_len=256, micro_batch_size=1)
    assert data.skipped == expected


def test_bad_row_error_mode_names_the_row(tok):
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION}, BAD_ROWS[2][0]]
    with pytest.raises(ValueError) as err:
        tokenize_rows(rows, tok, seq_len=256, on_bad_row="error")
    message = str(err.value)
    assert "\n" not in message and "data row 2" in message and "'robot'" in message


def test_resume_continues_exactly(tok):
    kwargs = dict(seq_len=96, micro_batch_size=4, dp_rank=1, dp_size=2, seed=7)
    reference = build_sft_data(TRAIN_PATH, tok, **kwargs)
    # Cross an epoch boundary: the tiny set packs into ~130 rows at seq_len 96, 8 rows per step.
    expected = [next(reference) for _ in range(40)]
    assert reference.epoch >= 1

    first = build_sft_data(TRAIN_PATH, tok, **kwargs)
    for _ in range(13):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialization
    resumed = build_sft_data(TRAIN_PATH, tok, **kwargs)
    resumed.load_state_dict(state)
    for want in expected[13:]:
        got = next(resumed)
        for key in want:
            assert torch.equal(got[key], want[key]), key

    with pytest.raises(ValueError, match="seed=7"):
        build_sft_data(TRAIN_PATH, tok, **{**kwargs, "seed": 8}).load_state_dict(state)


def test_batches_made_ahead_are_the_stream_and_a_save_counts_only_those_handed_out(tok):
    """`make_ahead` (the runner makes the next step's batches before it waits for the GPU): the same batches in
    the same order across an epoch boundary; the saved position is that of the batches handed out, so a resume
    from it gives the batches that were made ahead but not taken; a load or a close drops them."""
    kwargs = dict(seq_len=96, micro_batch_size=4, dp_rank=1, dp_size=2, seed=7)
    reference = build_sft_data(TRAIN_PATH, tok, **kwargs)
    expected = [next(reference) for _ in range(40)]
    ahead = build_sft_data(TRAIN_PATH, tok, **kwargs)
    got = []
    for step in range(10):  # 4 micro batches a step, the next step's made before the step's end
        got += [next(ahead) for _ in range(4)]
        ahead.make_ahead(4)
        ahead.make_ahead(4)  # already made: nothing more
        if step == 3:
            state = json.loads(json.dumps(ahead.state_dict()))
    assert ahead.epoch >= 1
    for want, have in zip(expected, got, strict=True):
        for key in want:
            assert torch.equal(have[key], want[key]), key
    handed_out = build_sft_data(TRAIN_PATH, tok, **kwargs)
    for _ in range(16):  # the 16 micro batches of steps 0-3, without those made ahead for step 4
        next(handed_out)
    assert state == handed_out.state_dict()

    resumed = build_sft_data(TRAIN_PATH, tok, **kwargs)
    resumed.make_ahead(4)  # from the start: dropped by the load below
    resumed.load_state_dict(state)
    for want in expected[16:20]:
        assert torch.equal(next(resumed)["input_ids"], want["input_ids"])
    resumed.make_ahead(4)
    resumed.close()  # made ahead from micro batch 20: dropped, and `next` makes it again
    assert torch.equal(next(resumed)["input_ids"], expected[20]["input_ids"])


def test_a_batch_that_fails_ahead_raises_when_it_is_handed_out(tok, monkeypatch):
    """An error making a batch ahead (an unreadable file, a bad image) does not end the step that made it ahead:
    `next` raises it for that batch, with the batches before it handed out, the same error and position as
    without `make_ahead`."""
    def stream(ahead: bool):
        data = build_sft_data(TRAIN_PATH, tok, seq_len=96, micro_batch_size=2, seed=1)
        make, made = data.make_batch, []
        first = data.plan(0, 0)
        third = data.plan(*data.plan(*first.after).after).start

        def failing(plan):  # the third batch fails, each time it is made
            made.append(plan.start)
            if plan.start == third:
                raise OSError("read failed")
            return make(plan)

        monkeypatch.setattr(data, "make_batch", failing)
        if ahead:
            data.make_ahead(4)  # the third fails here: two made ahead, no error
        batches = [next(data)["input_ids"] for _ in range(2)]
        with pytest.raises(OSError, match="read failed"):
            next(data)
        return batches, data.state_dict(), made

    (with_ahead, state, made), (without, want_state, _) = stream(True), stream(False)
    assert all(torch.equal(a, b) for a, b in zip(with_ahead, without, strict=True))
    assert state == want_state
    assert made[2] == made[3]  # the failed batch's plan, made ahead and then again by `next`


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_dp_ranks_split_the_dp1_stream(tok, packing):
    micro, dp, steps = 2, 3, 30
    single = build_sft_data(TRAIN_PATH, tok, 96, micro * dp, packing=packing, seed=3)
    ranks = [build_sft_data(TRAIN_PATH, tok, 96, micro, dp_rank=r, dp_size=dp, packing=packing, seed=3)
             for r in range(dp)]
    for _ in range(steps):
        want = next(single)["input_ids"]
        got = [next(data)["input_ids"] for data in ranks]
        # rank r holds global rows r, r + dp, ...
        for r in range(dp):
            assert torch.equal(got[r], want[r::dp])
    # Within an epoch the ranks' documents are disjoint and cover every document.
    rows = ranks[0].epoch_rows(0)
    per_rank = [{d for row in rows[r::dp] for d in row} for r in range(dp)]
    assert sum(map(len, per_rank)) == len(set().union(*per_rank)) == ranks[0].num_documents


def test_eval_batches_cover_the_data_once_with_equal_counts(tok):
    dp = 2
    ranks = [build_sft_data(VAL_PATH, tok, 64, 4, dp_rank=r, dp_size=dp, packing="pad") for r in range(dp)]
    batches = [list(data.eval_batches()) for data in ranks]
    assert len(batches[0]) == len(batches[1])
    labelled_rows = sum(int((b["labels"] != IGNORE_INDEX).any(dim=1).sum()) for bs in batches for b in bs)
    assert labelled_rows == ranks[0].num_documents == 40
    assert ranks[0].epoch == 0 and ranks[0].epoch_progress == 0.0


def test_readers_jsonl_parquet_and_load_from_disk(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    rows = [json.loads(line) for line in TRAIN_PATH.read_text().splitlines()[:20]]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.parquet") == rows
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    assert load_rows(tmp_path / "hf") == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hfdict"))
    assert load_rows(tmp_path / "hfdict") == rows

    broken = tmp_path / "d.jsonl"
    broken.write_bytes(b"\n".join([json.dumps(rows[0]).encode(), b"{not json", b"\xff\xfe", b""]))
    loaded = load_rows(broken)
    assert loaded[0] == rows[0] and len(loaded) == 3
    assert "line 2" in loaded[1].problem and "line 3" in loaded[2].problem

    (tmp_path / "d.csv").write_text("a,b\n")
    (tmp_path / "d.json").write_text("[{oops")
    for bad in [tmp_path / "d.csv", tmp_path / "d.json", tmp_path / "missing.jsonl", tmp_path]:
        with pytest.raises(ValueError, match=str(bad)):
            load_rows(bad)


def test_tiny_tokenizer_trains_caches_and_reloads(tmp_path):
    start = time.perf_counter()
    tok = load_tokenizer("tiny", tmp_path, vocab_size=400)
    assert time.perf_counter() - start < 30  # about a second alone: a bound for a loaded box, not a timing
    (cache,) = tmp_path.iterdir()
    assert cache.name.startswith("tiny-")
    mtime = cache.stat().st_mtime_ns
    again = load_tokenizer("tiny", tmp_path, vocab_size=400)
    assert cache.stat().st_mtime_ns == mtime and len(list(tmp_path.iterdir())) == 1  # cache hit
    load_tokenizer("tiny", tmp_path, vocab_size=300)
    assert len(list(tmp_path.iterdir())) == 2  # another vocab size is another cache entry

    reloaded = AutoTokenizer.from_pretrained(cache)
    assert len(reloaded) == len(again) == 400
    assert (reloaded.pad_token, reloaded.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert reloaded.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = reloaded.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = reloaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"] and reloaded.decode(ids) == text


def _load_tiny(cache_dir):
    return len(load_tokenizer("tiny", cache_dir))


def test_racing_ranks_build_one_tokenizer_cache(tmp_path):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        assert pool.map(_load_tiny, [tmp_path] * 4) == [512] * 4
    assert [p.name.startswith("tiny-") for p in tmp_path.iterdir()] == [True]  # no temp dirs left behind


def test_fingerprint_sees_names_sizes_and_both_ends(tmp_path):
    """A data dir's fingerprint: each file's relative name and size, and a SHA-256 of its first and last 64 KiB
    (checked against hashlib on the bytes themselves); moving the dir keeps it, an edit at either end or a
    renamed file changes it, an edit in the middle of a large file (the documented blind spot) does not."""
    import hashlib

    data = tmp_path / "a" / "set"
    (data / "part").mkdir(parents=True)
    big = bytes(range(256)) * (3 * FINGERPRINT_BYTES // 256)
    (data / "part" / "x.arrow").write_bytes(big)
    (data / "state.json").write_text("{}")
    found = fingerprint(data)
    ends = big[:FINGERPRINT_BYTES] + big[-FINGERPRINT_BYTES:]
    assert found == {"part/x.arrow": {"bytes": len(big), "ends_sha256": hashlib.sha256(ends).hexdigest()},
                     "state.json": {"bytes": 2, "ends_sha256": hashlib.sha256(b"{}").hexdigest()}}
    moved = tmp_path / "b"
    (tmp_path / "a").rename(moved)
    assert fingerprint(moved / "set") == found
    for offset, seen in ((0, True), (len(big) - 1, True), (len(big) // 2, False)):
        edited = bytearray(big)
        edited[offset] ^= 1
        (moved / "set" / "part" / "x.arrow").write_bytes(bytes(edited))
        assert (fingerprint(moved / "set") != found) == seen, offset
    (moved / "set" / "part" / "x.arrow").write_bytes(big)
    (moved / "set" / "state.json").rename(moved / "set" / "info.json")
    assert fingerprint(moved / "set").keys() == {"part/x.arrow", "info.json"}
    single = moved / "set" / "info.json"
    assert fingerprint(single) == {"info.json": found["state.json"]}
