"""Model families: torch-free config parses (the plan reads them), the family table, and the torch
networks they build with their checkpoint names."""
