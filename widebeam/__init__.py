"""widebeam: beam search at any width, with exact, beam-aware KV-cache accounting.

Vocabulary: a *block* holds `tokens_per_block` (T) *slots*; a *pool* is the blocks of one KV kind;
*required blocks* are the most a request can ever hold in a pool; *capacity* is what the pool has.
"""

from widebeam.errors import RequestTooLargeError

__version__ = "0.1.0"
__all__ = ["RequestTooLargeError", "__version__"]
