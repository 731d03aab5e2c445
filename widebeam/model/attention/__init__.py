"""Attention on the paged KV cache: step metadata, backends, the paged layer, cross-attention."""
