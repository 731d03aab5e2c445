"""Admission and scheduling of requests onto the KV cache."""
