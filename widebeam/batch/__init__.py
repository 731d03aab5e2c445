"""Offline batch jobs: a dataset of prompts in, every beam out (`widebeam batch`, `run`)."""

from widebeam.batch.files import read_output
from widebeam.batch.run import BatchSummary, run

__all__ = ["BatchSummary", "read_output", "run"]
