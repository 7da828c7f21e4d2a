"""M-RoPE positions of one document (transformers' `get_rope_index` rule), below models and data: the data
pipeline computes them per packed document, the model (qwenft.models.qwen3_5.vision.mrope_position_ids) per
batch."""

import torch


def document_mrope_position_ids(
    input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_token_id: int, spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions `[3, L]` for one document (1-D `input_ids`), starting at 0.

    Consumes the rows of `image_grid_thw` in order, one per image in the document; returns the
    positions and how many rows it used. Text tokens get the same position on all three axes and
    continue after each image from `start + max(h, w) / merge` (transformers' rule).
    """
    device = input_ids.device
    is_image = (input_ids == image_token_id).tolist()
    length = len(is_image)
    chunks: list[torch.Tensor] = []
    pos = 0  # next position id
    i = 0  # next token
    n_images = 0
    while i < length:
        j = i
        while j < length and not is_image[j]:
            j += 1
        if j > i:
            chunks.append(torch.arange(pos, pos + j - i, device=device).expand(3, -1))
            pos += j - i
        if j == length:
            break
        if image_grid_thw is None or n_images >= len(image_grid_thw):
            n_grids = 0 if image_grid_thw is None else len(image_grid_thw)
            raise ValueError(f"input_ids hold more images than image_grid_thw has rows ({n_grids})")
        t, h, w = (int(x) for x in image_grid_thw[n_images])
        t_bhw = torch.arange(t, device=device)
        h_bhw = torch.arange(h // spatial_merge_size, device=device)
        w_bhw = torch.arange(w // spatial_merge_size, device=device)
        grid = torch.stack(torch.meshgrid(t_bhw, h_bhw, w_bhw, indexing="ij")).reshape(3, -1) + pos
        n_tokens = grid.shape[1]
        if j + n_tokens > length or not all(is_image[j : j + n_tokens]):
            raise ValueError(
                f"image {n_images} has grid {[t, h, w]} -> {n_tokens} tokens, but input_ids hold "
                f"{sum(is_image[j:j + n_tokens])} consecutive image tokens at position {j}"
            )
        chunks.append(grid)
        pos += max(h, w) // spatial_merge_size
        i = j + n_tokens
        n_images += 1
    if not chunks:
        return torch.zeros(3, 0, dtype=torch.long, device=device), 0
    return torch.cat(chunks, dim=1), n_images
