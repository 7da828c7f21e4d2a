"""Native Qwen3.5 VLM (transformers' vision tower + native decoder) against transformers' own
`Qwen3_5ForConditionalGeneration` on identical weights: logits, every gradient, M-RoPE positions,
and a save -> `from_pretrained` round trip. CPU, fp32."""

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from helpers import END, IMAGE, PATCH_DIM, START, VIDEO, assert_near_reference, tiny_vlm, vlm_row
from qwenft.checkpoint.hf_export import save_hf
from qwenft.models.loader import build_model, load_hf_weights
from qwenft.models.qwen3_5 import adapter
from qwenft.models.qwen3_5.configs import config_from_hf_dir, to_hf_config
from qwenft.models.qwen3_5.vision import mrope_position_ids


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    cfg = tiny_vlm()
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(to_hf_config(cfg)).float()
    with torch.no_grad():  # zero-initialised norms would hide a (1 + w) vs w mix-up
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf_vlm")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def batch():
    grid = torch.tensor([[1, 4, 4], [1, 2, 6], [1, 6, 2]])  # 16, 12, 12 patches -> 4, 3, 3 tokens
    input_ids = torch.tensor([vlm_row([3, (1, 4, 4), 5], 24), vlm_row([2, (1, 2, 6), 2, (1, 6, 2), 4], 24)])
    gen = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen)
    labels = torch.randint(0, 400, input_ids.shape, generator=gen)
    return input_ids, pixel_values, grid, labels


def native_from(path, dtype=torch.float32):
    cfg = config_from_hf_dir(path)
    model = build_model(cfg, kernels="torch")  # meta
    return load_hf_weights(model, path, device="cpu", dtype=dtype), cfg


def native_grads(model, cfg) -> dict:
    return adapter.to_hf_state_dict({n: p.grad for n, p in model.named_parameters()}, cfg.text, adapter.VLM_PREFIX,
                                    tied=cfg.tie_word_embeddings)


def test_logits_and_grads_match_transformers(hf_ckpt, batch):
    hf, path = hf_ckpt
    model, cfg = native_from(path)
    assert cfg.vision is not None and model.visual is not None
    input_ids, pixel_values, grid, labels = batch

    exact = native_from(path, torch.float64)[0]  # the yardstick for fp32's rounding (helpers.assert_near_reference)

    hf.zero_grad()
    ref = hf(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid,
             mm_token_type_ids=(input_ids == IMAGE).int()).logits
    # the native models compute the M-RoPE positions themselves
    logits, logits64 = (m(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid) for m in (model, exact))
    for out in (ref, logits, logits64):
        torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()

    assert_near_reference(logits, ref, logits64, "logits")
    grads, grads64 = native_grads(model, cfg), native_grads(exact, cfg)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(hf_grads)
    assert any(k.startswith("model.visual.") for k in grads)
    for k, g in hf_grads.items():
        assert_near_reference(grads[k], g, grads64[k], k)


def test_vision_buffers_reinitialised_after_meta_build(hf_ckpt):
    hf, path = hf_ckpt
    model, _ = native_from(path)
    torch.testing.assert_close(model.visual.rotary_pos_emb.inv_freq, hf.model.visual.rotary_pos_emb.inv_freq,
                               rtol=0, atol=0)


def test_state_dict_round_trip_is_exact(hf_ckpt):
    hf, path = hf_ckpt
    model, cfg = native_from(path)
    native = {n: p.detach() for n, p in model.named_parameters()}
    assert any(k.startswith("visual.") for k in native)
    back = adapter.to_hf_state_dict(native, cfg.text, adapter.VLM_PREFIX, tied=cfg.tie_word_embeddings)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_save_hf_loads_in_transformers(hf_ckpt, batch, tmp_path):
    _, path = hf_ckpt
    model, cfg = native_from(path)
    with torch.no_grad():  # so the test does not pass by re-reading the original checkpoint
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf(model, cfg, tmp_path)
    hf2, info = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    input_ids, pixel_values, grid, _ = batch
    with torch.no_grad():
        ref = hf2(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid,
                  mm_token_type_ids=(input_ids == IMAGE).int()).logits
        logits = model(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid)
    assert rel(logits, ref) < 1e-5


@pytest.mark.parametrize("rows, grids", [
    ([[5], [3, 2]], []),
    ([[3, (1, 4, 4), 5], [9]], [[1, 4, 4]]),
    ([[2, (1, 2, 6), 3], [1, (1, 6, 4), 2]], [[1, 2, 6], [1, 6, 4]]),
    ([[2, (1, 4, 4), 1, (2, 4, 2), 2], [4]], [[1, 4, 4], [2, 4, 2]]),  # two in one row; t=2 (video-like)
])
def test_mrope_position_ids_match_transformers(hf_ckpt, rows, grids):
    hf, _ = hf_ckpt
    cfg = tiny_vlm()
    input_ids = torch.tensor([vlm_row(r, 30) for r in rows])
    mask = (input_ids != 0).long()
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None
    type_ids = (input_ids == IMAGE).int()
    ref, _ = hf.model.get_rope_index(input_ids, type_ids, image_grid_thw=grid, attention_mask=mask)
    assert torch.equal(mrope_position_ids(input_ids, grid, cfg, attention_mask=mask), ref)
    ref, _ = hf.model.get_rope_index(input_ids, type_ids, image_grid_thw=grid)  # padding counted as text
    assert torch.equal(mrope_position_ids(input_ids, grid, cfg), ref)


def test_mrope_position_ids_restart_per_packed_document(hf_ckpt):
    """Packing = per-document positions (each from transformers, separately), concatenated."""
    hf, _ = hf_ckpt
    cfg = tiny_vlm()
    docs = [([3, (1, 4, 4), 2], [[1, 4, 4]]), ([5], []), ([1, (1, 2, 6), 4], [[1, 2, 6]])]
    ids = [torch.tensor([vlm_row(parts)]) for parts, _ in docs]
    expected = []
    for (_, g), doc in zip(docs, ids):
        grid = torch.tensor(g).reshape(-1, 3) if g else None
        expected.append(hf.model.get_rope_index(doc, (doc == IMAGE).int(), image_grid_thw=grid)[0])
    packed = torch.cat(ids, dim=1)
    lengths = torch.tensor([0] + [d.shape[1] for d in ids])
    cu_seqlens = lengths.cumsum(0).to(torch.int32)
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])
    got = mrope_position_ids(packed, grid, cfg, cu_seqlens=cu_seqlens)
    assert torch.equal(got, torch.cat(expected, dim=2))


def test_image_token_count_mismatch_is_one_line_error(hf_ckpt, batch):
    _, path = hf_ckpt
    model, _ = native_from(path)
    input_ids, pixel_values, grid, _ = batch
    ids = input_ids.clone()
    ids[0, 4] = 1  # one image placeholder fewer: 9 tokens for 10 features
    with pytest.raises(ValueError, match=r"9 image tokens .* 10 image features"):
        model(input_ids=ids, position_ids=torch.zeros(3, *ids.shape, dtype=torch.long),
              pixel_values=pixel_values, image_grid_thw=grid)


def _video(t: int, h: int, w: int, stamp: int = 2) -> list[int]:
    """A video's ids as Qwen3.5's template lays them out: per frame (temporal patch), `stamp` timestamp text
    tokens, then vision-start, its h x w / merge^2 video tokens, vision-end."""
    frame = [START] + [VIDEO] * (h * w // 4) + [END]
    return [tok for f in range(t) for tok in [300 + f] * stamp + frame]


def _video_batch(seed: int = 3):
    """Two rows: a video of 2 frames, text, an image; text, a video of 3 frames (another grid), text."""
    videos = torch.tensor([[2, 4, 4], [3, 2, 6]])
    images = torch.tensor([[1, 6, 2]])
    rows = [[5, *_video(2, 4, 4), 3, START, *[IMAGE] * 3, END, 2], [4, *_video(3, 2, 6, stamp=1), 6]]
    length = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (length - len(r)) for r in rows])
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(images.prod(-1).sum()), PATCH_DIM, generator=gen)
    frames = torch.randn(int(videos.prod(-1).sum()), PATCH_DIM, generator=gen)
    return input_ids, pixels, images, frames, videos


def _types(input_ids):
    return (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()


def test_mrope_position_ids_with_videos_match_transformers(hf_ckpt):
    """Videos split per frame (timestamps between them) and an image, padded rows: positions as transformers'
    `get_rope_index`."""
    hf, _ = hf_ckpt
    input_ids, _, images, _, videos = _video_batch()
    mask = (input_ids != 0).long()
    ref, _ = hf.model.get_rope_index(input_ids, _types(input_ids), image_grid_thw=images, video_grid_thw=videos,
                                     attention_mask=mask)
    got = mrope_position_ids(input_ids, images, tiny_vlm(), attention_mask=mask, video_grid_thw=videos)
    assert torch.equal(got, ref)


def test_logits_and_grads_with_two_videos_and_an_image_match_transformers(hf_ckpt):
    """A batch with two videos (2 and 3 temporal patches, timestamps between frames) and an image: the native
    model's logits within 1e-5 of transformers' in fp32, and every gradient (the vision tower's included)."""
    hf, path = hf_ckpt
    model, cfg = native_from(path)
    input_ids, pixels, images, frames, videos = _video_batch()
    labels = torch.randint(0, 400, input_ids.shape, generator=torch.Generator().manual_seed(4))
    exact = native_from(path, torch.float64)[0]
    hf.zero_grad()
    ref = hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=images, pixel_values_videos=frames,
             video_grid_thw=videos, mm_token_type_ids=_types(input_ids)).logits
    logits, logits64 = (m(input_ids=input_ids, pixel_values=pixels, image_grid_thw=images, pixel_values_videos=frames,
                          video_grid_thw=videos) for m in (model, exact))
    for out in (ref, logits, logits64):
        torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    assert_near_reference(logits, ref, logits64, "logits")
    grads, grads64 = native_grads(model, cfg), native_grads(exact, cfg)
    for k, g in ((k, p.grad) for k, p in hf.named_parameters()):
        assert_near_reference(grads[k], g, grads64[k], k)


def test_video_frames_missing_from_the_ids_fail_in_one_line(hf_ckpt):
    """The ids hold a frame fewer than video_grid_thw says: positions and features both refuse it in one line."""
    _, path = hf_ckpt
    model, _ = native_from(path)
    _, pixels, images, frames, videos = _video_batch()
    ids = torch.tensor([[5, *_video(2, 4, 4), 3, START, *[IMAGE] * 3, END, 2, 4, *_video(2, 2, 6), 6]])
    with pytest.raises(ValueError, match=r"^video_grid_thw has 5 frames but input_ids hold 4 video frames$"):
        mrope_position_ids(ids, images, tiny_vlm(), video_grid_thw=videos)
    with pytest.raises(ValueError, match=r"^input_ids hold 14 video tokens \(video_token_id=501\) but "
                                         r"pixel_values_videos/video_grid_thw give 17 video features"):
        model(input_ids=ids, pixel_values=pixels, image_grid_thw=images, pixel_values_videos=frames,
              video_grid_thw=videos)


def test_packed_documents_with_images_match_transformers_per_document(hf_ckpt):
    """One packed row (cu_seqlens, positions computed) = transformers run on each document alone."""
    hf, path = hf_ckpt
    model, _ = native_from(path)
    docs = [([3, (1, 4, 4), 2], [[1, 4, 4]]), ([5], []), ([1, (1, 2, 6), 4], [[1, 2, 6]])]
    gen = torch.Generator().manual_seed(2)
    ids, grids, pixels, expected = [], [], [], []
    with torch.no_grad():
        for parts, g in docs:
            doc = torch.tensor([vlm_row(parts)])
            grid = torch.tensor(g).reshape(-1, 3) if g else None
            pv = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen) if g else None
            expected.append(hf(input_ids=doc, pixel_values=pv, image_grid_thw=grid,
                               mm_token_type_ids=(doc == IMAGE).int()).logits)
            ids.append(doc)
            grids += g
            pixels += [pv] if g else []
        lengths = torch.tensor([0] + [d.shape[1] for d in ids])
        logits = model(input_ids=torch.cat(ids, dim=1), cu_seqlens=lengths.cumsum(0).to(torch.int32),
                       pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))
    assert rel(logits, torch.cat(expected, dim=1)) < 1e-5


def test_random_init_of_vision_tower_follows_transformers():
    """LayerNorm weights 1 and biases 0 exactly, like transformers' init; the rest normal(0, 0.02)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from qwenft.models.loader import init_random_weights

    cfg = tiny_vlm()
    model = init_random_weights(build_model(cfg, kernels="torch"), seed=3, device="cpu")
    torch.manual_seed(0)
    ref = dict(Qwen3_5VisionModel(Qwen3_5VisionConfig.from_dict(cfg.vision)).named_parameters())
    for name, p in model.visual.named_parameters():
        if ref[name].std() == 0:
            assert torch.equal(p, ref[name]), name
        else:
            assert abs(p.std().item() - ref[name].std().item()) < 0.2 * ref[name].std().item(), name
