"""Views of widebeam's internals that only tests read; they live here so the package carries no API
that nothing of its own uses."""

from __future__ import annotations


def live_cumulative_logprobs(state) -> list[float]:
    """A `BeamSearchState`'s live beams' cumulative log-probs (float32 values), in live-beam order:
    what the ranking tests compare against transformers and against a slower reference."""
    return list(state._live_scores)


def record_schedules(engine) -> list:
    """Every `SchedulerOutput` the engine's scheduler hands out from now on, in order: what each step
    ran (the last one is the latest step's)."""
    schedules = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        schedules.append(out)
        return out

    engine.scheduler.schedule = recorded
    return schedules


def prefill_request_ids(schedule) -> list[str]:
    """The requests a `SchedulerOutput` runs prompt chunks of."""
    return [s.request.request_id for s in schedule.scheduled if s.num_prompt_tokens > 0]


def decode_request_ids(schedule) -> list[str]:
    """The requests a `SchedulerOutput` runs a round of."""
    return [s.request.request_id for s in schedule.scheduled if s.num_prompt_tokens == 0]
