"""Writing pruned models, built on the core: the export flow (export.py), safetensors checkpoints (checkpoint.py,
stream.py), the manifest and card, the logit check, GGUF for llama.cpp (gguf/), LoRA slicing and the Hub push."""
