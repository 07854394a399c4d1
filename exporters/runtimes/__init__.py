"""Serving runtimes for per-layer exports: the vLLM plugin (vllm_plugin.py, loaded by vLLM through the
``vllm.general_plugins`` entry point) and the check that runs an export in vLLM (vllm_check.py)."""
