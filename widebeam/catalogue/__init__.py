"""Catalogue-constrained beam search: a set of allowed token-id sequences (items) as a prefix trie
in flat device tensors (`trie.py`), and the logits processor that keeps every beam inside it
(`constraint.py`)."""
