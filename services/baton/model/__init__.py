"""The Llama-family model runtime: architecture, checkpoint loading, tokenizer, sampling."""

from baton.model.config import ModelConfig
from baton.model.errors import CheckpointError
from baton.model.forward_batch import Segment
from baton.model.llama import CausalLM, decode_step, prefill
from baton.model.loader import LoadedModel, load_checkpoint, save_checkpoint

__all__ = ["CausalLM", "CheckpointError", "LoadedModel", "ModelConfig", "Segment", "decode_step",
           "load_checkpoint", "prefill", "save_checkpoint"]
