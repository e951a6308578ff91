"""`baton train`: the shipped small model's corpus, tokenizer, training forward and loop."""
