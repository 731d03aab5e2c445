"""From a `model=` string to a model and tokenizer on a device: sources, the hub, the plan's arch
(torch-free), building."""
