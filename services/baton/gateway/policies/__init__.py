"""Gateway routing policies, one per file; each registers itself with ``@register_policy``."""
