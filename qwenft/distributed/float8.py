"""FP8 matmuls for the decoder's large linears (`model.fp8`), through torchao's float8 training.

`convert_fp8` swaps each linear named in `FP8_LINEARS` for torchao's `Float8Linear`: its weight stays the same
parameter (same name, dtype and sharding), and its forward and backward matmuls cast their operands to float8
with the recipe's scales (tensorwise, rowwise, or rowwise with the weight gradient's matmul in high precision).
Checkpoints hold the same keys with and without it, so a run resumes with the setting changed either way.

Which linears: the projections that carry a decoder layer's FLOPs, matched by their exact (block, name) pair
inside a decoder layer (the trunk's or the MTP head's), never by substring (`mlp.gate`, the router, must not
catch `gate_proj`). Everything else stays in the compute dtype: `lm_head` and the embeddings (their logits and
rows feed the loss directly), the MoE router and `shared_expert_gate`, GatedDeltaNet's `a_proj` / `b_proj`
(the decay and beta, a few columns), attention's `k_proj` / `v_proj` (4 key-value heads: small GEMMs that gain
little), the vision tower. A matched linear whose sizes are not multiples of 16 (float8 GEMMs need that) stays too.
"""

import functools

from torch import nn

from qwenft.conf.schema import CHOICES

RECIPES = CHOICES["model.fp8"]

# (block, linear) inside a decoder layer; native names: GatedDeltaNet's q/k/v_proj are HF's in_proj_qkv, z_proj
# its in_proj_z
FP8_LINEARS = frozenset({
    ("self_attn", "q_proj"), ("self_attn", "o_proj"),
    ("linear_attn", "q_proj"), ("linear_attn", "k_proj"), ("linear_attn", "v_proj"), ("linear_attn", "z_proj"),
    ("linear_attn", "out_proj"),
    ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
    ("shared_expert", "gate_proj"), ("shared_expert", "up_proj"), ("shared_expert", "down_proj"),
})


def fp8_target(fqn: str, module: nn.Module, tp: int = 1) -> bool:
    """Whether the module at `fqn` (a name inside a `Qwen3_5Model` or one of its stages) becomes float8: under
    `tp`-way tensor parallelism its sizes split by tp must stay multiples of 16 (a rank multiplies its shard)."""
    parts = fqn.split(".")
    in_layer = parts[0] == "layers" or parts[:2] == ["mtp", "layers"]
    return (in_layer and type(module) is nn.Linear and tuple(parts[-2:]) in FP8_LINEARS
            and module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0)


def convert_fp8(model: nn.Module, recipe: str, tp: int = 1) -> list[str]:
    """Swap `model`'s `FP8_LINEARS` for torchao's Float8Linear with `recipe` (on meta or real weights, before
    tensor parallelism, FSDP2 and compile); returns the converted names. Under tensor parallelism
    (`tensor_parallel._local_linear`) they become `sharded_float8_linear()`s."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = [fqn for fqn, module in model.named_modules() if fp8_target(fqn, module, tp)]
    chosen = set(converted)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    return converted


def describe(converted: list[str], recipe: str) -> str:
    """The start-log line: which linears run in float8, by kind, and how many."""
    kinds: dict[str, int] = {}
    for fqn in converted:
        kind = ".".join(fqn.split(".")[-2:])
        kinds[kind] = kinds.get(kind, 0) + 1
    listed = ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()))
    return (f"fp8: model.fp8={recipe} (torchao float8) on {len(converted)} linears ({listed}); lm_head, embeddings, "
            f"routers, shared_expert_gate, a_proj/b_proj, attention k_proj/v_proj and the vision tower stay in the "
            f"compute dtype")


@functools.cache
def sharded_float8_linear() -> type:
    """The class of a Float8Linear under qwenft's tensor parallelism: like `tensor_parallel.ShardedLinear`, its
    weight stays a DTensor and the forward multiplies the local shard, here through torchao's float8 matmul. Each
    rank scales its own shard (and, row-parallel, its slice of the input), so its float8 rounding is its own: the
    layer's outputs differ from one process's in float8's rounding, not more."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    from qwenft.models.qwen3_5.attention import local

    class ShardedFloat8Linear(Float8Linear):
        def forward(self, x):
            out = matmul_with_hp_or_float8_args.apply(x, local(self.weight).t(), self.linear_mm_config, self.config)
            # a row-parallel bias is replicated: the block's output all-reduce adds it once (ShardedLinear's rule)
            return out + local(self.bias).to(out.dtype) if self.sharded_bias else out

    return ShardedFloat8Linear
