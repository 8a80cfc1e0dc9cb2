"""Continuous batching: many requests advancing together, one batch step at a time.

`scheduler` owns the sequences (admission, the KV budget, each step's plan, within `budget`'s
rows); `batch` runs one batch step of their forwards, sharing prompts computed in flight
(`prompt_share`); `runner` runs a pair's batch and scheduler on a thread of their own for the
server and for `Pair.generate` given a list; `loop_handoff` hands a step's events to event loops.
"""
