"""The inference engine: the architectures, the KV cache, sampling, the prefill/decode steps and the decode loop,
the runtime around a loaded model (native or transformers), tokenizers, Flash Attention's tiles and the counting."""
