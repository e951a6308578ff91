"""SARATHI decode engine: token-budget scheduling, chunked prefill, continuous batching."""

from baton.sarathi.engine import Engine
from baton.sarathi.hooks import CompressorFactory, SequenceCompressor
from baton.sarathi.request import GenerationResult, RequestOutput
from baton.sarathi.scheduler import POLICIES, SchedulerOutput, create_scheduler, register_policy

__all__ = ["POLICIES", "CompressorFactory", "Engine", "GenerationResult", "RequestOutput",
           "SchedulerOutput", "SequenceCompressor", "create_scheduler", "register_policy"]
