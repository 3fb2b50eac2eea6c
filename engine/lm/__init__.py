"""Language models: the tokenizer, Hugging Face weights in and out, adapters, generation, chat
templates and fine-tuning."""
