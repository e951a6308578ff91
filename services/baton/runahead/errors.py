"""The one error a chain raises at run time (bad input is a ValueError before any rank starts)."""

from __future__ import annotations


class ChainError(RuntimeError):
    """A chain could not finish a request: a rank died, hung past its timeout or failed.

    The message names the rank at fault (and the rank that noticed).
    """
