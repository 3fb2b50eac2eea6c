"""A trained run's ways in and out, each over a run built by engine/run/setup.py: Hugging Face
weights imported as a run at step 0 and exported (safetensors, PEFT adapters), a run exported for
inference, and text sampled from its checkpoints."""
