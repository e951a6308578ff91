"""Constraining what a request may generate: grammars and their token bitmasks."""
