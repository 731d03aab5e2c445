"""From a `model=` string to weights and a tokenizer: sources, the hub, checkpoints, building."""
