"""`specextend serve`: an OpenAI-compatible HTTP server over one loaded model pair.

`command` (the flags) -> `assemble` (load the pair, size its caches, make the server) -> `app`
(the routes, over a backend) with `protocol` (the OpenAI request and response shapes), `auth`
(API keys), `limits` (the body's size), `drain` (stopping without cutting off), `metrics`
(Prometheus) and `page` (the page at /). The backend in this process is `local` (the pair's
continuous batch: specextend.batching; each request a job, `jobs`); `ray_serve`, `ray_router` and
`routing` serve it from Ray Serve replicas. The prefix cache that keeps long prompts prefilled is
specextend.requests.prefix_cache, used through `Pair.prefill`/`Pair.remember`.
"""
