"""The training loss is the token CE summed over label tokens, divided by the global batch's label count;
both halves live in qwenft.models.loss, where the pipeline schedule's loss can reach them too."""

from qwenft.models.loss import count_label_tokens, token_ce_sum  # noqa: F401
