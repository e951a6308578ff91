"""baton.tracing: off, nothing of the SDK is loaded and nothing is exported; on, spans reach
an OTLP receiver under the caller's traceparent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from baton import tracing
from baton.config import OtlpConfig
from otlp_receiver import OtlpReceiver


def test_off_imports_no_sdk_and_makes_no_spans():
    """Every module with a span in it, loaded and exercised with tracing off (the default
    configuration), in a fresh interpreter: no opentelemetry module was imported."""
    script = textwrap.dedent("""
        import sys
        import baton.gateway.server, baton.prefill.server, baton.decode.server, baton.commands.up
        from baton import tracing
        from baton.config import GatewayServiceConfig
        tracing.configure(GatewayServiceConfig().otlp, "baton-gateway")
        parent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        assert tracing.start("x", parent) is None and not tracing.enabled()
        assert tracing.record("x", parent, 0.0, 1.0) == ""
        tracing.end(None)
        loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
        assert not loaded, loaded
    """)
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


def test_on_spans_reach_the_collector_under_the_callers_traceparent(receiver):
    parent = f"00-{'ab' * 16}-{'cd' * 8}-01"
    tracing.configure(OtlpConfig(traces_endpoint=receiver.endpoint), "baton-test", **{"baton.rank": 1})
    try:
        span = tracing.start("outer", parent, server=True, attributes={"a": 1})
        child = tracing.record("inner", span, 10.0, 10.5, {"b": "x"})
        tracing.end(span, attributes={"c": True})
    finally:
        tracing.shutdown()  # flushes
    spans = receiver.wait_for(lambda spans: len(spans) == 2, 10.0)
    outer, inner = sorted(spans, key=lambda s: s.name != "outer")
    assert outer.trace_id == inner.trace_id == "ab" * 16
    assert outer.parent_span_id == "cd" * 8 and inner.parent_span_id == outer.span_id
    assert child == f"00-{'ab' * 16}-{inner.span_id}-01"
    assert outer.service == "baton-test" and outer.attributes == {"a": 1, "c": True}
    assert inner.end_ns - inner.start_ns == pytest.approx(0.5e9, rel=1e-3)
    assert not tracing.enabled()


@pytest.mark.parametrize("value, expected", [
    (f"00-{'a' * 32}-{'b' * 16}-01", f"00-{'a' * 32}-{'b' * 16}-01"),
    (f" 00-{'A' * 32}-{'b' * 16}-00 ", f"00-{'a' * 32}-{'b' * 16}-00"),
    ("00-xyz-b-01", ""), (None, ""), ("", "")])
def test_a_malformed_traceparent_starts_a_new_trace(value, expected):
    assert tracing.checked(value) == expected
    assert tracing.from_metadata((("authorization", "x"), ("traceparent", value))) == expected
