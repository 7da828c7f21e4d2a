"""Activation and logits bytes per token of Qwen3.5's layers on the GPU kernels, and the microbatches a pipeline
rank holds: the estimated part of `qwenft plan` (qwenft.train.plan reads everything else from built modules)."""

from contextlib import contextmanager

import torch

from qwenft.models.qwen3_5.configs import FULL_ATTENTION, TextConfig

GDN_CHUNK = 64  # fla's chunk size: the delta rule keeps a [chunk] row of A per token and value head


@contextmanager
def saved_tensor_bytes(*exclude: torch.Tensor):
    """Inside the block, what autograd saves for the backward: yields {storage: bytes} of every distinct storage
    saved, leaving out those of `exclude` (parameters, the block's input), which exist anyway. The measured side
    of the estimates below (`scripts/bench.py activations`, tests/test_plan.py)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield saved


def layer_activation_bytes(t: TextConfig, kind: str, tp: int = 1, compute_bytes: int = 2,
                           sequence_parallel: bool = False) -> float:
    """Bytes autograd keeps per token for one decoder layer without activation checkpointing, on one tp rank.

    Counted tensor by tensor from the code, for the GPU kernels: flash attention, varlen or SDPA's (keeps q, k, v,
    output, log-sum-exp) and fla's GatedDeltaNet (keeps its conv inputs, l2-normalised q and k per value head,
    v, g, beta and A). A CPU forward of a 27B-shaped attention layer keeps 365,352 B/token by
    saved-tensor hooks; this gives 364,640 (tests/test_plan.py checks the attention layer against such a count).
    """
    c, H, F = compute_bytes, t.hidden_size, t.intermediate_size // tp
    norms = 2 * 8 * H / (tp if sequence_parallel else 1)  # 2 RMSNorms: fp32 input copy + fp32 normalised
    mlp = moe_activation_bytes(t, c) if t.is_moe else c * H + 4 * c * F  # dense: input; gate, silu, up, gate*up
    if kind == FULL_ATTENTION:
        q, kv, d = t.num_attention_heads // tp, t.num_key_value_heads // tp, t.head_dim
        mixer = (c * H  # q/k/v_proj input
                 + 8 * (q + kv) * d  # q_norm, k_norm: fp32 input copy + normalised output
                 + c * (q + 2 * kv) * d  # attention inputs after rotary: q, k, v
                 + c * q * d + 4 * q  # attention output, log-sum-exp
                 + 3 * c * q * d)  # sigmoid(gate), output reshaped, gated product (o_proj input)
    else:
        nk, nv = t.linear_num_key_heads // tp, t.linear_num_value_heads // tp
        dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
        mixer = (c * H  # q/k/v/z/a/b_proj input
                 + c * (2 * nk * dk + nv * dv)  # causal conv inputs
                 + c * nv * (2 * dk + dv)  # delta rule: l2-normalised q, k repeated per value head; v
                 + nv * (4 + c + 8 + c * GDN_CHUNK)  # g (fp32), beta, q/k rstd (fp32), A
                 + 3 * 4 * nv * dv  # gated norm: fp32 input copy, fp32 z, silu(z)
                 + 3 * c * nv * dv  # normalised (cast back), weighted, gated output (out_proj input)
                 + 16 * nv)  # decay: a and the softplus input, fp32
    return norms + mlp + mixer


def moe_activation_bytes(t: TextConfig, compute_bytes: int = 2) -> float:
    """Bytes autograd keeps per token for one MoE block (`qwenft.models.qwen3_5.moe.MoE`), counted from its code:
    each token is copied once per routed expert (top_k), and each copy keeps what a dense SwiGLU of the expert
    width keeps. tests/test_plan.py checks it against autograd's saved tensors (1%)."""
    c, H, E, k = compute_bytes, t.hidden_size, t.num_experts, t.num_experts_per_tok
    I, S = t.moe_intermediate_size, t.shared_expert_intermediate_size
    router = ((4 * H if c < 4 else 0)  # the block input in fp32, the router's matmul input
              + 4 * E  # softmax output
              + 8 * k + 4 * k + 4 + c * k  # top-k indices; top-k probabilities and their sum; the cast weights
              + 8 * k + 8 * k)  # the sort by expert and the token of each copy (int64)
    routed = c * k * (H  # the token copies, sorted by expert (the experts' input)
                      + 2 * I + I + I  # gate_up output, silu(gate), silu(gate) * up (down_proj input)
                      + H + H)  # the experts' outputs (index_copy keeps its source) and the unsorted copy
    shared = 4 * c * S + c * H + c  # shared expert as a dense SwiGLU; its output and sigmoid gate, multiplied
    return c * H + router + routed + shared  # c * H: the block input, shared by router, experts and shared expert


def layer_matmul_output_bytes(t: TextConfig, kind: str, tp: int = 1, compute_bytes: int = 2) -> float:
    """Bytes per token of one decoder layer's matmul and attention-kernel outputs on one tp rank: what
    model.activation_checkpointing=selective keeps besides the layer's input
    (qwenft.distributed.activation_checkpointing.save_matmuls): not the last, down_proj's. Row-parallel
    outputs (o_proj, out_proj) count whole: the saved mm output precedes tensor parallel's reduce. fla's
    delta rule is recomputed, so GDN keeps only its projections. MoE: the router's fp32 logits and the shared
    expert's three projections (the block's last matmul is the shared expert's 1-wide gate); the routed experts
    run as torch._grouped_mm on GPUs (model.kernels.moe=auto), which selective does not keep."""
    c, H, F = compute_bytes, t.hidden_size, t.intermediate_size // tp
    if t.is_moe:
        mlp = 4 * t.num_experts + c * (2 * t.shared_expert_intermediate_size + H)
    else:
        mlp = c * 2 * F  # gate_proj, up_proj
    if kind == FULL_ATTENTION:
        q, kv, d = t.num_attention_heads // tp, t.num_key_value_heads // tp, t.head_dim
        mixer = (c * 2 * (q + kv) * d  # q_proj (query and gate), k_proj, v_proj
                 + c * q * d + 4 * q  # attention output, log-sum-exp
                 + c * H)  # o_proj
    else:
        nk, nv = t.linear_num_key_heads // tp, t.linear_num_value_heads // tp
        dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
        mixer = c * (2 * nk * dk + 2 * nv * dv + 2 * nv + H)  # q/k/v/z/a/b_proj, out_proj
    return mlp + mixer


def vision_activation_bytes(vision: dict, compute_bytes: int = 2, checkpointing: bool = False) -> float:
    """Bytes per image patch for the vision tower (ViT blocks: 2 LayerNorms, attention, GELU MLP; merger).
    With `checkpointing` (model.vision_activation_checkpointing) each block keeps its input only, plus one
    block's activations while it is recomputed."""
    c, h, i = compute_bytes, vision["hidden_size"], vision["intermediate_size"]
    block = c * (8 * h + 2 * i)  # norm1 in/out, q, k, v, attention out, norm2 in/out, fc1 out, act out
    merger = 3 * c * h
    if checkpointing:
        return vision["depth"] * c * h + block + merger
    return vision["depth"] * block + merger


def microbatches_in_flight(schedule: str, pp: int, pp_rank: int, virtual: int, n: int) -> int:
    """Forward chunks (one stage x one microbatch) whose activations a pp rank holds at its peak, from the
    warm-up counts of torch's schedules (torch.distributed.pipelining, 2.13). pp = 1: gradient accumulation
    runs one microbatch at a time. zbv / dualpipev: 2 x pp is an upper bound."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n
    if schedule == "1f1b":
        return min(n, pp - pp_rank)
    if schedule == "looped_bfs":
        return virtual * n
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        per_hop = 2 if schedule == "interleaved_1f1b" else 1
        return min(virtual * n, (virtual - 1) * pp + per_hop * (pp - 1 - pp_rank) + 1)
    return min(2 * n, 2 * pp)


def logits_bytes(vocab: int, tokens: int, compute_bytes: int, *, vocab_parallel: bool, pipelined: bool,
                 ce_chunk_tokens: int = 0, fused_hidden: int = 0) -> tuple[int, int]:
    """(peak while the loss of one microbatch is computed, bytes kept until its backward) of the lm_head
    logits and the fp32 cross-entropy. `vocab` is this rank's share of the vocabulary; `pipelined`: a
    pipeline stage keeps its output (the logits) for the backward. `fused_hidden` (the hidden size): the fused
    linear CE, which holds one chunk's logits in the compute dtype and keeps the head's weight and input
    gradients, formed in the forward, until the backward; vocab-parallel, each rank's logits and weight gradient
    cover its share of the vocabulary, and only fp32 numbers per token are all-reduced."""
    c = compute_bytes
    if fused_hidden:  # qwenft.models.linear_ce.fused_linear_ce_sum
        kept = c * fused_hidden * (vocab + tokens)
        return c * vocab * min(ce_chunk_tokens or tokens, tokens) + 4 * tokens + kept, kept
    held_logits = c if pipelined else 0
    if ce_chunk_tokens:  # qwenft.models.linear_ce: one chunk's logits at a time; keeps a log-sum-exp per token
        return (c + 8) * vocab * min(ce_chunk_tokens, tokens) + 4 * tokens, 4 * tokens
    if vocab_parallel:  # loss._VocabParallelCE: fp32 copy and shifted copy, then the softmax it keeps
        return (c + 8) * vocab * tokens, (4 + held_logits) * vocab * tokens
    fp32_copy = 4 if c < 4 else 0
    forward = c + fp32_copy + 4  # logits, fp32 copy, log-softmax
    backward = 12 + held_logits  # log-softmax, its gradient, the gradient of its input
    return max(forward, backward) * vocab * tokens, (4 + held_logits) * vocab * tokens

