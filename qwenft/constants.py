"""Values that the data pipeline and the model must agree on, below every other qwenft module."""

IGNORE_INDEX = -100  # the label of a token that has no loss (torch's cross_entropy default)
