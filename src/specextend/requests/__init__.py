"""One request, whichever engine runs it: its prompt as checked token ids (`prompts`: chat
templates, tools, grammars), its whole life (`generation`), its text out (`detokenize`, `stops`),
its tool calls (`toolcalls`), and the prefix cache that keeps earlier prompts' KV (`prefix_cache`,
each entry a file: `kv_file`)."""
