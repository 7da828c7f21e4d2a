"""Token cross-entropy summed over label tokens; the runner divides by the global batch's label count."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over tokens whose label is not IGNORE_INDEX, in fp32.

    Labels are already shifted by the data pipeline: labels[:, t] is the token that follows input t.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def count_label_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
