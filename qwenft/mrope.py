"""M-RoPE positions of one document (transformers' `get_rope_index` rule), below models and data: the data
pipeline computes them per packed document, the model (qwenft.models.qwen3_5.vision.mrope_position_ids) per
batch."""

import torch


def split_video_grids(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """One (1, h, w) row per frame of each video's (t, h, w): the frames are separate runs of video tokens in the
    ids (each between its timestamp, vision-start and vision-end tokens), positioned as images are."""
    if video_grid_thw is None:
        return None
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def document_mrope_position_ids(
    input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_token_id: int, spatial_merge_size: int,
    frame_grid_thw: torch.Tensor | None = None, video_token_id: int | None = None,
) -> tuple[torch.Tensor, int, int]:
    """M-RoPE positions `[3, L]` for one document (1-D `input_ids`), starting at 0.

    Consumes the rows of `image_grid_thw` in order, one per image in the document, and those of
    `frame_grid_thw` (`split_video_grids`), one per video frame; returns the positions and how many rows of each
    it used. Text tokens get the same position on all three axes and continue after each image or frame from
    `start + max(h, w) / merge` (transformers' rule).
    """
    device = input_ids.device
    ids = input_ids.tolist()
    kinds = {image_token_id: ("image", image_grid_thw)}
    if video_token_id is not None:
        kinds[video_token_id] = ("video frame", frame_grid_thw)
    length = len(ids)
    chunks: list[torch.Tensor] = []
    used = {token: 0 for token in kinds}
    pos = 0  # next position id
    i = 0  # next token
    while i < length:
        j = i
        while j < length and ids[j] not in kinds:
            j += 1
        if j > i:
            chunks.append(torch.arange(pos, pos + j - i, device=device).expand(3, -1))
            pos += j - i
        if j == length:
            break
        token = ids[j]
        name, grids = kinds[token]
        n = used[token]
        if grids is None or n >= len(grids):
            n_grids = 0 if grids is None else len(grids)
            raise ValueError(f"input_ids hold more {name}s than their grids have rows ({n_grids})")
        t, h, w = (int(x) for x in grids[n])
        t_bhw = torch.arange(t, device=device)
        h_bhw = torch.arange(h // spatial_merge_size, device=device)
        w_bhw = torch.arange(w // spatial_merge_size, device=device)
        grid = torch.stack(torch.meshgrid(t_bhw, h_bhw, w_bhw, indexing="ij")).reshape(3, -1) + pos
        n_tokens = grid.shape[1]
        run = ids[j:j + n_tokens]
        if j + n_tokens > length or any(x != token for x in run):
            raise ValueError(
                f"{name} {n} has grid {[t, h, w]} -> {n_tokens} tokens, but input_ids hold "
                f"{sum(x == token for x in run)} consecutive {name} tokens at position {j}"
            )
        chunks.append(grid)
        pos += max(h, w) // spatial_merge_size
        i = j + n_tokens
        used[token] = n + 1
    n_images, n_frames = used[image_token_id], used.get(video_token_id, 0)
    if not chunks:
        return torch.zeros(3, 0, dtype=torch.long, device=device), n_images, n_frames
    return torch.cat(chunks, dim=1), n_images, n_frames
