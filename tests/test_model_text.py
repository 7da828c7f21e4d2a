"""Native Qwen3.5 text decoder vs transformers' Qwen3_5ForCausalLM (fp32, CPU, identical weights)."""

import dataclasses

import pytest
import torch

from helpers import assert_near_reference, make_hf_model, rel_err
from qwenft.models.loader import build_model, init_random_weights, load_hf_weights
from qwenft.models.qwen3_5 import adapter
from qwenft.models.qwen3_5.configs import FULL_ATTENTION, LINEAR_ATTENTION, named_config, to_hf_config


def with_text(cfg, **kw):
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, **kw))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_grads_match_transformers(tmp_path, tied):
    cfg = dataclasses.replace(named_config("tiny"), tie_word_embeddings=tied)
    hf = make_hf_model(cfg)
    hf.save_pretrained(tmp_path)
    model = load_hf_weights(build_model(cfg, kernels="torch"), tmp_path, device="cpu")
    exact = load_hf_weights(build_model(cfg, kernels="torch"), tmp_path, device="cpu", dtype=torch.float64)

    ids = torch.randint(0, cfg.text.vocab_size, (2, 80))  # 80 > GDN chunk of 64
    labels = torch.randint(0, cfg.text.vocab_size, (2, 80))
    ref = hf(input_ids=ids).logits
    out, out64 = model(input_ids=ids), exact(input_ids=ids)
    assert_near_reference(out, ref, out64, "logits")
    for logits in (ref, out, out64):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()

    mapped, mapped64 = (adapter.to_hf_state_dict({n: p.grad for n, p in m.named_parameters()}, cfg.text, tied=tied)
                        for m in (model, exact))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(mapped) == set(hf_grads)
    for name, g in hf_grads.items():
        assert_near_reference(mapped[name], g, mapped64[name], name)


def test_mrope_positions_match_transformers(tmp_path):
    # head_dim 32 -> 4 rotary frequencies, so every M-RoPE section (t, h, w) is non-empty
    cfg = with_text(named_config("tiny"), head_dim=32, mrope_section=[2, 1, 1])
    hf = make_hf_model(cfg)
    hf.save_pretrained(tmp_path)
    model = load_hf_weights(build_model(cfg, kernels="torch"), tmp_path, device="cpu")
    ids = torch.randint(0, cfg.text.vocab_size, (2, 24))
    pos = torch.stack([torch.arange(24).expand(2, 24), torch.arange(24).flip(0).expand(2, 24) * 3,
                       (torch.arange(24) % 5).expand(2, 24)])
    ref = hf(input_ids=ids, position_ids=pos).logits
    assert rel_err(model(input_ids=ids, position_ids=pos), ref) < 1e-5
    # plain [B, T] positions broadcast to all three sections
    ref2 = hf(input_ids=ids, position_ids=pos[1]).logits
    assert rel_err(model(input_ids=ids, position_ids=pos[1]), ref2) < 1e-5


KINDS = {
    "mixed": None,
    "gdn_only": [LINEAR_ATTENTION] * 2,
    "attention_only": [FULL_ATTENTION] * 2,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_documents_equal_separate_forwards(kind):
    """In fp64 (norms and the torch GDN path compute in fp64 when given fp64), so the check is tight."""
    cfg = named_config("tiny")
    if KINDS[kind] is not None:
        cfg = with_text(cfg, num_hidden_layers=2, layer_types=KINDS[kind])
    model = init_random_weights(build_model(cfg, kernels="torch"), seed=1, device="cpu", dtype=torch.float64)
    lengths = [70, 13, 45]  # the first crosses a GDN chunk boundary
    T = sum(lengths)
    ids = torch.randint(0, cfg.text.vocab_size, (1, T))
    cu = torch.tensor([0, 70, 83, 128], dtype=torch.int32)
    probe = torch.randn(1, T, cfg.text.vocab_size, dtype=torch.float64)

    packed = model(input_ids=ids, cu_seqlens=cu)
    (packed * probe).sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    pieces = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out = model(input_ids=ids[:, s:e])
        (out * probe[:, s:e]).sum().backward()
        pieces.append(out)
    assert rel_err(packed, torch.cat(pieces, dim=1)) < 1e-9
    for n, p in model.named_parameters():
        assert rel_err(grads_packed[n], p.grad) < 1e-9, n


def test_packed_rows_of_a_micro_batch():
    """cu_seqlens indexes the flattened B*T tokens: two rows, two documents each."""
    cfg = named_config("tiny")
    model = init_random_weights(build_model(cfg, kernels="torch"), seed=2, device="cpu")
    ids = torch.randint(0, cfg.text.vocab_size, (2, 40))
    cu = torch.tensor([0, 25, 40, 52, 80], dtype=torch.int32)
    packed = model(input_ids=ids, cu_seqlens=cu).flatten(0, 1)
    flat = ids.flatten()
    separate = torch.cat([model(input_ids=flat[None, s:e])[0] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert rel_err(packed, separate) < 1e-5


def test_pipeline_stages_compose_to_the_full_model():
    cfg = named_config("tiny")
    full = init_random_weights(build_model(cfg, kernels="torch"), seed=3, device="cpu")
    first = init_random_weights(build_model(cfg, kernels="torch", layer_ids=[0, 1], head=False), seed=3, device="cpu")
    last = init_random_weights(build_model(cfg, kernels="torch", layer_ids=[2, 3], embed=False), seed=3, device="cpu")
    assert list(last.layers) == ["2", "3"] and last.layers["3"].layer_type == FULL_ATTENTION
    ids = torch.randint(0, cfg.text.vocab_size, (2, 16))
    staged = last(hidden_states=first(input_ids=ids))
    assert torch.equal(staged, full(input_ids=ids))


def test_inputs_embeds_replace_the_lookup():
    cfg = named_config("tiny")
    model = init_random_weights(build_model(cfg, kernels="torch"), seed=4, device="cpu")
    ids = torch.randint(0, cfg.text.vocab_size, (1, 12))
    assert torch.equal(model(inputs_embeds=model.embed_tokens(ids)), model(input_ids=ids))


# (full-attention layers, q heads, kv heads, GDN key heads, GDN value heads, hidden, tied), from the released
# config.json of each size (see docs/models.md)
RELEASED_SIZES = {
    "0.8b": (6, 8, 2, 16, 16, 1024, True),
    "2b": (6, 8, 2, 16, 16, 2048, True),
    "4b": (8, 16, 4, 16, 32, 2560, True),
    "9b": (8, 16, 4, 16, 32, 4096, False),
    "27b": (16, 24, 4, 16, 48, 5120, False),
}


@pytest.mark.parametrize("size", sorted(RELEASED_SIZES))
def test_named_sizes_build_the_released_transformers_config(size):
    full, q, kv, gdn_k, gdn_v, hidden, tied = RELEASED_SIZES[size]
    hf = to_hf_config(named_config(size))  # config only: no weights are built
    assert hf.layer_types.count(FULL_ATTENTION) == full
    assert all(t == FULL_ATTENTION for t in hf.layer_types[3::4]) and hf.layer_types.count(LINEAR_ATTENTION) == 3 * full
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (q, kv, 256)
    assert (hf.linear_num_key_heads, hf.linear_num_value_heads) == (gdn_k, gdn_v)
    assert (hf.hidden_size, hf.vocab_size, hf.tie_word_embeddings) == (hidden, 248320, tied)


def test_a_config_json_without_a_key_reads_as_transformers_reads_it(tmp_path):
    """A config.json that leaves out rope_theta (or sets the top-level tie_word_embeddings of a VLM alone) gets
    transformers' values, not the named sizes'; a hidden_act other than SiLU, which every MLP and GatedDeltaNet's conv
    compute here, is refused in one line."""
    import json

    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5TextConfig

    from qwenft.models.qwen3_5.configs import config_from_hf_dir

    def written(config, name, edit):
        config.save_pretrained(tmp_path / name)
        path = tmp_path / name / "config.json"
        d = json.loads(path.read_text())
        edit(d)
        path.write_text(json.dumps(d))
        return tmp_path / name

    text = Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, vocab_size=128)
    no_theta = written(text, "no_theta", lambda d: d.get("rope_parameters", {}).pop("rope_theta", None))
    theirs = AutoConfig.from_pretrained(no_theta).rope_parameters["rope_theta"]
    assert config_from_hf_dir(no_theta).text.rope_theta == theirs == 10_000.0

    vlm = Qwen3_5Config(text_config={"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 128,
                                     "tie_word_embeddings": True})
    untied = written(vlm, "vlm", lambda d: d.pop("tie_word_embeddings", None))
    assert config_from_hf_dir(untied).tie_word_embeddings is AutoConfig.from_pretrained(untied).tie_word_embeddings

    gelu = written(text, "gelu", lambda d: d.update(hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(ValueError, match="^config.json hidden_act 'gelu_pytorch_tanh' is not supported; valid: "
                                         "'silu'$"):
        config_from_hf_dir(gelu)


def test_attention_kernel_choice():
    from qwenft.models.qwen3_5.attention import resolve_attention_kernel

    cpu = torch.device("cpu")
    assert resolve_attention_kernel("auto", True, cpu) == "sdpa"  # flash varlen is CUDA-only
    assert resolve_attention_kernel("sdpa", True, cpu) == "sdpa"
    with pytest.raises(ValueError, match="model.kernels.attention=flash_varlen needs CUDA"):
        resolve_attention_kernel("flash_varlen", True, cpu)
    cuda = torch.device("cuda")  # a device object only: the choice, not a kernel, is tested
    assert resolve_attention_kernel("auto", True, cuda, torch.bfloat16) == "flash_varlen"
    assert resolve_attention_kernel("auto", False, cuda, torch.bfloat16) == "sdpa"  # unpacked: SDPA's causal
    assert resolve_attention_kernel("auto", True, cuda, torch.float32) == "sdpa"  # flash takes no fp32
    with pytest.raises(ValueError, match="bf16/fp16 compute .*torch.float32"):
        resolve_attention_kernel("flash_varlen", True, cuda, torch.float32)
    with pytest.raises(ValueError, match="model.kernels.attention='bogus'; valid"):
        resolve_attention_kernel("bogus", True, cpu)
    with pytest.raises(ValueError, match="model.kernels.attention=cudnn needs CUDA with cuDNN and bf16/fp16"):
        resolve_attention_kernel("cudnn", True, cpu)


def test_auto_takes_cudnn_for_long_documents(monkeypatch):
    """auto: cuDNN by pieces where a call's documents average LONG_PIECES queries or more (empty documents of a
    fixed layout not counted), the varlen flash kernel below that, and neither without cuDNN or in fp32."""
    from qwenft.models.qwen3_5 import attention
    from qwenft.models.qwen3_5.attention import LONG_PIECES, mean_piece, resolve_attention_kernel

    cuda = torch.device("cuda")  # a device object only: the choice, not a kernel, is tested
    monkeypatch.setattr(attention, "_varlen_attn", lambda: object())
    monkeypatch.setattr(attention, "cudnn_ok", lambda device, dtype: device.type == "cuda" and dtype == torch.bfloat16)
    assert mean_piece([0, 4096, 8192, 8192, 8192]) == 4096
    assert resolve_attention_kernel("auto", True, cuda, torch.bfloat16, LONG_PIECES) == "cudnn"
    assert resolve_attention_kernel("auto", True, cuda, torch.bfloat16, LONG_PIECES - 1) == "flash_varlen"
    assert resolve_attention_kernel("auto", True, cuda, torch.bfloat16) == "flash_varlen"  # at start: unknown rows
    assert resolve_attention_kernel("flash_varlen", True, cuda, torch.bfloat16, 10**6) == "flash_varlen"
    assert resolve_attention_kernel("cudnn", True, cuda, torch.bfloat16, 1) == "cudnn"
    assert resolve_attention_kernel("auto", True, cuda, torch.float16, 10**6) == "flash_varlen"  # no cuDNN here
    assert resolve_attention_kernel("auto", True, cuda, torch.float32, 10**6) == "sdpa"


def test_offsets_put_on_the_device_keep_their_host_copy():
    """`device_batch` hands the model cu_seqlens whose host copy the kernels' `varlen_info` already knows: it
    finds the entry `device_batch` registered and never copies them back (on a GPU that copy waits for every
    queued kernel), however many batches were registered after it. The host copy is int64 on the CPU. The record
    holds copies, not the tensor: once the batch is dropped it is freed at once, with no garbage collection (a
    reference cycle would wait for Python's full collections, holding the offsets' GPU memory)."""
    import gc
    import weakref

    from qwenft.models.qwen3_5 import varlen
    from qwenft.train.evaluate import device_batch

    for dtype in (torch.int32, torch.long):
        mb = {"input_ids": torch.arange(12).view(1, 12), "labels": torch.arange(12).view(1, 12),
              "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]),
              "cu_seqlens": torch.tensor([0, 5, 8, 12], dtype=dtype), "padding_mask": torch.zeros(1, 12, dtype=bool)}
        mb["padding_mask"][0, 8:] = True  # a tail of 4 tokens after an offset: no cut
        moved = device_batch(mb, torch.device("cpu"))
        registered = varlen.varlen_info(moved["cu_seqlens"])
        for _ in range(40):
            varlen.to_device(torch.tensor([0, 3]), torch.device("cpu"))
        info = varlen.varlen_info(moved["cu_seqlens"])
        assert info is registered
        assert info.cu_seqlens_cpu.device.type == "cpu" and info.cu_seqlens_cpu.dtype == torch.long
        assert info.cu_seqlens_cpu.tolist() == [0, 5, 8, 12] and info.max_len == 5
        assert info.cu_seqlens.dtype == torch.long and info.recurrent is info
        gone = weakref.ref(info)
        gc.disable()
        try:
            del mb, moved, registered, info
            assert gone() is None
        finally:
            gc.enable()


def test_padding_tails_reach_the_recurrent_layers_in_pieces():
    """`varlen.padding_pieces`: each row's padding tail (its last run of true) cut where it starts and every 64
    tokens after that, the documents' offsets kept; nothing to cut (no padding, or a tail of one block starting at
    an offset) gives None, and `recurrent` is then the batch's own Varlen."""
    from qwenft.models.qwen3_5 import varlen

    cu = torch.tensor([0, 50, 120, 200, 330, 400])
    padding = torch.zeros(2, 200, dtype=torch.bool)
    padding[0, 120:] = True  # 80 tokens: a cut 64 tokens in
    padding[1, 130:] = True  # 70 tokens, after a document of 130 tokens that ends at 330
    assert varlen.padding_pieces(cu, padding).tolist() == [0, 50, 120, 184, 200, 330, 394, 400]
    padding[1, 130:180] = False  # a tail inside a segment (the loader makes none): cut where it starts
    assert varlen.padding_pieces(cu, padding).tolist() == [0, 50, 120, 184, 200, 330, 380, 400]
    padding[1, 10:20] = True  # true before a document's token: not the tail, never cut
    assert varlen.padding_pieces(cu, padding).tolist() == [0, 50, 120, 184, 200, 330, 380, 400]
    assert varlen.padding_pieces(cu, torch.zeros(2, 200, dtype=torch.bool)) is None
    one_block = torch.zeros(2, 200, dtype=torch.bool)
    one_block[0, 136:] = True  # 64 tokens from an offset: one block already
    assert varlen.padding_pieces(torch.tensor([0, 50, 136, 200, 330, 400]), one_block) is None
    with pytest.raises(ValueError, match="padding of 2x100 tokens for offsets of 400"):
        varlen.padding_pieces(cu, torch.zeros(2, 100, dtype=torch.bool))

    moved = varlen.to_device(cu.to(torch.int32), torch.device("cpu"), padding)
    pieces = varlen.recurrent_offsets(moved)
    assert pieces.tolist() == [0, 50, 120, 184, 200, 330, 380, 400]
    assert varlen.varlen_info(pieces) is varlen.varlen_info(moved).recurrent  # registered: no copy back
    plain = varlen.to_device(cu.to(torch.int32), torch.device("cpu"))
    assert varlen.recurrent_offsets(plain) is plain


@pytest.mark.parametrize("kind", ["mixed", "gdn_only"])
def test_padding_tails_in_pieces_change_no_loss_or_gradient(kind, monkeypatch):
    """The tiny model in fp64 on two packed rows ending in padding tails of 150 and 90 tokens, moved by
    `device_batch` with and without the rows' `padding_mask`: the GatedDeltaNet layers take the tails in 64-token
    pieces when told the padding (their offsets are recorded), and the loss over the labelled tokens and every
    parameter's gradient are the same to fp64's rounding: the tails' tokens feed no labelled token."""
    import qwenft.models.qwen3_5.gdn as gdn
    from qwenft.constants import IGNORE_INDEX
    from qwenft.data.packing import cu_seqlens_from_position_ids
    from qwenft.train.evaluate import device_batch

    cfg = named_config("tiny")
    if KINDS[kind] is not None:
        cfg = with_text(cfg, num_hidden_layers=2, layer_types=KINDS[kind])
    model = init_random_weights(build_model(cfg, kernels="torch"), seed=3, device="cpu", dtype=torch.float64)
    T, docs, tails = 300, [[70, 80], [45, 100, 65]], [150, 90]
    positions = torch.cat([torch.cat([torch.arange(n) for n in row + [tail]])[None] for row, tail in zip(docs, tails)])
    ids = torch.randint(0, cfg.text.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    padding = torch.arange(T) >= T - torch.tensor(tails)[:, None]
    labels = torch.where(padding, IGNORE_INDEX, ids.roll(-1, dims=1))
    mb = {"input_ids": ids, "labels": labels, "position_ids": positions,
          "cu_seqlens": cu_seqlens_from_position_ids(positions), "padding_mask": padding}
    seen = []
    torch_kernels = gdn.GatedDeltaNet._torch_kernels
    monkeypatch.setattr(gdn.GatedDeltaNet, "_torch_kernels",
                        lambda self, *a: seen.append(a[-1].tolist()) or torch_kernels(self, *a))
    results = []
    for told in (True, False):
        model.zero_grad()
        # a fresh offsets tensor each time: on the CPU `device_batch` hands on the host one, which holds its Varlen
        fresh = {**mb, "cu_seqlens": mb["cu_seqlens"].clone()}
        batch = device_batch({k: v for k, v in fresh.items() if told or k != "padding_mask"}, torch.device("cpu"))
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     cu_seqlens=batch["cu_seqlens"], labels=batch["labels"])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert seen[0] == [0, 70, 150, 214, 278, 300, 345, 445, 510, 574, 600]
    assert seen[-1] == [0, 70, 150, 300, 345, 445, 510, 600]
    (loss, grads), (ref_loss, ref_grads) = results
    assert rel_err(loss, ref_loss) < 1e-12
    for n, g in grads.items():
        assert rel_err(g, ref_grads[n]) < 1e-12, n


def test_chunk_indices_label_every_block_of_every_document():
    """The chunk indices handed to fla's kernels: (document, block within it) for every 64-token block of every
    document, empty documents included (they have none), against a loop over the documents."""
    from qwenft.models.qwen3_5 import varlen

    bounds = [0, 1, 64, 64, 65, 200, 329, 4096]  # a 1-token, a 63, an empty, a 1, a 135, a 129, a 3767 document
    info = varlen.varlen_info(torch.tensor(bounds, dtype=torch.int32))
    expected = [(d, j) for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])) for j in range(-(-(e - s) // 64))]
    assert info.chunk_indices.dtype == torch.long
    assert [tuple(r) for r in info.chunk_indices.tolist()] == expected


def _random_bounds(gen: torch.Generator, total: int, docs: int) -> list[int]:
    cuts = torch.randperm(total - 1, generator=gen)[: docs - 1].add(1).sort().values.tolist()
    return [0, *cuts, total]


def test_fixed_layouts_have_one_shape_per_bucket_and_block_count():
    """`fixed_layout`, which CUDA graphs of fla's kernels run on: for any documents of a stream, the offsets and
    the chunk indices have lengths fixed by the stream's length, the document bucket (1, 2, 4, ... 64, 128,
    192, ...: the batch's own, or any larger one) and the block count (the default: the documents' blocks and
    one more, rounded up to BLOCK_STEP, or the most the bucket's documents can take and one more where that is
    fewer; any from one to PAD_TOKENS more than theirs), the real documents come
    first unchanged, every pad document fits one 64-token block, and the chunk indices are those of the padded
    offsets. Worst cases included: one document, every document of one token, every document one token past a
    block, a stream length off the block size. A bucket smaller than the document count, and a block count
    the pad tokens cannot reach, are refused."""
    from qwenft.models.qwen3_5.varlen import (BLOCK_STEP, FLA_CHUNK, PAD_TOKENS, chunk_indices, count_blocks,
                                              doc_bucket, fixed_layout)

    assert [doc_bucket(n) for n in (1, 2, 3, 5, 64, 65, 129)] == [1, 2, 4, 8, 64, 128, 192]
    gen = torch.Generator().manual_seed(0)
    cases = [(4096, [0, 4096]), (4096, list(range(0, 64)) + [4096]), (4096, list(range(0, 65 * 63, 65)) + [4096]),
             (4000, list(range(0, 65 * 61, 65)) + [4000]),
             *((4096, _random_bounds(gen, 4096, int(n))) for n in torch.randint(1, 200, (60,), generator=gen))]
    shapes = {}
    for total, bounds in cases:
        docs, real = len(bounds) - 1, count_blocks(torch.tensor(bounds))
        assert real <= -(-total // FLA_CHUNK) + docs - 1  # each document adds at most one partial block
        default = min(-(-(real + 1) // BLOCK_STEP) * BLOCK_STEP, -(-total // FLA_CHUNK) + doc_bucket(docs))
        for bucket, blocks in ((None, None), (doc_bucket(docs) * 2, real + 1), (192, real + PAD_TOKENS),
                               (None, default + BLOCK_STEP)):
            if bucket is not None and bucket < docs:
                continue
            layout = fixed_layout(torch.tensor(bounds, dtype=torch.int32), bucket, blocks)
            assert layout.bucket == (bucket or doc_bucket(docs)) and layout.blocks == (blocks or default)
            assert layout.cu_seqlens[: docs + 1].tolist() == bounds and layout.cu_seqlens[-1] == layout.tokens
            assert layout.tokens == total + layout.pad
            pads = layout.cu_seqlens[docs:].diff()
            assert (pads >= 0).all() and (pads <= FLA_CHUNK).all()
            assert torch.equal(layout.chunk_indices, chunk_indices(layout.cu_seqlens))
            assert len(layout.chunk_indices) == layout.blocks
            shape = (len(layout.cu_seqlens), len(layout.chunk_indices), layout.tokens)
            assert shapes.setdefault((total, layout.bucket, layout.blocks), shape) == shape, (bounds, shape)
    assert len(shapes) > 8
    # one document of the whole stream: one pad block, as many as its bucket's worst case needs
    assert fixed_layout(torch.tensor([0, 4096])).blocks == 65
    with pytest.raises(ValueError, match="a layout for 4 documents cannot hold 5"):
        fixed_layout(torch.tensor([0, 1, 2, 3, 4, 10]), 4)
    for blocks in (5, 5 + PAD_TOKENS + 1):  # 5 documents of one block each: 6 to 5 + PAD_TOKENS blocks fit
        with pytest.raises(ValueError, match=f"a layout of {blocks} blocks cannot hold documents of 5 blocks"):
            fixed_layout(torch.tensor([0, 1, 2, 3, 4, 10]), 8, blocks)


@pytest.mark.parametrize("most_pad", [False, True], ids=["default", "most_pad"])
def test_a_fixed_layout_leaves_the_real_tokens_alone(most_pad):
    """The GatedDeltaNet kernels (the torch reference: conv, decay, delta rule) on a batch's fixed layout, pad
    rows of zeros appended, give the real tokens the output and input gradients they get on the batch itself:
    on a new layout of the batch's own, and on the most pad blocks a layout adds (PAD_TOKENS, every pad
    document but one of a single token, in a larger bucket)."""
    from qwenft.models.qwen3_5.gdn import GatedDeltaNet
    from qwenft.models.qwen3_5.varlen import PAD_TOKENS, count_blocks, fixed_layout

    torch.manual_seed(0)
    layer = GatedDeltaNet(named_config("tiny").text, "torch").double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    bounds = [0, 1, 70, 130, 200, 256]
    blocks = count_blocks(torch.tensor(bounds)) + PAD_TOKENS if most_pad else None
    layout = fixed_layout(torch.tensor(bounds), 16 if most_pad else None, blocks)
    x = torch.randn(1, 256, layer.q_proj.in_features, dtype=torch.float64)
    qkv, _, beta, a = layer.project(x)
    g = layer.decay(a)
    weight = torch.cat([layer.conv_q, layer.conv_k, layer.conv_v])
    sizes = (layer.conv_q.shape[0], layer.conv_k.shape[0], layer.conv_v.shape[0])
    inputs = [t.detach().requires_grad_() for t in (qkv, beta, g)]
    padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, layout.pad)).detach().requires_grad_()
              for t in inputs]
    probe = torch.randn(1, 256, *layer._torch_kernels(*inputs, weight, sizes, torch.tensor(bounds)).shape[2:],
                        dtype=torch.float64)
    results = []
    for args, cu in ((inputs, torch.tensor(bounds)), (padded, layout.cu_seqlens)):
        out = layer._torch_kernels(*args, weight, sizes, cu)[:, :256]
        grads = torch.autograd.grad((out * probe).sum(), [*args, weight])
        results.append((out, [t[:, :256] for t in grads[:3]] + [grads[3]]))
    (ref, ref_grads), (out, grads) = results
    assert rel_err(out, ref) < 1e-12
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-12


def test_each_batch_takes_the_smallest_layout_in_use_that_holds_it():
    """The layout buffers fla's CUDA graphs read (`gdn_graph._load_layout`): a batch takes the layout in use for
    its stream length with the fewest blocks (then documents) that holds its documents and blocks, else a new one
    of its own (so a new pair of graphs is made only when none fits); each layout keeps its buffers (the graphs'
    addresses) and gets each new batch's layout copied in, once per batch."""
    from qwenft.models.qwen3_5 import gdn_graph
    from qwenft.models.qwen3_5.varlen import fixed_layout, varlen_info

    gdn_graph._LAYOUTS.clear()
    cpu = torch.device("cpu")
    seen = {}
    # documents of 3 tokens and a last one up to 512 (8 blocks' worth): (documents, the layout's bucket and
    # blocks); the blocks in the comments are the documents' own
    batches = ((4, (4, 12)),  # 11 blocks: a new layout, of the most 4 documents take (8 + 3) and a pad block
               (5, (8, 16)),  # 12 blocks: too many documents for the first
               (3, (4, 12)),  # 10: both hold it, the first has fewer blocks
               (81, (128, 96)),  # 85: new, 85 + 1 rounded up to 32
               (100, (128, 128)),  # 103: past 96 blocks, new
               (60, (128, 96)),  # 65: both 128-document layouts hold it, the one of fewer blocks taken
               (20, (32, 32)),  # 27: the layouts of 20+ documents add too many pad blocks (more than 64), new
               (2, (4, 12)), (8, (8, 16)), (1, (4, 12)),
               (129, (192, 160)))  # 130: new
    try:
        for docs, (bucket, blocks) in batches:
            bounds = torch.tensor([*range(0, 3 * (docs - 1) + 1, 3), 512])
            info = varlen_info(bounds)
            offsets, indices, pad = gdn_graph._load_layout(info, cpu)
            expected = fixed_layout(bounds, bucket, blocks)
            assert torch.equal(offsets, expected.cu_seqlens) and torch.equal(indices, expected.chunk_indices), docs
            assert pad == expected.pad
            # the layout's buffers, refilled
            assert seen.setdefault((bucket, blocks), (offsets, indices))[0] is offsets
            again = gdn_graph._load_layout(info, cpu)  # the next layer of the same batch: nothing to copy
            assert again[0] is offsets and torch.equal(again[0], expected.cu_seqlens)
        assert sorted((b, k) for _, _, b, k in gdn_graph._LAYOUTS) == sorted(set(layout for _, layout in batches))
    finally:
        gdn_graph._LAYOUTS.clear()
