"""Generated from proto/baton/v1 by `python -m baton.api.generate`; do not edit."""
