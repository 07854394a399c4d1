"""Writing pruned models: layouts, safetensors shards, model cards, and the Hub push."""
