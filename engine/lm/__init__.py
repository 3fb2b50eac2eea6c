"""Language models: the tokenizer, chat templates, LoRA adapters and fine-tuning, GRPO's arithmetic
and rewards (Hugging Face weights in and out and sampling are engine/hub/'s)."""
