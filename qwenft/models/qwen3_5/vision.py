"""Vision side of the Qwen3.5 VLM: transformers' vision tower, image-token scatter, M-RoPE positions.

The vision tower is transformers' `Qwen3_5VisionModel`, used as is (it is small next to the decoder,
has no PP/TP concerns of its own, and its numerics are what checkpoints were trained with). What this
file adds is what the tower lacks for a meta-device build: `init_vision_buffers` recomputes the
rotary `inv_freq` buffers, which are non-persistent (absent from checkpoints) and hold garbage after
`to_empty`.

`mrope_position_ids` reproduces transformers' `Qwen3_5Model.get_rope_index` (text, images, videos) as a
standalone function of `input_ids`, so the data pipeline can compute positions before the model
runs (pipeline stages after the first never see `input_ids`), and per packed document.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5VisionModel,
    Qwen3_5VisionRotaryEmbedding,
)

from qwenft.mrope import document_mrope_position_ids, split_video_grids


def tiny_vision_config(out_hidden_size: int) -> dict:
    """A two-block vision tower for CPU tests; `out_hidden_size` must be the text hidden size."""
    return {
        "model_type": "qwen3_5_vision",
        "depth": 2,
        "hidden_size": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out_hidden_size,
        "num_position_embeddings": 64,  # an 8x8 learned grid, resampled to each image
    }


class VisionTower(Qwen3_5VisionModel):
    """transformers' Qwen3.5 vision tower as the native model's `visual` module.

    A subclass (not a wrapper) so parameter names stay `visual.X` = HF `model.visual.X`. `forward` is the
    hook `Qwen3_5Model` calls on the first stage: token embeddings in, embeddings with the image
    features at the image placeholder tokens out. `init_buffers` is the loader's re-init hook.
    """

    def __init__(self, config: Qwen3_5VisionConfig, image_token_id: int, video_token_id: int | None = None):
        super().__init__(config)
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id

    def forward(self, input_ids, inputs_embeds, pixel_values, image_grid_thw, pixel_values_videos=None,
                video_grid_thw=None) -> torch.Tensor:
        """Images' features at the image tokens, videos' at the video tokens (a video's frames in order: the
        tower takes its (t, h, w) grid whole, two frames a temporal patch, as transformers' does)."""
        if pixel_values is not None:
            features = self.image_features(pixel_values, image_grid_thw)
            inputs_embeds = scatter_image_features(inputs_embeds, input_ids, features, self.image_token_id)
        if pixel_values_videos is not None:
            features = self.image_features(pixel_values_videos, video_grid_thw)
            inputs_embeds = scatter_image_features(inputs_embeds, input_ids, features, self.video_token_id, "video")
        return inputs_embeds

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged features `[n_image_tokens, out_hidden_size]`, images concatenated in order."""
        if image_grid_thw is None:
            raise ValueError("pixel_values given without image_grid_thw [n_images, 3]")
        pixel_values = pixel_values.to(self.patch_embed.proj.weight.dtype)
        return super().forward(pixel_values, grid_thw=image_grid_thw).pooler_output

    def init_buffers(self) -> None:
        init_vision_buffers(self)


def build_vision(cfg) -> VisionTower:
    """The vision tower of a `ModelConfig` with `cfg.vision` set; honours the default device (meta)."""
    if cfg.vision["out_hidden_size"] != cfg.text.hidden_size:
        raise ValueError(
            f"vision out_hidden_size {cfg.vision['out_hidden_size']} must equal text hidden_size "
            f"{cfg.text.hidden_size} (image features replace token embeddings)"
        )
    return VisionTower(Qwen3_5VisionConfig.from_dict(cfg.vision), cfg.image_token_id, cfg.video_token_id)


def init_vision_buffers(tower: Qwen3_5VisionModel) -> None:
    """Recompute the rotary `inv_freq` buffers on the tower's device (needed after `to_empty`)."""
    for module in tower.modules():
        if isinstance(module, Qwen3_5VisionRotaryEmbedding):
            device = module.inv_freq.device
            inv_freq, _ = module.compute_axial_rope_parameters(module.config, device=device)
            module.inv_freq = inv_freq
            module.original_inv_freq = inv_freq.clone()


def scatter_image_features(
    inputs_embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor, image_token_id: int,
    kind: str = "image",
) -> torch.Tensor:
    """Put image (or video, `kind`) features, in order, at the placeholder tokens of `inputs_embeds [B, T, H]`."""
    image_mask = input_ids == image_token_id
    n_tokens = int(image_mask.sum())
    if n_tokens != features.shape[0]:
        inputs = "pixel_values/image_grid_thw" if kind == "image" else "pixel_values_videos/video_grid_thw"
        raise ValueError(
            f"input_ids hold {n_tokens} {kind} tokens ({kind}_token_id={image_token_id}) but {inputs} give "
            f"{features.shape[0]} {kind} features; they must be equal"
        )
    features = features.to(inputs_embeds.dtype)
    return inputs_embeds.masked_scatter(image_mask.unsqueeze(-1), features)


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    cfg,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """M-RoPE position ids `[3, B, T]` for `input_ids [B, T]`, as transformers' `get_rope_index`.

    `image_grid_thw [n_images, 3]` lists the batch's images in reading order, `video_grid_thw [n_videos, 3]` its
    videos (each frame a run of video tokens of its own, positioned as an image of t = 1). With `attention_mask`,
    masked-out tokens get position 0 and are skipped (left or right padding). With `cu_seqlens`
    (offsets into the flattened `B*T` tokens), positions restart at 0 for each packed document.
    """
    if attention_mask is not None and cu_seqlens is not None:
        raise ValueError("mrope_position_ids takes attention_mask (padding) or cu_seqlens (packing), not both")
    image_token_id = cfg.image_token_id
    merge = cfg.vision["spatial_merge_size"] if cfg.vision else 1
    frames = split_video_grids(video_grid_thw)
    batch, seqlen = input_ids.shape

    if cu_seqlens is not None:
        documents = list(torch.split(input_ids.reshape(-1), torch.diff(cu_seqlens).tolist()))
    elif attention_mask is not None:
        documents = [row[mask.bool()] for row, mask in zip(input_ids, attention_mask)]
    else:
        documents = list(input_ids)

    pieces, used, used_frames = [], 0, 0
    for doc in documents:
        grids = None if image_grid_thw is None else image_grid_thw[used:]
        frame_grids = None if frames is None else frames[used_frames:]
        positions, n_images, n_frames = document_mrope_position_ids(doc, grids, image_token_id, merge, frame_grids,
                                                                    cfg.video_token_id)
        pieces.append(positions)
        used, used_frames = used + n_images, used_frames + n_frames
    n_grids = 0 if image_grid_thw is None else len(image_grid_thw)
    if used != n_grids:
        raise ValueError(f"image_grid_thw has {n_grids} rows but input_ids hold {used} images")
    n_frames = 0 if frames is None else len(frames)
    if used_frames != n_frames:
        raise ValueError(f"video_grid_thw has {n_frames} frames but input_ids hold {used_frames} video frames")

    if attention_mask is None:
        return torch.cat(pieces, dim=1).reshape(3, batch, seqlen)
    position_ids = torch.zeros(3, batch, seqlen, dtype=torch.long, device=input_ids.device)
    for b, positions in enumerate(pieces):
        position_ids[:, b, attention_mask[b].bool()] = positions
    return position_ids
