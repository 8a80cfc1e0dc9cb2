"""Models: a pair resolved once from its references and options (`resolve.py`), built from that
description (`loader.py`), the quantized model store and GGUF conversion (`qstore.py`, `gguf.py`),
references and the offline default pair (`registry.py`, `pull.py`), the text a q8 KV cache's key
offsets are calibrated on (`calibration.py`)."""
