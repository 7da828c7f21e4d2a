"""Qwen3.5's multi-token-prediction (MTP) head: the draft that vLLM's MTP speculative decoding serves.

At position t it sees the trunk's final-norm hidden state h_t and the embedding of token t+1, and predicts
token t+2 through the shared `lm_head`:

    x_t = fc(cat(pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(h_t)))     # [H, 2H], embedding first
    y_t = norm(full_attention_decoder_layer(x_t))                                        # same positions as the trunk
    logits_t = lm_head(y_t)                                                              # target: token t+2

Parameter names are the checkpoints' (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, ...), so the
adapter maps them one to one. The decoder layer is `model.DecoderLayer` with the full-attention type and the
model's MLP or MoE block, so tensor, context and expert parallelism cut it as they cut the trunk's layers.

Packed rows: the pairs never cross a document. `next_in_document` shifts the stream by one and `mtp_labels`
leaves the last token of each document without a target, so a document's final token pairs with nothing.
"""

import dataclasses

import torch
from torch import nn

from qwenft.conf.schema import CHOICES
from qwenft.constants import IGNORE_INDEX

from .attention import RMSNorm
from .configs import FULL_ATTENTION, TextConfig

MODES = CHOICES["model.mtp"]


def mtp_layer_config(cfg: TextConfig) -> TextConfig:
    """The text config of the head's one decoder layer: a single full-attention layer."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=[FULL_ATTENTION])


class MTPHead(nn.Module):
    def __init__(self, cfg: TextConfig, kernels: str = "torch", attention_kernel: str = "auto",
                 moe_kernel: str = "auto"):
        from .model import DecoderLayer  # the decoder's own layer class (model.py builds this head)

        super().__init__()
        if cfg.mtp_num_hidden_layers != 1:
            raise ValueError(f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers} in the model config: the MTP head "
                             f"of Qwen3.5 has 1 layer, and only 1 is supported (model.mtp=keep passes any through)")
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleDict({"0": DecoderLayer(mtp_layer_config(cfg), 0, kernels, attention_kernel,
                                                       moe_kernel)})
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, hidden_btd, next_embeds_btd, rope, cu_seqlens=None, router_mask=None, cp=None):
        """`hidden_btd`: the trunk's final-norm output; `next_embeds_btd`: the embedding of each position's next
        token (`next_in_document`). Returns the head's normed output, for `lm_head`."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds_btd), self.pre_fc_norm_hidden(hidden_btd)], dim=-1)
        x = self.fc(x)
        x = self.layers["0"](x, rope, cu_seqlens, router_mask, **({"cp": cp} if cp is not None else {}))
        return self.norm(x)


def next_in_document(x_bt: torch.Tensor) -> torch.Tensor:
    """Each position's next entry in the flattened [B, T, ...] stream (the one after the stream's end wraps to
    its start). Across a document's end this pairs a document's last token with the next document's first: that
    position gets no target (`mtp_labels`), and under causal attention only its own output depends on it."""
    b, t = x_bt.shape[:2]
    return x_bt.flatten(0, 1).roll(-1, dims=0).unflatten(0, (b, t))


def mtp_labels(labels_bt: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The head's targets [B, T]: position t's is `labels[t + 1]` (token t+2, when that is trained), and none at
    a document's last token, whose t+1 belongs to the next document. `cu_seqlens`: the documents' offsets into
    the flattened stream; None = one document per row."""
    b, t = labels_bt.shape
    out = next_in_document(labels_bt).reshape(-1).clone()
    if cu_seqlens is None:
        ends = torch.arange(1, b + 1, device=labels_bt.device) * t
    else:
        ends = cu_seqlens[1:].to(device=labels_bt.device, dtype=torch.long)
    out[ends - 1] = IGNORE_INDEX
    return out.view(b, t)
