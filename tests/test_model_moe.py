"""Native Qwen3.5-MoE decoder vs transformers' Qwen3_5MoeForCausalLM (fp32, CPU, identical weights).

Router ties: a token whose k-th and (k+1)-th router probabilities are within rounding of each other may pick
a different expert in two correct implementations. The parity tests use seeded data and assert that the
smallest such gap in transformers' own router logits is above 1e-5 (`min_topk_gap`), about 100x the fp32
difference between the two, so a failure is never a tie in disguise.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from qwenft.checkpoint.hf_export import save_hf
from qwenft.constants import IGNORE_INDEX
from qwenft.models.loader import build_model, init_random_weights, load_hf_weights, read_expert_box
from qwenft.models.qwen3_5 import adapter
from qwenft.models.qwen3_5.configs import config_from_hf_dir, named_config, to_hf_config
from qwenft.models.qwen3_5.moe import MoE, load_balancing_loss

from helpers import assert_near_reference, make_hf_moe_model, rel_err


def min_topk_gap(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router probability over every token and layer."""
    probs = torch.cat(router_logits).float().softmax(dim=-1).sort(dim=-1, descending=True).values
    return (probs[:, k - 1] - probs[:, k]).min().item()


def shifted(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


@pytest.fixture
def tiny_pair(tmp_path):
    cfg = named_config("tiny_moe")
    hf = make_hf_moe_model(cfg)
    hf.save_pretrained(tmp_path)
    model = load_hf_weights(build_model(cfg, kernels="torch", moe_kernel="loop"), tmp_path, device="cpu")
    return cfg, hf, model, tmp_path


def native_loss_and_stats(model, ids, labels, coef):
    """transformers' loss: token-mean CE of the shifted labels + router_aux_loss_coef * aux."""
    logits = model(input_ids=ids)
    stats = model.router_stats()
    aux = load_balancing_loss(list(stats.values()))
    ce = F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                         shifted(labels).flatten(), ignore_index=IGNORE_INDEX)
    return logits, ce + coef * aux, aux, stats


def test_logits_loss_aux_and_grads_match_transformers(tiny_pair):
    cfg, hf, model, hf_dir = tiny_pair
    coef = cfg.text.router_aux_loss_coef
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 80))  # 80 > GDN chunk of 64
    labels = torch.randint(0, cfg.text.vocab_size, (2, 80))

    ref = hf(input_ids=ids, labels=labels, output_router_logits=True)
    assert min_topk_gap(ref.router_logits, cfg.text.num_experts_per_tok) > 1e-5
    logits, loss, aux, stats = native_loss_and_stats(model, ids, labels, coef)
    # the same model in fp64: the yardstick for fp32's rounding (helpers.assert_near_reference)
    exact = load_hf_weights(build_model(cfg, kernels="torch", moe_kernel="loop"), hf_dir, device="cpu",
                            dtype=torch.float64)
    logits64, loss64 = native_loss_and_stats(exact, ids, labels, coef)[:2]
    assert_near_reference(logits, ref.logits, logits64, "logits")
    assert abs(aux.item() - ref.aux_loss.item()) < 1e-5 * ref.aux_loss.item()
    assert abs(loss.item() - ref.loss.item()) < 1e-5 * ref.loss.item()
    # expert load = transformers' top-k choices counted per expert, layer by layer
    for (layer, s), router_logits in zip(sorted(stats.items()), ref.router_logits):
        top = router_logits.softmax(dim=-1).topk(cfg.text.num_experts_per_tok, dim=-1).indices
        assert torch.equal(s.load_e, torch.bincount(top.flatten(), minlength=cfg.text.num_experts)), layer
        assert s.tokens.item() == ids.numel()

    for each in (ref.loss, loss, loss64):
        each.backward()
    native, native64 = (adapter.to_hf_state_dict({n: p.grad for n, p in m.named_parameters()}, cfg.text)
                        for m in (model, exact))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(native) == set(hf_grads)
    for name, g in hf_grads.items():
        assert_near_reference(native[name], g, native64[name], name)
    assert hf_grads["model.layers.0.mlp.gate.weight"].norm() > 0  # via the chosen experts' weights and the aux loss


def test_aux_loss_with_padding_mask_matches_transformers(tiny_pair):
    """transformers drops padding from the aux loss through attention_mask; the native model through
    router_mask. Right padding leaves every real token's routing unchanged in transformers."""
    cfg, hf, model, _ = tiny_pair
    torch.manual_seed(2)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 27:] = 0
    ref = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
    model(input_ids=ids, router_mask=mask.bool())
    aux = load_balancing_loss(list(model.router_stats().values()))
    assert all(s.tokens.item() == 67 for s in model.router_stats().values())
    assert abs(aux.item() - ref.aux_loss.item()) < 1e-5 * ref.aux_loss.item()
    model(input_ids=ids)
    assert abs(load_balancing_loss(list(model.router_stats().values())).item() - ref.aux_loss.item()) > 1e-4


def test_packed_documents_equal_separate_forwards():
    """fp64 (the router and the torch GDN path compute in fp64 when given fp64), so the check is tight.
    Routing is per token, so the router statistics of the packed batch are the sums of the documents'."""
    cfg = named_config("tiny_moe")
    model = init_random_weights(build_model(cfg, kernels="torch", moe_kernel="loop"), seed=1, device="cpu",
                                dtype=torch.float64)
    lengths = [70, 13, 45]  # the first crosses a GDN chunk boundary
    cu = torch.tensor([0, 70, 83, 128], dtype=torch.int32)
    ids = torch.randint(0, cfg.text.vocab_size, (1, sum(lengths)))
    probe = torch.randn(1, sum(lengths), cfg.text.vocab_size, dtype=torch.float64)

    packed = model(input_ids=ids, cu_seqlens=cu)
    packed_stats = model.router_stats()
    (packed * probe).sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    pieces, load, prob = [], 0, 0
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out = model(input_ids=ids[:, s:e])
        (out * probe[:, s:e]).sum().backward()
        pieces.append(out)
        load = load + torch.stack([st.load_e for _, st in sorted(model.router_stats().items())])
        prob = prob + torch.stack([st.prob_sum_e for _, st in sorted(model.router_stats().items())])
    assert rel_err(packed, torch.cat(pieces, dim=1)) < 1e-9
    for n, p in model.named_parameters():
        assert rel_err(grads_packed[n], p.grad) < 1e-9, n
    assert torch.equal(torch.stack([st.load_e for _, st in sorted(packed_stats.items())]), load)
    packed_prob = torch.stack([st.prob_sum_e for _, st in sorted(packed_stats.items())])
    assert rel_err(packed_prob.detach(), prob.detach()) < 1e-12


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")
def test_grouped_mm_equals_the_expert_loop():
    """torch's CPU build runs _grouped_mm in fp32 (CUDA's takes bf16 only), so the grouped path is checked
    here against the loop; expert 3 gets no token, an empty group."""
    cfg = named_config("tiny_moe")
    torch.manual_seed(3)
    block = {k: MoE(cfg.text, kernel=k) for k in ("loop", "grouped_mm")}
    with torch.no_grad():
        for p in block["loop"].parameters():
            p.normal_(0, 0.1)
        block["loop"].gate.weight[3] = 0.0
        block["loop"].gate.weight[3, 0] = -10.0  # with x[..., 0] = 10: logit -100, never chosen
    block["grouped_mm"].load_state_dict(block["loop"].state_dict())
    x = torch.randn(2, 24, cfg.text.hidden_size)
    x[..., 0] = 10.0
    probe = torch.randn_like(x)
    out = {}
    for k, b in block.items():
        xk = x.clone().requires_grad_()
        y = b(xk)
        (y * probe).sum().backward()
        out[k] = (y, xk.grad, {n: p.grad for n, p in b.named_parameters()}, b.stats.load_e)
    assert out["loop"][3][3] == 0
    assert torch.equal(out["loop"][3], out["grouped_mm"][3])
    assert rel_err(out["grouped_mm"][0], out["loop"][0]) < 1e-6
    assert rel_err(out["grouped_mm"][1], out["loop"][1]) < 1e-6
    for n, g in out["loop"][2].items():
        assert rel_err(out["grouped_mm"][2][n], g) < 1e-6, n


def test_rows_by_expert_backward_equals_indexing():
    """The routed pairs' rows (`x[order // k]`) with the fixed-order backward that keeps tp replicas bit-equal
    on CUDA: the same gradient as indexing's own backward (fp64, where both orders agree to rounding)."""
    from qwenft.models.qwen3_5.moe import _RowsByExpert

    n, k, h = 7, 3, 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, dtype=torch.float64, generator=gen)
    order = torch.randint(0, 4, (n * k,), generator=gen).argsort(stable=True)
    probe = torch.randn(n * k, h, dtype=torch.float64, generator=gen)
    grads = []
    for rows in (lambda t: t[order // k], lambda t: _RowsByExpert.apply(t, order, k)):
        xg = x.clone().requires_grad_()
        out = rows(xg)
        (out * probe).sum().backward()
        grads.append((out.detach(), xg.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-12, atol=1e-12)


def test_hf_save_native_load_hf_export_keeps_every_tensor(tiny_pair, tmp_path_factory):
    """transformers' save_pretrained writes one tensor per expert (experts.{j}.gate_proj ...); the export writes
    them fused, as transformers holds them in memory. Either way every tensor comes back bit for bit."""
    cfg, hf, model, hf_dir = tiny_pair
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.7.up_proj.weight" in f.keys()
    assert config_from_hf_dir(hf_dir) == cfg
    out = tmp_path_factory.mktemp("export")
    save_hf(model, cfg, out)
    original = hf.state_dict()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(original)
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), original[k]), k
    assert config_from_hf_dir(out) == cfg
    again = Qwen3_5MoeForCausalLM.from_pretrained(out).float()
    assert again.config.architectures == ["Qwen3_5MoeForCausalLM"]
    assert all(torch.equal(t, original[k]) for k, t in again.state_dict().items())
    # and the fused export loads natively to the same parameters
    reloaded = load_hf_weights(build_model(cfg, kernels="torch"), out, device="cpu")
    for (n, a), b in zip(model.named_parameters(), reloaded.parameters()):
        assert torch.equal(a, b), n


def test_per_expert_checkpoint_reads_any_box_of_experts(tiny_pair):
    """An expert-parallel or tp-sharded rank reads a box of a fused expert tensor: experts [2, 5), rows that
    straddle the gate/up boundary, a column range, all from transformers' per-expert tensors."""
    cfg, hf, model, hf_dir = tiny_pair
    full = model.layers["1"].mlp.experts.gate_up_proj
    src = adapter.hf_source("layers.1.mlp.experts.gate_up_proj", cfg.text,
                             per_expert=adapter.PerExpert(trunk=True))
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        box = read_expert_box(f.get_slice, src, full.shape, (3, 20, 16), (2, 22, 8))
        with pytest.raises(ValueError, match="shape mismatch"):
            read_expert_box(f.get_slice, src, (8, 66, 64), (1, 2, 2), (0, 0, 0))
    assert torch.equal(box, full[2:5, 22:42, 8:24])


def test_35b_a3b_is_transformers_default_moe_config():
    """transformers documents Qwen3_5MoeTextConfig()'s defaults as Qwen3.5-35B-A3B; qwenft's size agrees on
    every dimension (rope theta: the checkpoint's 1e7, not the class default)."""
    ours = to_hf_config(named_config("35b_a3b"))
    default = Qwen3_5MoeTextConfig()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "router_aux_loss_coef",
                "tie_word_embeddings", "layer_types", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(default, key), key
    assert ours.rope_parameters["rope_theta"] == 1e7


@pytest.mark.parametrize("size, total, active", [("35b_a3b", 35, 3), ("122b_a10b", 122, 10), ("397b_a17b", 397, 17)])
def test_named_moe_sizes_have_their_names_parameter_counts(size, total, active):
    """The released names give total and active parameters in billions (Qwen3.5-122B-A10B: 122B, 10B active);
    the text model built on meta from qwenft's numbers has them to 1B (it lacks the ~0.4B vision tower; 397B-A17B
    measures 396.3B), active = all but the experts a token is not routed to."""
    cfg = named_config(size)
    t = cfg.text
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.layers.values() for p in layer.mlp.experts.parameters())
    n_active = n - experts * (t.num_experts - t.num_experts_per_tok) // t.num_experts
    assert abs(n / 1e9 - total) < 1 and abs(n_active / 1e9 - active) < 0.5, (n, n_active)
    assert to_hf_config(cfg).num_experts == t.num_experts  # transformers takes the numbers as they are


def test_tiny_moe_builds_on_meta_with_fused_expert_shapes():
    cfg = named_config("tiny_moe")
    model = build_model(cfg)  # meta, as the training path builds it
    t = cfg.text
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.3.mlp.")}
    assert shapes == {
        "layers.3.mlp.gate.weight": (t.num_experts, t.hidden_size),
        "layers.3.mlp.experts.gate_up_proj": (t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size),
        "layers.3.mlp.experts.down_proj": (t.num_experts, t.hidden_size, t.moe_intermediate_size),
        "layers.3.mlp.shared_expert.gate_proj.weight": (t.shared_expert_intermediate_size, t.hidden_size),
        "layers.3.mlp.shared_expert.up_proj.weight": (t.shared_expert_intermediate_size, t.hidden_size),
        "layers.3.mlp.shared_expert.down_proj.weight": (t.hidden_size, t.shared_expert_intermediate_size),
        "layers.3.mlp.shared_expert_gate.weight": (1, t.hidden_size),
    }
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        dataclasses.replace(t, num_experts_per_tok=9)


def test_vlm_logits_grads_and_export_match_transformers(tmp_path):
    """Qwen3_5MoeForConditionalGeneration: transformers' vision tower + the native MoE decoder, the released
    layout (`model.language_model.` + `model.visual.`)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    from qwenft.models.qwen3_5.vision import tiny_vision_config

    image, start, end = 500, 502, 503
    text = named_config("tiny_moe").text
    cfg = dataclasses.replace(named_config("tiny_moe"), vision=tiny_vision_config(text.hidden_size),
                              image_token_id=image, video_token_id=501, vision_start_token_id=start,
                              vision_end_token_id=end)
    hf = make_hf_moe_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    loaded = config_from_hf_dir(tmp_path / "hf")
    assert loaded.text == cfg.text and loaded.vision is not None
    model = load_hf_weights(build_model(loaded, kernels="torch", moe_kernel="loop"), tmp_path / "hf", device="cpu")
    exact = load_hf_weights(build_model(loaded, kernels="torch", moe_kernel="loop"), tmp_path / "hf", device="cpu",
                            dtype=torch.float64)

    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 merged tokens
    ids = torch.tensor([[11, 12, start] + [image] * 4 + [end] + list(range(20, 36))])
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 400, ids.shape, generator=torch.Generator().manual_seed(2))
    ref = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == image).int(),
             output_router_logits=True)
    assert min_topk_gap(ref.router_logits, text.num_experts_per_tok) > 1e-5
    logits, logits64 = (m(input_ids=ids, pixel_values=pixels, image_grid_thw=grid) for m in (model, exact))
    for out in (ref.logits, logits, logits64):
        F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    assert_near_reference(logits, ref.logits, logits64, "logits")
    grads, grads64 = (adapter.to_hf_state_dict({n: p.grad for n, p in m.named_parameters()}, cfg.text,
                                               adapter.VLM_PREFIX) for m in (model, exact))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(hf_grads)
    for name, g in hf_grads.items():
        assert_near_reference(grads[name], g, grads64[name], name)

    save_hf(model, loaded, tmp_path / "export")
    again = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "export")
    assert again.config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    original = hf.state_dict()
    assert all(torch.equal(t, original[k]) for k, t in again.state_dict().items())
