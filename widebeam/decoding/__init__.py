"""How a request turns its rows of a step's logits into tokens: logits processors, the sampling
and beam decoders behind one interface, and stop strings. Knows nothing of KV blocks or models."""
