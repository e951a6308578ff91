"""generation_config.json as vLLM reads it: its end-of-sequence ids join config.json's, its
temperature, top_p and top_k are what a request that leaves them out gets at the OpenAI
door, and what baton cannot apply is named in the log."""

from __future__ import annotations

import json

from baton.config import ModelSourceConfig
from baton.gateway.http.protocol import chat_request, completion_request
from baton.gateway.served_model import ServedModel
from baton.model.config import ModelConfig
from commands.cli_checkpoint import save_cli_checkpoint


def test_a_checkpoints_generation_config_is_applied_where_baton_can(tmp_path, caplog):
    directory = save_cli_checkpoint(tmp_path)
    eos = ModelConfig.from_file(directory / "config.json").eos_token_ids
    (directory / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [*eos, 7],
         "repetition_penalty": 1.1, "min_p": 0.05, "num_beams": 4, "do_sample": True}))
    with caplog.at_level("WARNING", logger="baton.model.generation_config"):
        served = ServedModel.load(ModelSourceConfig(path=str(directory)))
    assert served.config.eos_token_ids == [*eos, 7]
    assert any("num_beams 4 is not applied" in r.getMessage() for r in caplog.records)
    defaults = served.sampling_defaults
    sampling = completion_request({"prompt": "x"}, defaults).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 20)
    assert (sampling.repetition_penalty, sampling.min_p) == (1.1, 0.05)
    chat = chat_request({"messages": [{"role": "user", "content": "x"}], "temperature": 0,
                         "top_k": 0}, defaults).sampling
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.0, 0.95, 0)
    plain = completion_request({"prompt": "x"}).sampling
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
