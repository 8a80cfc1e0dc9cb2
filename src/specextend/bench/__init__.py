"""The tools that measure: the side-by-side benchmark (`runner`, over `data` and `report`, with
llama.cpp and transformers as peers), the server's benchmarks (`serve`, `concurrent`, `soak`),
the runtime's (`runtime`, `roofline`, `onerow`, `manyrow`, `kernels`, `kernel_ab`, `step_split`,
`costs`, `memory`), the method's (`sweep`, `needle`, `lookup_replay`, `draft_vocab`, `quality`)
and the API's (`batch`, `structured`, `tools`, `tool_suite`, `tool_goals`). Each is a command
(`python -m specextend.bench.<name>`); none is imported by the library."""
