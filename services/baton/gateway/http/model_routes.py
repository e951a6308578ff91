"""The OpenAI door's answers about the model itself, computed at the gateway (no pod is
asked): ``/v1/models`` (every served name), ``/tokenize`` and ``/detokenize`` (vLLM's
bodies: a prompt or chat messages in, token ids out, and back), ``/version``.
"""

from __future__ import annotations

from importlib import metadata

from aiohttp import web

from baton.gateway.http.chat_template import ChatTemplate
from baton.gateway.http.fields import BadParameter, short
from baton.gateway.served_model import ServedModel


def baton_version() -> str:
    try:
        return metadata.version("baton")
    except metadata.PackageNotFoundError:  # run from a source tree without an install
        return "unknown"


class ModelRoutes:
    def __init__(self, model: ServedModel, chat_template: ChatTemplate | None) -> None:
        self.model = model
        self.chat_template = chat_template

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model_id}", self.get_model),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/version", self.version)]

    def _card(self, name: str = "") -> dict:
        info = self.model.info
        return {"id": name or info.id, "object": "model", "created": 0, "owned_by": "baton",
                "root": info.id, "max_model_len": info.max_model_len}

    async def list_models(self, request: web.Request) -> web.Response:
        names = self.model.names or (self.model.info.id,)
        return web.json_response({"object": "list", "data": [self._card(name) for name in names]})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        self.model.check_name(name)
        return web.json_response(self._card(name))

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt": text}`` or ``{"messages": [...], "add_generation_prompt": bool}`` ->
        ``{"count", "max_model_len", "tokens"}``."""
        body = await _body(request)
        self.model.check_name(body.get("model") or "")
        if "messages" in body:
            if self.chat_template is None:
                raise BadParameter("messages", f"model {self.model.info.id!r} has no chat template")
            messages = body["messages"]
            if not (isinstance(messages, list) and messages):
                raise BadParameter("messages", f"messages must be a non-empty list, got {short(messages)}")
            text = self.chat_template.render(messages, bool(body.get("add_generation_prompt", True)))
            special = bool(body.get("add_special_tokens", False))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadParameter("prompt", f"prompt must be a string, got {short(text)}")
            special = bool(body.get("add_special_tokens", True))
        tokens = list(self.model.tokenizer.encode(text, special)) if text else []
        return web.json_response({"count": len(tokens), "max_model_len": self.model.info.max_model_len,
                                  "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        body = await _body(request)
        self.model.check_name(body.get("model") or "")
        tokens = body.get("tokens")
        vocab_size = self.model.info.vocab_size
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t < vocab_size for t in tokens)):
            raise BadParameter("tokens", f"tokens must be a list of token ids in [0, {vocab_size}), "
                                         f"got {short(tokens)}")
        return web.json_response({"prompt": self.model.tokenizer.decode(tokens)})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": baton_version()})


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise BadParameter("", f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadParameter("", f"the request body must be a JSON object, got {type(body).__name__}")
    return body
