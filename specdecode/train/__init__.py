"""Training of specdecode's own models: tokenizer, target pretraining, draft distillation, evaluation."""
