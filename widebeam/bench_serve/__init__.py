"""`widebeam bench serve`: an open-loop load generator against any OpenAI-compatible server.

Requests arrive at times drawn in advance (arrivals.py), whatever the server answers, so a slow server
cannot slow its own load (a closed loop of N waiting clients hides overload). The flags and result keys
are vLLM's `vllm bench serve` where they exist; beside them, what beam search needs: a width mix, beams
and catalogue items per second, and rejections at admission (4xx) counted apart from failures.

One concept per module: arrivals (when), workloads (what), client (one request over HTTP), runner (the
schedule, the concurrency bound, the progress bar), metrics (the result dict), plot (a rate sweep's
PNG), cli (the flags). It is a client: nothing here imports the engine or torch.
"""
