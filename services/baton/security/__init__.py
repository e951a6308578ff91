"""Who may call what: mTLS between pods (``mtls``), the certificates ``baton up`` and the
chart make (``certificates``), and the API keys that name a gateway's callers
(``api_keys``). docs/architecture.md, "Who may call what", is the map."""
