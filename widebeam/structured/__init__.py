"""Structured output: `response_format` (JSON mode, JSON schema) as a grammar constraint per beam."""
