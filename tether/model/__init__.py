"""The model plumbing shared by the trainer, the engines and `tether eval`: `loading` (Hugging Face models, tiny
models, LoRA, devices, threads), `files` (the model cache, GGUF, pinned models), `causal_lm` (model inputs,
log-probs, precision), `ops` (the fused, chunked LM head). torch and transformers only."""
