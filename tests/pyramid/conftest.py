"""The PyramidInfer tests' fixtures (helpers live in pyramid_fixtures)."""

from pyramid_fixtures import model, prompt  # noqa: F401  (pytest finds fixtures by name)
