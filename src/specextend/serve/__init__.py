"""`specextend serve`: an OpenAI-compatible HTTP server over one loaded model pair.

protocol.py (the OpenAI request and response shapes), stops.py (stop strings), jobs.py (one
request's generation), scheduler.py (continuous batching: admission, KV budget, the step plan; the
steps themselves run in `specextend.batch`),
app.py (the routes), command.py (the command line). The prefix cache that keeps long prompts
prefilled is `specextend.prefix_cache`, used through `Pair.prefill`/`Pair.remember`.
"""
