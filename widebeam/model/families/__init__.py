"""Model families: torch-free config parses (the plan reads them) beside the torch networks they build."""
