"""Pipeline parallelism: split the decoder into stages, place them on pp ranks, run a torch schedule.

    layers = split.split_layers(64, 4, ...)           # [[0..15], [16..31], ...], balanced with embed/head cost
    ids = split.stage_ids_for_rank(pp_rank, pp, virtual, v_shaped)
    module = stage.build_stage_model(cfg, layers[i], embed=i == 0, head=i == last)  # meta; then TP/AC/FSDP, load
    stages = [stage.ReduceGradStage(module, i, n_stages, device, pp_group, reduce_grad_per_microbatch)]
    sched = schedule.build_schedule("1f1b", stages, n_microbatches, loss_fn)
    loss = schedule.train_step(sched, stages, batch, loss_fn, label_tokens)

`split` places layers and stages, `stage` is what one stage runs (the model slice and the gradient knob),
`schedule` runs the microbatches of a step through the stages.

Microbatches have fixed shapes ([microbatch_size, seq_len]); cu_seqlens (document boundaries, variable
length) never travels between stages: every stage gets `position_ids` as a kwarg and rebuilds cu_seqlens
from it (positions restart at 0 at each packed document).
"""
