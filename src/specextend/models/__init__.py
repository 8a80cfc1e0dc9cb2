"""Model acquisition: the offline default pair, GGUF conversion and model references."""
