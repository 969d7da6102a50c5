"""Fine-tuning: LoRA and QLoRA of a Hugging Face causal LM on chat/instruction JSONL, through the
shared training loop (ptbr.train.loop.fit)."""
