"""Native Qwen3.5 decoder: pipeline-split-safe, head-shardable, meta-init-safe.

Layers live in `layers: nn.ModuleDict` keyed by the original layer index, so a pipeline stage that owns a
subset still knows each layer's kind. Builds on the meta device with no compute; after `to_empty`, call
`init_buffers()` (the rotary `inv_freq` is a non-persistent buffer and is garbage after `to_empty`).
"""

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .attention import GatedAttention, RMSNorm, RotaryEmbedding, local_all
from .configs import FULL_ATTENTION, ModelConfig, TextConfig
from .gdn import GatedDeltaNet, param_dtype, positions_in_document
from .gdn_graph import GraphedMix
from .moe import MLP, MoE, RouterStats, routing_rows
from .mtp import MODES as MTP_MODES, MTPHead, next_in_document
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

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn

    def forward(self, h, rope, cu_seqlens=None, router_mask=None, cp=None):
        # three pieces: model.compile makes the first and the last one graph each (compile_layer); the mixer's
        # kernels between them stay eager and are all that reads cu_seqlens (and `cp`, a CPShard)
        kernel_inputs, carry = self.mixer_input(h, rope)
        out = self.mixer.mix(*kernel_inputs, cu_seqlens, **({"cp": cp} if cp is not None else {}))
        if isinstance(self.mlp, MoE):
            h, x = self.mixer_output(h, out, carry)
            return h + self.mlp(x, router_mask)
        return self.layer_output(h, out, carry)

    def mixer_input(self, h, rope):
        """The input norm and the mixer's projections -> (the kernel's inputs, what its output step takes)."""
        x = self.input_layernorm(h)
        if self.layer_type == FULL_ATTENTION:
            q, k, v, gate = self.self_attn.project(x, rope)
            return (q, k, v), gate
        qkv, z, beta, a = self.linear_attn.project(x)
        return (qkv, beta, a), z

    def mixer_output(self, h, out, carry):
        """The mixer's output step and the residual add -> (the residual stream, its post-attention norm)."""
        h = h + self.mixer.output(out, carry)
        return h, self.post_attention_layernorm(h)

    def layer_output(self, h, out, carry):
        """`mixer_output`, then the dense MLP and its residual add -> the layer's output."""
        h, x = self.mixer_output(h, out, carry)
        return h + self.mlp(x)


def _compile(fn, *owners: nn.Module, cuda_graphs: bool = False):
    """torch.compile(fn, dynamic=False), fed plain tensors: its inputs, and the parameters of `owners` (the
    modules whose weights `fn` reads). With `cuda_graphs`, in reduce-overhead mode: each graph (forward and
    backward) is recorded once as a CUDA graph and replayed, one launch instead of its kernels' host work.

    A tensor-parallel parameter is a DTensor. Given one, the graph would flatten it into its local tensor and
    wrap its gradient into a new DTensor at every call, and autograd would add that to `.grad` through DTensor's
    dispatch: host work per parameter and call, several times the graph's own launch cost on a small
    tensor-parallel shard (docs/performance.md, "Host time per decoder layer"). So for the call each DTensor
    parameter is swapped for its local tensor through `attention.local_all` (one autograd node for all of a
    graph's parameters), eager, as the layers without compile take them through `local`: its backward adds
    each local gradient to the parameter's `.grad`, and the graph sees plain tensors. The parameters are put
    back before the call returns (FSDP2 swaps the same slots around the layer).

    An input may arrive as AsyncCollectiveTensor (a functional collective not yet waited on). Given one
    directly, the compiled graph's backward is wrong on torch 2.13 (the gradient of whatever produced the input,
    e.g. a vocab-parallel embedding whose all-reduce is a functional one); a clone waits and gives eager's
    numbers, for one [B, T, H] copy.

    A CUDA graph copies each input into a buffer of its own at every replay, but for inputs that it may take at
    their address: the parameters, and the local tensors taken here, which are marked so (they are views of the
    local shards, at the same address at every call without FSDP2, which `check_cuda_graphs` rules out).
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    graph = torch.compile(fn, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)
    slots = [(m, name) for owner in owners for m in owner.modules() for name in m._parameters]

    @functools.wraps(fn)
    def call(*args):
        args = [a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args]
        swapped = [(m, name, m._parameters[name]) for m, name in slots if isinstance(m._parameters[name], DTensor)]
        trained = [p for _, _, p in swapped if p.requires_grad]
        taken = iter(local_all(trained) if trained else ())
        try:
            for m, name, p in swapped:  # a frozen parameter's local tensor as it is: no gradient to take
                m._parameters[name] = t = next(taken) if p.requires_grad else p._local_tensor
                if cuda_graphs:
                    torch._dynamo.mark_static_address(t)
            return graph(*args)
        finally:
            for m, name, p in swapped:
                m._parameters[name] = p

    return call


def compile_layer(layer: DecoderLayer, cuda_graphs: bool = False, gdn_graphs: bool = False) -> None:
    """torch.compile the fixed-shape pieces of one decoder layer (`model.compile=true`), in place; with
    `cuda_graphs` (`model.cuda_graphs=true`) each graph is replayed as a CUDA graph (`_compile`), and with
    `gdn_graphs` a GatedDeltaNet layer's fla kernels too (gdn_graph.py).

    Two graphs a layer: `mixer_input` (the input norm and the mixer's projections: q/k/v/gate, q/k norms and
    rotary; GDN's six projections and beta's sigmoid) and `layer_output` (the mixer's output step: the sigmoid
    gate or GDN's gated norm, o_proj / out_proj, the residual add, the post-attention norm, the MLP and its
    residual add). An MoE layer's output graph stops at the post-attention norm (`mixer_output`), and its
    shared expert is a graph of its own: the tokens per expert are data (the expert loop's host sync,
    grouped_mm's offsets), so a graph around the routed experts would break there or specialise on each batch's
    counts. GDN's fp32 decay is a third graph: FSDP2 shards it as a unit of its own, whose hooks stay eager.

    Left eager between the graphs: the mixer's `mix` (fla's Triton convs and delta rule, the torch reference,
    SDPA or varlen flash attention; with `gdn_graphs`, fla's GDN kernels are graphs of their own on fixed-shape
    layouts), the only piece that reads cu_seqlens, so a batch with a different number of
    documents reuses the graphs: every compiled input is [B, T, ...] of the fixed data.seq_len (dynamic=False).
    The layer's `forward` is not compiled, so FSDP2's hooks and the sequence-parallel split around the layer
    stay eager; TP's hooks on the norms (a block's input) and on the row-parallel projections (its output) are
    traced into the graphs. Layers of one kind share their graphs (one code object, parameters are graph inputs).
    """
    mixer = layer.mixer
    projections = ([mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.q_norm, mixer.k_norm]
                   if layer.layer_type == FULL_ATTENTION else [getattr(mixer, f"{p}_proj") for p in "qkvzab"])
    layer.mixer_input = _compile(layer.mixer_input, layer.input_layernorm, *projections, cuda_graphs=cuda_graphs)
    output = [mixer.o_proj] if layer.layer_type == FULL_ATTENTION else [mixer.norm, mixer.out_proj]
    if isinstance(layer.mlp, MoE):
        layer.mixer_output = _compile(layer.mixer_output, *output, layer.post_attention_layernorm,
                                      cuda_graphs=cuda_graphs)
        shared = layer.mlp.shared_expert
        shared.forward = _compile(shared.forward, shared, cuda_graphs=cuda_graphs)
    else:
        layer.layer_output = _compile(layer.layer_output, *output, layer.post_attention_layernorm, layer.mlp,
                                      cuda_graphs=cuda_graphs)
    if layer.layer_type != FULL_ATTENTION:
        mixer.decay.forward = _compile(mixer.decay.forward, mixer.decay, cuda_graphs=cuda_graphs)
        if gdn_graphs:
            mixer.graphs = GraphedMix(mixer.fla_kernels)


def compile_norms(model: "Qwen3_5Model") -> None:
    """torch.compile the norms outside the decoder layers (`model.compile=true`), in place, through `_compile` as
    `compile_layer` does a layer's pieces: the final norm of a module that holds the head, and the MTP head's
    three. Eager, a norm's fp32 cast, square, mean, products and cast back each pass over the whole [B, T,
    hidden] stream, and their backward more: on every tensor-parallel rank alike, where the layers' norms are in
    their graphs. One graph, which all of them share (one code, the same shapes), reads and writes the stream
    once each way. Never a CUDA graph (model.cuda_graphs): a kernel or two each way cost the host little, and the
    outputs and the weights' gradients stay ordinary tensors, outside a graph's pool that the next replay
    overwrites (`runner.keep_grads`)."""
    norms = [model.norm] if model.norm is not None else []
    if model.mtp is not None:
        norms += [model.mtp.pre_fc_norm_embedding, model.mtp.pre_fc_norm_hidden, model.mtp.norm]
    for norm in norms:
        norm.forward = _compile(norm.forward, norm)


class Qwen3_5Model(nn.Module):
    """The text decoder (one pipeline stage of it when `layer_ids`/`embed`/`head` say so).

    Vision hook: when `cfg.vision` is set and `embed` is true, `self.visual = vision.build_vision(cfg)` (owned
    by the VLM code); its forward(input_ids, inputs_embeds, pixel_values, image_grid_thw) returns the merged
    embeddings. Its parameters `visual.*` map one-to-one to HF `model.visual.*`.
    """

    def __init__(self, cfg: ModelConfig, layer_ids=None, embed: bool = True, head: bool = True,
                 kernels: str = "torch", ce_chunk_tokens: int = 0, attention_kernel: str = "auto",
                 ce_kernel: str = "torch", moe_kernel: str = "auto", mtp: str = "keep"):
        super().__init__()
        t = cfg.text
        if mtp not in MTP_MODES:
            raise ValueError(f"model.mtp={mtp!r} is not valid; choose one of {', '.join(MTP_MODES)}")
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
        self.cp_group = None  # the context-parallel ranks' group (`context_parallel.apply_cp`), None: no split
        self.cp_balanced = False  # full attention's queries by halves over the cp ranks (mesh.cp_balanced_attention)
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps) if head else None
        self.lm_head = LMHead(t.hidden_size, t.vocab_size, ce_chunk_tokens, ce_kernel) if head else None
        # model.mtp=train|head: the multi-token-prediction head sits with lm_head; every stage knows the mode, since
        # the embeddings it takes travel from the first stage (`forward`)
        self.mtp_mode = mtp
        self.mtp = MTPHead(t, kernels, attention_kernel, moe_kernel) if head and mtp != "keep" else None
        self.tie_weights()

    def tie_weights(self):
        """Share lm_head with embed_tokens when tied and both live in this module (call again after to_empty)."""
        if self.cfg.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def init_buffers(self):
        """Recompute non-persistent buffers (garbage after meta init + `to_empty`)."""
        self.rotary.reset()

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers this module holds: the trunk's, then the MTP head's (tensor parallelism, activation
        checkpointing, compile and FSDP treat them alike)."""
        return list(self.layers.values()) + ([] if self.mtp is None else list(self.mtp.layers.values()))

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
                pixel_values_videos=None, video_grid_thw=None,
                router_mask=None, routing=None, return_routing: bool = False, mtp_embeds=None, mtp_labels=None):
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
        module's layers' routing of this forward, with grad, for the aux loss (`moe.routing_aux_loss`).

        model.mtp=train|head (`mtp_mode`): the first stage takes each position's next-token embedding
        (`mtp.next_in_document` of its input embeddings, images scattered in) and a stage without the head returns
        it after its output (and routing) for the next stage, which takes it as `mtp_embeds`. The head, given
        `mtp_labels` (`mtp.mtp_labels`, cut to the cp span like `labels`), runs the MTP head and adds to its output
        the MTP CE sum and its top-1 hits: `(out, [routing,] mtp_ce, mtp_hits)`. In `head` mode the head's inputs
        and lm_head's weight are detached for it, so the trunk learns nothing from the MTP loss."""
        first = self.embed_tokens is not None and hidden_states is None
        if first:
            if inputs_embeds is None:
                if input_ids is None:
                    raise ValueError("the first stage needs input_ids or inputs_embeds")
                inputs_embeds = self.embed_tokens(input_ids)
                if pixel_values is not None or pixel_values_videos is not None:
                    if self.visual is None:
                        raise ValueError("pixel_values given but the model has no vision tower (cfg.vision is None)")
                    inputs_embeds = self.visual(input_ids, inputs_embeds, pixel_values, image_grid_thw,
                                                pixel_values_videos, video_grid_thw)
            h = inputs_embeds
        else:
            h = hidden_states if hidden_states is not None else inputs_embeds
            if h is None:
                raise ValueError("a stage without embed_tokens needs hidden_states [B, T, H]")
        # carried to a later stage, or used here when the head runs (not in an evaluation without its targets)
        if first and self.mtp_mode != "keep" and (self.lm_head is None or mtp_labels is not None):
            mtp_embeds = next_in_document(h)
        B, T = h.shape[:2]
        if position_ids is None:
            if (image_grid_thw is not None or video_grid_thw is not None) and input_ids is not None:
                from .vision import mrope_position_ids  # images and videos shift later text positions

                position_ids = mrope_position_ids(input_ids, image_grid_thw, self.cfg, cu_seqlens=cu_seqlens,
                                                  video_grid_thw=video_grid_thw)
            elif cu_seqlens is None:
                position_ids = torch.arange(T, device=h.device).expand(B, T)
            else:
                position_ids = positions_in_document(cu_seqlens, B * T).view(B, T)
        cp = None
        if self.cp_group is not None:  # the seam: from here on this rank holds its span of the stream
            from .context_parallel import cp_shard

            cp = cp_shard(cu_seqlens, self.cp_group, self.cp_balanced)
            if first:
                h = cp.split(h)
                mtp_embeds = None if mtp_embeds is None else cp.split(mtp_embeds)
            position_ids = cp.split(position_ids, lead=position_ids.ndim - 2)
            router_mask = None if router_mask is None else cp.split(router_mask, fill=False)
        rope = self.rotary(position_ids, h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, cu_seqlens, router_mask, **({"cp": cp} if cp is not None else {}))
        extra = ()
        if self.lm_head is None:
            out = h
            if self.mtp_mode != "keep":
                extra = (mtp_embeds,)
        elif self.mtp is not None and mtp_labels is not None:
            normed = self.norm(h)
            detach = self.mtp_mode == "head"
            mtp_in = (normed.detach(), mtp_embeds.detach()) if detach else (normed, mtp_embeds)
            y = self.mtp(*mtp_in, rope, cu_seqlens, router_mask, cp)
            out, *extra = self.lm_head(normed, labels=labels, mtp=(y, mtp_labels, detach))
        else:
            out = self.lm_head(self.norm(h), labels=labels)
        if return_routing:
            t = self.cfg.text
            own = routing_rows(self.router_stats(), t.num_hidden_layers, t.num_experts, h)
            if cp is not None:  # the whole stream's routing on every span, as one process counts it
                from .context_parallel import all_reduce

                own = all_reduce(own, cp)
            extra = (own if routing is None else routing + own, *extra)
        return (out, *extra) if extra else out
