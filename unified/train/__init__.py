"""Fine-tuning the shared model: full-parameter and LoRA training, checkpoints, export."""
