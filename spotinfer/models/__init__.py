"""Models the cluster serves: the deterministic tiny Llama for tests and SmolLM2-135M for demos.

Both end up as Hugging Face folders (config.json, model.safetensors, tokenizer files), the
same loading path vLLM takes for any real model.
"""
