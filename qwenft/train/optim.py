"""AdamW (torch's, or `LowPrecisionAdamW` for bf16 state / bf16 weights) and the warmup + decay lr schedule."""

import functools
import math

import torch


def build_optimizer(params, lr: float, weight_decay: float, betas, eps: float, fused: str,
                    state_dtype: str = "float32", seed: int = 0) -> torch.optim.Optimizer:
    """torch's AdamW (fused on CUDA) for fp32 state and fp32 parameters; `LowPrecisionAdamW` when the moments
    are bf16 (`optim.state_dtype`) or a parameter is (`optim.master_dtype`).

    `weight_decay` applies only where `decays` says (parameters of 2+ dims); the others are in groups of their
    own with weight_decay 0.0. DTensor and plain parameters (tensor parallelism without FSDP2) are apart too:
    torch's foreach and fused steps run per group and refuse to mix the two kinds in one call. So up to 4 groups,
    none empty, each all-decaying or all-not. Checkpoints name optimizer state per parameter, not per group, so
    they resume across layouts and across group splits (older qwenft's, which decayed every parameter, too)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.requires_grad]
    on_cuda = any(p.device.type == "cuda" for p in params)
    groups = []
    for is_dtensor in (True, False):
        for decay in (True, False):
            kind = [p for p in params if isinstance(p, DTensor) == is_dtensor and decays(p) == decay]
            if kind:
                groups.append({"params": kind} if decay else {"params": kind, "weight_decay": 0.0})
    if state_dtype != "float32" or any(p.dtype == torch.bfloat16 for p in params):
        kernel = fused_kernel_available() and on_cuda
        if fused == "true" and not kernel:
            raise ValueError(f"optim.fused=true with bf16 state or weights (optim.state_dtype={state_dtype}) needs "
                             f"CUDA parameters and Triton for qwenft's fused AdamW kernel; set optim.fused=auto")
        return LowPrecisionAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                 state_dtype=getattr(torch, state_dtype), seed=seed,
                                 fused=kernel and fused != "false")
    use_fused = on_cuda if fused == "auto" else fused == "true"
    if use_fused and not on_cuda:
        raise ValueError("optim.fused=true needs CUDA parameters; use optim.fused=auto or false on CPU")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=use_fused or None, foreach=None if use_fused else True)


def decays(p: torch.Tensor) -> bool:
    """Whether optim.weight_decay applies to `p` (Megatron's and HF's rule): matrices, embeddings, conv kernels,
    LoRA A/B and experts (2+ dims) decay; norm weights, biases and GatedDeltaNet's A_log / dt_bias (1 dim) do
    not. A DTensor's `ndim` is its global one, and a shard keeps its tensor's dims, so every layout agrees."""
    return p.ndim >= 2


def fused_kernel_available() -> bool:
    """Whether `LowPrecisionAdamW(fused=True)` can run: its kernel is Triton's, on CUDA."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 / TP DTensor's local shard (shares storage: in-place updates land in the DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _chunks(tensors: list[torch.Tensor], size: int) -> list[tuple[torch.Tensor, ...]]:
    """Matching views of same-shape `tensors` of at most `size` elements each (the whole tensors unless all
    are contiguous)."""
    numel = tensors[0].numel()
    if numel <= size or not all(t.is_contiguous() for t in tensors):
        return [tuple(tensors)]
    flats = [t.view(-1) for t in tensors]
    return [tuple(f[i:i + size] for f in flats) for i in range(0, numel, size)]


def _seed(*parts: int) -> int:
    h = 0
    for part in parts:  # splitmix64-style mixing: distinct (seed, step, param, chunk) -> unrelated streams
        h = (h ^ (part + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) * 0xBF58476D1CE4E5B9 % 2**64
    return h % 2**63


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator) -> None:
    """Write fp32 `src` into bf16 `dst`, rounding up or down at random with the probability that makes the
    result unbiased (E[dst] = src): add 16 random bits below bf16's last mantissa bit, then truncate.
    Round-to-nearest drops every update smaller than half a bf16 ulp (2^-9..2^-8 of the weight): AdamW steps of
    lr = 1e-5 on weights of 0.02, where half an ulp is 6e-5, would all be lost. `src` is used as scratch."""
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    bits = src.view(torch.int32)
    bits.add_(noise).bitwise_and_(-65536)  # sign-magnitude: the carry rounds the magnitude up
    dst.copy_(src)  # exact: the low 16 bits are zero


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW whose moments may be stored in bf16 (`state_dtype`) and whose bf16 parameters get their update
    with stochastic rounding, so no fp32 master copy is needed.

    Each step computes in fp32: parameters, gradients and moments are upcast, updated with the formulas of
    torch.optim.AdamW (foreach, decoupled weight decay), and written back in their own dtypes: bf16 moments
    and bf16 parameters rounded stochastically (`stochastic_rounding=False`: to nearest), fp32 ones as they
    are. With fp32 parameters and fp32 state it computes exactly what torch's foreach AdamW does.
    `fused=True` (CUDA, Triton) does each tensor's whole update in one kernel pass, a parameter group's tensors
    in one launch (qwenft.train.adamw_kernel): the same formulas, a tenth of the memory traffic, its own random
    bits.

    Works on FSDP2 / TP DTensor parameters through their local shards. The work is foreach over views of at
    most `chunk_numel` elements at a time, so the fp32 temporaries stay under 6 x 4 x `chunk_numel` bytes (0.8 GB
    at 2^25) even for a 248,320 x 5120 embedding. The random bits of each chunk come from a generator seeded by
    (seed, step, parameter index, chunk), not the global RNG: identical replicas (tensor parallel ranks
    holding a replicated norm weight) round identically, and a run resumed on the same layout rounds as the
    original did (the index follows the parameter order, which the layout sets).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 *, state_dtype: torch.dtype = torch.float32, stochastic_rounding: bool = True, seed: int = 0,
                 chunk_numel: int = 2**25, fused: bool = False):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"optim.state_dtype={state_dtype} is not valid; choose float32 or bfloat16")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.chunk_numel = chunk_numel
        self.fused = fused
        self._fused = None
        if fused:
            from qwenft.train.adamw_kernel import FusedAdamW

            self._fused = FusedAdamW()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._grad_scales: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's factor in the next step
        self._stepped: list[torch.Tensor] = []  # the parameters whose step counts the last step moved (`unstep`)

    def scale_grads(self, params, scale: torch.Tensor) -> None:
        """Multiply `params`' gradients by `scale` (a 0-dim fp32 tensor: gradient clipping's coefficient) inside
        the next step, in fp32, instead of in place now: the fused kernel reads each gradient once either way, so
        the clip costs no pass of its own over them. The gradients themselves stay as they are. Cleared by the
        step and by `zero_grad` (a skipped step). Scales given twice for a parameter multiply, as two in-place
        clips would."""
        for p in params:
            prev = self._grad_scales.get(id(p))
            self._grad_scales[id(p)] = scale if prev is None else prev * scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scales.clear()
        super().zero_grad(set_to_none=set_to_none)

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device].manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None, skip_if: torch.Tensor | None = None):
        """One AdamW step. `skip_if`: a bool tensor on the parameters' device; where it is true the step leaves
        weights and moments as they were, decided by the fused kernel on the GPU (the host queues the step without
        waiting for the flag; other paths read it). The step counts move on the host either way: `unstep` takes
        them back once the host has read the flag."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._step(skip_if)
        finally:
            self._grad_scales.clear()
        return loss

    def unstep(self) -> None:
        """Take back the step counts of the last `step`, whose update `skip_if` skipped."""
        for p in self._stepped:
            self.state[p]["step"] -= 1
        self._stepped = []

    def _step(self, skip_if: torch.Tensor | None) -> None:
        if self.fused:
            from qwenft.train.adamw_kernel import AdamWTensor

        @functools.cache
        def host_skips() -> bool:  # the torch ops' path: the flag read on the host, once
            return skip_if is not None and bool(skip_if.item())

        self._stepped = []
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            batch, batch_numel, fused = [], 0, []
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                self._stepped.append(p)
                step = state["step"].item()
                # as torch's foreach AdamW: Python-float bias corrections per parameter
                step_size = (lr / (1 - beta1**step)) * -1
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                scale = self._grad_scales.get(id(p))
                if self.fused and all(t.is_cuda and t.is_contiguous() for t in tensors):
                    fused.append(AdamWTensor(*tensors, step_size, bias_correction2_sqrt,
                                             _seed(self.seed, int(step), index), scale))
                    continue
                parts = _chunks(tensors, self.chunk_numel)
                for chunk_id, views in enumerate(parts):
                    if batch and batch_numel + views[0].numel() > self.chunk_numel:
                        self._update(batch, group, host_skips)
                        batch, batch_numel = [], 0
                    batch.append((views, step_size, bias_correction2_sqrt, _seed(self.seed, int(step), index, chunk_id),
                                  scale))
                    batch_numel += views[0].numel()
            if batch:
                self._update(batch, group, host_skips)
            if fused:
                self._fused.update_(fused, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                                    weight_decay=group["weight_decay"], stochastic_rounding=self.stochastic_rounding,
                                    skip_if=skip_if)

    def _update(self, batch: list, group: dict, host_skips) -> None:
        if host_skips():
            return
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        params, grads, exp_avgs, exp_avg_sqs = (list(ts) for ts in zip(*(views for views, *_ in batch)))
        step_sizes = [b[1] for b in batch]
        bias_correction2_sqrts = [b[2] for b in batch]
        # fp32 work tensors; an fp32 tensor is its own work tensor (.float() returns it), updated in place
        params32, exp_avgs32, exp_avg_sqs32 = ([t.float() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs))
        # the gradients in fp32, times their clip coefficient where one is pending (never in place on `.grad`)
        grads32 = [g.float() for g in grads]
        grads32 = [g32 if b[4] is None else g32.mul_(b[4]) if g32 is not g else g32 * b[4]
                   for g32, g, b in zip(grads32, grads, batch)]
        if weight_decay != 0:
            torch._foreach_mul_(params32, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs32, grads32, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs32, beta2)
        torch._foreach_addcmul_(exp_avg_sqs32, grads32, grads32, 1 - beta2)
        del grads32
        denom = torch._foreach_sqrt(exp_avg_sqs32)
        torch._foreach_div_(denom, bias_correction2_sqrts)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params32, exp_avgs32, denom, step_sizes)
        del denom
        for (views, _, _, seed, _), work in zip(batch, zip(params32, exp_avgs32, exp_avg_sqs32)):
            for i, (dst, src) in enumerate(zip((views[0], views[2], views[3]), work)):
                if dst is src:
                    continue
                if self.stochastic_rounding and dst.dtype == torch.bfloat16:
                    stochastic_round_(dst, src, self._generator(src.device, seed + i))
                else:
                    dst.copy_(src)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then the moments back in `state_dtype`: torch casts every loaded state tensor to its
        parameter's dtype, which would turn bf16 moments of fp32 weights into fp32 (or round fp32 moments of
        bf16 weights to bf16)."""
        moments = {pid: {k: v for k, v in s.items() if k != "step"} for pid, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = dict(zip(ids, params))
        for pid, values in moments.items():
            p = by_id[pid]
            for key, value in values.items():
                self.state[p][key] = value.to(device=p.device, dtype=self.state_dtype)


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1))  # last step: min lr
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, decay, min_lr_ratio))
