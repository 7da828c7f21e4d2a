"""Which layers each pipeline stage owns, and which stages each pp rank runs."""

# pipeline.schedule names by how they place stages and run the backward
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv", "dualpipev")  # exactly two stages per rank: r and 2*pp-1-r
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input and weight gradients in separate steps

# Stage cost in layer-equivalents of the parts that are not decoder layers (see docs/parallelism.md).
EMBED_COST = 1.0  # embedding lookup: little compute, but a vocab x hidden table with its grads + Adam state
VISION_COST = 1.0  # the vision tower, when the model has one
HEAD_COST = 1.0  # final norm + lm_head + loss: a vocab x hidden matmul and the CE over the vocabulary


def default_virtual_stages(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE else 2


def check_virtual_stages(schedule: str, virtual: int) -> None:
    if schedule in SINGLE_STAGE and virtual != 1:
        raise ValueError(f"pipeline.virtual_stages={virtual} but pipeline.schedule={schedule} runs one stage per "
                         f"rank; set pipeline.virtual_stages=1 or pick a multi-stage schedule")
    if schedule in V_SHAPED and virtual != 2:
        raise ValueError(f"pipeline.virtual_stages={virtual} but pipeline.schedule={schedule} needs exactly 2 "
                         f"stages per rank (V-shaped placement)")
    if virtual < 1:
        raise ValueError(f"pipeline.virtual_stages={virtual} must be >= 1")


def _balanced_split(num_layers: int, num_stages: int, first_cost: float, last_cost: float) -> list[int]:
    """Layers per stage, contiguous, each >= 1: minimal max stage cost, then the most even costs, then the most
    even layer counts (so 64 layers on 4 stages with 1 + 1 extra cost gives 16 each)."""
    def cost(stage: int, n: int) -> float:
        return n + (first_cost if stage == 0 else 0.0) + (last_cost if stage == num_stages - 1 else 0.0)

    # smallest achievable max stage cost: try candidates in increasing order
    candidates = sorted({cost(s, n) for s in range(num_stages) for n in range(1, num_layers + 1)})

    def best_under(limit: float):
        # dp[s][i]: (sum of squared costs, sum of squared layer counts, split) for the first i layers in s stages
        inf = (float("inf"), float("inf"), None)
        dp = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
        dp[0][0] = (0.0, 0, [])
        for s in range(num_stages):
            for i in range(num_layers + 1):
                if dp[s][i][2] is None:
                    continue
                for n in range(1, num_layers - i + 1):
                    c = cost(s, n)
                    if c > limit:
                        break
                    ss, sn, split = dp[s][i]
                    cand = (ss + c * c, sn + n * n, split + [n])
                    if cand[:2] < dp[s + 1][i + n][:2]:
                        dp[s + 1][i + n] = cand
        return dp[num_stages][num_layers][2]

    for limit in candidates:
        split = best_under(limit)
        if split is not None:
            return split
    raise AssertionError("no split found")  # unreachable when num_layers >= num_stages


def split_layers(num_layers: int, num_stages: int, has_vision: bool = False, layers_per_stage=None,
                 stage_layers=None) -> list[list[int]]:
    """Layer indices of each pipeline stage (stage 0 also owns embeddings + vision, the last the head + loss)."""
    if layers_per_stage is not None and stage_layers is not None:
        raise ValueError("pipeline.layers_per_stage and pipeline.stage_layers are both set; set one of them")
    if stage_layers is not None:
        if not all(isinstance(s, (list, tuple)) and all(_is_int(i) for i in s) for s in stage_layers):
            raise ValueError(f"pipeline.stage_layers={stage_layers}: expected a list of each stage's layer indices, "
                             f"e.g. [[0, 1], [2, 3]]")
        stage_layers = [list(s) for s in stage_layers]
        if len(stage_layers) != num_stages:
            raise ValueError(f"pipeline.stage_layers has {len(stage_layers)} stages but the pipeline has "
                             f"{num_stages} (mesh.pp x pipeline.virtual_stages)")
        flat = [i for s in stage_layers for i in s]
        if sorted(flat) != list(range(num_layers)) or flat != sorted(flat) or any(not s for s in stage_layers):
            raise ValueError(f"pipeline.stage_layers={stage_layers} must list every layer 0..{num_layers - 1} "
                             f"once, in order, with at least one layer per stage")
        return stage_layers
    if layers_per_stage is not None:
        if not all(_is_int(n) for n in layers_per_stage):
            raise ValueError(f"pipeline.layers_per_stage={layers_per_stage}: expected a list of each stage's layer "
                             f"count, e.g. [2, 2]")
        counts = list(layers_per_stage)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"pipeline.layers_per_stage={counts} must have {num_stages} entries "
                             f"(mesh.pp x pipeline.virtual_stages), each >= 1, summing to {num_layers} layers")
    else:
        if num_layers < num_stages:
            raise ValueError(f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
                             f"(mesh.pp x pipeline.virtual_stages)")
        counts = _balanced_split(num_layers, num_stages, EMBED_COST + (VISION_COST if has_vision else 0.0),
                                 HEAD_COST)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [list(range(start, start + n)) for start, n in zip(starts, counts)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stage_ids_for_rank(pp_rank: int, pp: int, virtual: int, v_shaped: bool) -> list[int]:
    """Stages a pp rank runs: looped (r, r + pp, ...) or, for V schedules, r and 2*pp-1-r."""
    if v_shaped:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


