"""The gateway's OpenAI-compatible HTTP API: ``protocol`` reads and writes OpenAI's bodies,
``chat_template`` renders conversations, ``app`` serves them (aiohttp)."""

from baton.gateway.http.app import OpenAIServer

__all__ = ["OpenAIServer"]
