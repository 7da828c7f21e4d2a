"""Native Qwen3.5 decoder: pipeline-split-safe, head-shardable, meta-init-safe.

Layers live in `layers: nn.ModuleDict` keyed by the original layer index, so a pipeline stage that owns a
subset still knows each layer's kind. Builds on the meta device with no compute; after `to_empty`, call
`init_buffers()` (the rotary `inv_freq` is a non-persistent buffer and is garbage after `to_empty`).
"""

import functools

import torch
from torch import nn

from .attention import GatedAttention, RMSNorm, RotaryEmbedding
from .configs import FULL_ATTENTION, ModelConfig, TextConfig
from .gdn import GatedDeltaNet, param_dtype, positions_in_document
from .moe import MLP, MoE, RouterStats, routing_rows
from ..linear_ce import LMHead


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_id: int, kernels: str, attention_kernel: str = "auto",
                 moe_kernel: str = "auto"):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_id]
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(cfg, attention_kernel)
        else:
            self.linear_attn = GatedDeltaNet(cfg, kernels)
        # Qwen3.5-MoE: every layer's MLP is the sparse block
        self.mlp = MoE(cfg, moe_kernel) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, cu_seqlens=None, router_mask=None):
        x = self.input_layernorm(h)
        if self.layer_type == FULL_ATTENTION:
            x = self.self_attn(x, rope, cu_seqlens)
        else:
            x = self.linear_attn(x, cu_seqlens)
        h = h + x
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, router_mask) if isinstance(self.mlp, MoE) else self.mlp(x))


def _compile(fn):
    """torch.compile(fn, dynamic=False), fed plain tensors.

    An input may arrive as AsyncCollectiveTensor (a functional collective not yet waited on). Given one
    directly, the compiled graph's backward is wrong on torch 2.13 (the gradient of whatever produced the input,
    e.g. a vocab-parallel embedding whose all-reduce is a functional one); a clone waits and gives eager's
    numbers, for one [B, T, H] copy.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    graph = torch.compile(fn, dynamic=False)

    @functools.wraps(fn)
    def call(*args):
        return graph(*(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args))

    return call


def compile_layer(layer: DecoderLayer) -> None:
    """torch.compile the fixed-shape pieces of one decoder layer (`model.compile=true`), in place.

    Compiled, each its own graph: the two layer norms, the MLP (of MoE: the shared expert only), and the mixer's
    pieces before and after its
    kernel (attention: q/k/v/gate projections, q/k norms and rotary, then the sigmoid gate and o_proj; GDN:
    the six projections and beta's sigmoid, the fp32 decay, then the gated norm and out_proj). Left eager:
    the kernels (fla's Triton convs and delta rule, the torch reference, SDPA or varlen flash attention) and
    everything that reads cu_seqlens (`varlen_info`'s identity cache, masks, positions), so a batch with a
    different number of documents reuses the graphs: every compiled input is [B, T, ...] of the fixed
    data.seq_len (dynamic=False). Each module's `forward` is replaced, not its `__call__`, so FSDP2's hooks
    and TP's block-input hooks stay eager around the graphs; TP's row-parallel output hooks sit on
    submodules inside the pieces and are traced into them. Layers of one kind share their graphs (one code
    object, parameters are graph inputs).
    """
    # MoE: the tokens per expert are data (the loop's host sync, grouped_mm's offsets), so a graph
    # around the routed experts would break there or specialise on each batch's counts; the shared expert is a
    # dense SwiGLU on every token, the one fixed-shape piece worth a graph (the router is one small matmul).
    mlp = layer.mlp.shared_expert if isinstance(layer.mlp, MoE) else layer.mlp
    for module in (layer.input_layernorm, layer.post_attention_layernorm, mlp):
        module.forward = _compile(module.forward)
    if layer.layer_type == FULL_ATTENTION:
        attn = layer.self_attn
        attn.project, attn.gate_output = _compile(attn.project), _compile(attn.gate_output)
    else:
        gdn = layer.linear_attn
        gdn.project, gdn.norm_output = _compile(gdn.project), _compile(gdn.norm_output)
        gdn.decay.forward = _compile(gdn.decay.forward)  # an FSDP unit of its own (fp32): hooks stay outside


class Qwen3_5Model(nn.Module):
    """The text decoder (one pipeline stage of it when `layer_ids`/`embed`/`head` say so).

    Vision hook: when `cfg.vision` is set and `embed` is true, `self.visual = vision.build_vision(cfg)` (owned
    by the VLM code); its forward(input_ids, inputs_embeds, pixel_values, image_grid_thw) returns the merged
    embeddings. Its parameters `visual.*` map one-to-one to HF `model.visual.*`.
    """

    def __init__(self, cfg: ModelConfig, layer_ids=None, embed: bool = True, head: bool = True,
                 kernels: str = "torch", ce_chunk_tokens: int = 0, attention_kernel: str = "auto",
                 ce_kernel: str = "torch", moe_kernel: str = "auto"):
        super().__init__()
        t = cfg.text
        self.cfg = cfg
        ids = range(t.num_hidden_layers) if layer_ids is None else list(layer_ids)
        bad = [i for i in ids if not 0 <= i < t.num_hidden_layers]
        if bad:
            raise ValueError(f"layer_ids {bad} out of range for num_hidden_layers={t.num_hidden_layers}")
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size) if embed else None
        self.visual = None
        if cfg.vision is not None and embed:
            from .vision import build_vision

            self.visual = build_vision(cfg)
        self.rotary = RotaryEmbedding(t)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(t, i, kernels, attention_kernel, moe_kernel) for i in ids})
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps) if head else None
        self.lm_head = LMHead(t.hidden_size, t.vocab_size, ce_chunk_tokens, ce_kernel) if head else None
        self.tie_weights()

    def tie_weights(self):
        """Share lm_head with embed_tokens when tied and both live in this module (call again after to_empty)."""
        if self.cfg.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def init_buffers(self):
        """Recompute non-persistent buffers (garbage after meta init + `to_empty`)."""
        self.rotary.reset()

    def router_stats(self) -> dict[int, RouterStats]:
        """{layer id: routing of the last forward} for this module's MoE layers (empty for a dense model); feed
        `moe.load_balancing_loss` (after the forward, before the backward) or log `load_e` per expert."""
        return {int(i): layer.mlp.stats for i, layer in self.layers.items() if isinstance(layer.mlp, MoE)}

    def to_dtype(self, dtype: torch.dtype) -> "Qwen3_5Model":
        """Cast parameters to `dtype`, keeping GDN's A_log / dt_bias in at least fp32 (works on meta too)."""
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                p.data = p.data.to(param_dtype(name, dtype))
        return self

    def forward(self, input_ids=None, hidden_states=None, position_ids=None, cu_seqlens=None,
                pixel_values=None, image_grid_thw=None, inputs_embeds=None, labels=None,
                router_mask=None, routing=None, return_routing: bool = False):
        """First stage: `input_ids` [B, T] (or `inputs_embeds` [B, T, H], replacing the embedding lookup);
        later stages: `hidden_states` [B, T, H]. position_ids [B, T] or [3, B, T] (M-RoPE); None = 0.. per
        row, or per document when `cu_seqlens` (int32 offsets into the flattened B*T) is given.
        Returns logits [B, T, V] when this module has the head, else hidden states. With `labels` [B, T]
        (IGNORE_INDEX = no loss) the head returns instead the fp32 CE summed over labelled tokens, `ce_chunk_tokens`
        tokens at a time so the whole logits never exist (`qwenft.models.linear_ce.LMHead`). Stages without
        the head ignore `labels`. `router_mask` [B, T] bool (MoE): the tokens the router statistics count, e.g.
        not padding (transformers: its attention_mask); None = all.

        `return_routing=True` (MoE) returns `(output, routing)`: `routing` ([num_hidden_layers, 3, E],
        `moe.routing_rows`) is the given `routing` (an earlier pipeline stage's, None = zeros) plus this
        module's layers' routing of this forward, with grad, for the aux loss (`moe.routing_aux_loss`)."""
        if self.embed_tokens is not None and hidden_states is None:
            if inputs_embeds is None:
                if input_ids is None:
                    raise ValueError("the first stage needs input_ids or inputs_embeds")
                inputs_embeds = self.embed_tokens(input_ids)
                if pixel_values is not None:
                    if self.visual is None:
                        raise ValueError("pixel_values given but the model has no vision tower (cfg.vision is None)")
                    inputs_embeds = self.visual(input_ids, inputs_embeds, pixel_values, image_grid_thw)
            h = inputs_embeds
        else:
            h = hidden_states if hidden_states is not None else inputs_embeds
            if h is None:
                raise ValueError("a stage without embed_tokens needs hidden_states [B, T, H]")
        B, T = h.shape[:2]
        if position_ids is None:
            if image_grid_thw is not None and input_ids is not None:  # images shift later text positions
                from .vision import mrope_position_ids

                position_ids = mrope_position_ids(input_ids, image_grid_thw, self.cfg, cu_seqlens=cu_seqlens)
            elif cu_seqlens is None:
                position_ids = torch.arange(T, device=h.device).expand(B, T)
            else:
                position_ids = positions_in_document(cu_seqlens, B * T).view(B, T)
        rope = self.rotary(position_ids, h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, cu_seqlens, router_mask)
        out = h if self.lm_head is None else self.lm_head(self.norm(h), labels=labels)
        if not return_routing:
            return out
        t = self.cfg.text
        own = routing_rows(self.router_stats(), t.num_hidden_layers, t.num_experts, h)
        return out, own if routing is None else routing + own
