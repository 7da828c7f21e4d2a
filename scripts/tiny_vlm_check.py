"""Train the tiny VLM as recipes/tiny_vlm.yaml would, without the runner: a check that the loss falls.

    python scripts/tiny_vlm_check.py [steps]        # default 120, the recipe's max_steps

Same numbers as the recipe: seq_len 256, global batch 8 = 4 micro batches of 2, AdamW lr 3e-3 with 10
warmup steps and cosine decay to 0.1x, grad-norm clip 1.0, loss = token CE sum / label tokens of the step.
"""

import sys
import time

import torch

from qwenft.data.vlm import build_vlm_data, load_processor
from qwenft.models.freeze import freeze
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config
from qwenft.models.loss import count_label_tokens, token_ce_sum
from qwenft.train.evaluate import forward_batch
from qwenft.train.optim import build_optimizer, build_scheduler


def main(steps: int = 120) -> list[float]:
    torch.manual_seed(0)
    processor = load_processor("tiny_vlm")
    data = build_vlm_data("tiny_vlm", processor, seq_len=256, micro_batch_size=2)
    model = init_random_weights(build_model(named_config("tiny_vlm"), kernels="torch"), seed=0, device="cpu")
    freeze(model, vision=False, language=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, 3e-3, 0.0, (0.9, 0.95), 1e-8, "false")
    scheduler = build_scheduler(optimizer, 10, steps, "cosine", 0.1)
    losses, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        micro_batches = [next(data) for _ in range(4)]
        label_tokens = sum(count_label_tokens(mb["labels"]) for mb in micro_batches)
        loss_sum = 0.0
        for mb in micro_batches:
            logits = forward_batch(model, mb)  # with the microbatch's images and videos
            loss = token_ce_sum(logits, mb["labels"]) / label_tokens
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss_sum:.4f}  {time.perf_counter() - start:6.1f} s", flush=True)
    return losses


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 120)
