"""Speculative decoding: a draft proposes a small token tree per sequence, the target verifies every
node in one pass, and the request's own decoder replays its steps on the verified scores, so the
result is exactly what decoding without speculation gives (greedy and beam search: the same tokens
and scores; sampling: the same distribution). See docs/architecture.md, "Speculative decoding"."""
