"""The runtime: a model's forward on this CPU.

`config` (what a model is), `layers` (RoPE, norms, the linear layer, the decoder block) and
`transformer` (the model: one forward over any new tokens of one sequence or several);
`kv_cache` (its static cache) and `attention` (eager, efficient and row-wise attention);
`quant` (block-quantized weights and their product) over `kernels` (the C++ extension in csrc/,
built once per machine, one dispatch over its per-ISA paths); `fused_step` (every layer of a few
rows in one C++ call); `costmodel` (what a forward of R rows costs here, measured).
"""
