"""The (pp, dp, cp, tp) layout a config's mesh asks for, with the expert-parallel ep carved from dp, checked against
a world size: the one divisibility check that training, `qwenft plan` and `qwenft slurm` share."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    tp: int
    ep: int = 1  # expert parallel: groups of ep dp ranks share out the routed experts (dp = dp / ep x ep)
    cp: int = 1  # context parallel: each microbatch's stream split into cp contiguous spans

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


def resolve_layout(tp: int, pp: int, dp: int, world_size: int, ranks: str | None = None, ep: int = 1,
                   cp: int = 1) -> Layout:
    """Check the requested degrees against the world size before anything is built; dp=-1 takes what the
    world size leaves. `ranks` says where the world size comes from (e.g. the launcher keys), for the error."""
    if cp < 1:
        raise ValueError(f"mesh.cp={cp}; valid: a positive number of context-parallel ranks (1 = no split)")
    names = f"mesh.tp={tp} x mesh.pp={pp}" + (f" x mesh.cp={cp}" if cp > 1 else "")
    fixed = tp * pp * cp
    if world_size % fixed != 0:
        product = f"{names} = {fixed} does not divide"
        raise ValueError(f"{ranks}, but {product} {world_size}" if ranks else
                         f"{product} the world size {world_size}")
    if dp == -1:
        dp = world_size // fixed
    if fixed * dp != world_size:
        product = f"{names} x mesh.dp={dp} = {fixed * dp}"
        raise ValueError(f"{ranks}, but {product}; set mesh.dp=-1 to infer it" if ranks else
                         f"{product} but the world size is {world_size}; set mesh.dp=-1 to infer it")
    if dp % ep:
        valid = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(f"mesh.ep={ep} does not divide the data-parallel size mesh.dp={dp} (experts are shared out "
                         f"over ep of the dp ranks); valid mesh.ep: {valid}")
    return Layout(pp=pp, dp=dp, tp=tp, ep=ep, cp=cp)
