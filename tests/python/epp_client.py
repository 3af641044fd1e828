"""Plays Envoy's part of the ext_proc exchange against kv-router epp, with the message
types generated from Envoy's own API definitions (PyPI xds-protos) over grpcio.

Usage: epp_client.py ADDR BODY_JSON SUBSET_CSV
Prints one JSON object: what the picker answered to a full exchange (request headers
with the subset hint, the body in three streamed chunks, the response headers naming
the served endpoint, two response body chunks), and to a second stream that the
client abandons after the first response chunk.
"""

import json
import queue
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

TIMEOUT_S = 15


def headers(pairs, end_of_stream=False):
    return ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
        ),
        end_of_stream=end_of_stream,
    )


def request_headers(subset):
    metadata = None
    if subset:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        metadata = base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": hint})
    message = ep.ProcessingRequest(
        request_headers=headers(
            [(":method", "POST"), (":path", "/v1/completions"),
             (":authority", "inference.example"), ("content-type", "application/json")]
        )
    )
    if metadata is not None:
        message.metadata_context.CopyFrom(metadata)
    return message


class Stream:
    """One ext_proc stream: messages go in through a queue, answers come out."""

    def __init__(self, stub):
        self.outbound = queue.Queue()
        self.answers = stub.Process(iter(self.outbound.get, None), timeout=TIMEOUT_S)

    def send(self, message):
        self.outbound.put(message)

    def next(self):
        return next(self.answers)

    def close(self):
        self.outbound.put(None)

    def abort(self):
        self.answers.cancel()


def pick(stream, body, subset):
    stream.send(request_headers(subset))
    third = max(1, len(body) // 3 + 1)
    pieces = [body[i:i + third] for i in range(0, len(body), third)]
    for i, piece in enumerate(pieces):
        stream.send(ep.ProcessingRequest(
            request_body=ep.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1)))
    first = stream.next()
    if first.HasField("immediate_response"):
        return {"status": first.immediate_response.status.code}
    mutation = first.request_headers.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
    echoed = stream.next().request_body.response.body_mutation.streamed_response
    return {
        "header": set_headers.get("x-gateway-destination-endpoint"),
        "metadata": lb.fields["x-gateway-destination-endpoint"].string_value,
        "clear_route_cache": first.request_headers.response.clear_route_cache,
        "body_echoed": echoed.body == body and echoed.end_of_stream,
    }


def respond(stream, served, chunks, ends=True):
    stream.send(ep.ProcessingRequest(response_headers=headers(
        [(":status", "200"), ("x-gateway-destination-endpoint-served", served)])))
    answered = [stream.next().HasField("response_headers")]
    for i, chunk in enumerate(chunks):
        stream.send(ep.ProcessingRequest(
            response_body=ep.HttpBody(body=chunk, end_of_stream=ends and i == len(chunks) - 1)))
        passed = stream.next().response_body.response.body_mutation.streamed_response
        answered.append(passed.body == chunk)
    return all(answered)


def main():
    addr, body, subset = sys.argv[1], sys.argv[2].encode(), sys.argv[3]
    subset = [s for s in subset.split(",") if s]
    with grpc.insecure_channel(addr) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        full = Stream(stub)
        seen = {"full": pick(full, body, subset)}
        if "header" in seen["full"]:
            # The header lists the primary first, then the fallbacks.
            seen["full"]["passed_through"] = respond(
                full, seen["full"]["header"].split(",")[0],
                [b"data: {}\n\n", b"data: [DONE]\n\n"])
        full.close()
        aborted = Stream(stub)
        seen["aborted"] = pick(aborted, body, subset)
        if "header" in seen["aborted"]:
            seen["aborted"]["passed_through"] = respond(
                aborted, seen["aborted"]["header"].split(",")[0], [b"data: {}\n\n"],
                ends=False)
        aborted.abort()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
