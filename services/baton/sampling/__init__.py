"""Choosing tokens: a request's sampling parameters, the step's logits processing, its draws,
log probabilities, stop strings and structured-output grammars."""
