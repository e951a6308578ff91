"""An OTLP/gRPC trace receiver in the test process: a real gRPC server on a loopback port
implementing opentelemetry-proto's TraceService, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict
    start_ns: int
    end_ns: int


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        resource.get("service.name", ""), span.name, span.trace_id.hex(),
                        span.span_id.hex(), span.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in span.attributes},
                        span.start_time_unix_nano, span.end_time_unix_nano))
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout_s: float) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds; raises AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self.spans):
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise AssertionError(f"spans never satisfied the wait; got "
                                         f"{sorted({(s.service, s.name) for s in self.spans})}")
                self._changed.wait(left_s)
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [span for span in self.spans if span.trace_id == trace_id]

    def stop(self) -> None:
        self.server.stop(0)
