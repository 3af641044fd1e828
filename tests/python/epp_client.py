"""Plays Envoy's part of the ext_proc exchange against kv-router epp, with the message
types generated from Envoy's own API definitions (PyPI xds-protos) over grpcio.

Usage: epp_client.py ADDR BODY_JSON SUBSET_CSV [full_duplex|streamed]
Prints one JSON object: what the picker answered to a full exchange (request headers
with the subset hint, the body in three streamed chunks, the response headers naming
the served endpoint, two response body chunks), and to a second stream that the
client abandons after the first response chunk. In `streamed` mode (the filter's
STREAMED body mode with send_body_without_waiting_for_header_response, announced in
the first message's protocol_config) Envoy queues each body chunk and releases it on
its own answer, in order; the picker must answer each with a body response that does
not replace it. That mode also sends an oversized body (the request body four times
over) and a body stalled after its first chunk, and reports their statuses.
"""

import json
import queue
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
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


def request_headers(subset, streamed):
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
    if streamed:
        message.protocol_config.CopyFrom(ep.ProtocolConfiguration(
            request_body_mode=pm.ProcessingMode.STREAMED,
            response_body_mode=pm.ProcessingMode.STREAMED,
            send_body_without_waiting_for_header_response=True,
        ))
    return message


def passed(chunk, answer):
    """A STREAMED chunk as Envoy sends it upstream after its answer (None: the answer
    is not one Envoy applies to a STREAMED chunk)."""
    if not answer.HasField("response") or not answer.response.HasField("body_mutation"):
        return chunk
    mutation = answer.response.body_mutation
    kind = mutation.WhichOneof("mutation")
    if kind == "body":
        return mutation.body
    if kind == "clear_body":
        return b"" if mutation.clear_body else chunk
    return None if kind else chunk


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


def pick(stream, body, subset, streamed, stall=False):
    stream.send(request_headers(subset, streamed))
    third = max(1, len(body) // 3 + 1)
    pieces = [body[i:i + third] for i in range(0, len(body), third)]
    if stall:
        pieces = pieces[:1]
    for i, piece in enumerate(pieces):
        end = i == len(pieces) - 1 and not stall
        stream.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=end)))
    first = stream.next()
    if first.HasField("immediate_response"):
        return {"status": first.immediate_response.status.code}
    mutation = first.request_headers.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
    if streamed:
        upstream = [passed(piece, stream.next().request_body) for piece in pieces]
        echoed = None not in upstream and b"".join(upstream) == body
    else:
        streamed_back = stream.next().request_body.response.body_mutation.streamed_response
        echoed = streamed_back.body == body and streamed_back.end_of_stream
    return {
        "header": set_headers.get("x-gateway-destination-endpoint"),
        "metadata": lb.fields["x-gateway-destination-endpoint"].string_value,
        "clear_route_cache": first.request_headers.response.clear_route_cache,
        "body_echoed": echoed,
    }


def respond(stream, served, chunks, streamed, ends=True):
    stream.send(ep.ProcessingRequest(response_headers=headers(
        [(":status", "200"), ("x-gateway-destination-endpoint-served", served)])))
    answered = [stream.next().HasField("response_headers")]
    for i, chunk in enumerate(chunks):
        stream.send(ep.ProcessingRequest(
            response_body=ep.HttpBody(body=chunk, end_of_stream=ends and i == len(chunks) - 1)))
        answer = stream.next().response_body
        if streamed:
            answered.append(passed(chunk, answer) == chunk)
        else:
            answered.append(answer.response.body_mutation.streamed_response.body == chunk)
    return all(answered)


def main():
    addr, body, subset = sys.argv[1], sys.argv[2].encode(), sys.argv[3]
    subset = [s for s in subset.split(",") if s]
    streamed = len(sys.argv) > 4 and sys.argv[4] == "streamed"
    with grpc.insecure_channel(addr) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        full = Stream(stub)
        seen = {"full": pick(full, body, subset, streamed)}
        if "header" in seen["full"]:
            # The header lists the primary first, then the fallbacks.
            seen["full"]["passed_through"] = respond(
                full, seen["full"]["header"].split(",")[0],
                [b"data: {}\n\n", b"data: [DONE]\n\n"], streamed)
        full.close()
        aborted = Stream(stub)
        seen["aborted"] = pick(aborted, body, subset, streamed)
        if "header" in seen["aborted"]:
            seen["aborted"]["passed_through"] = respond(
                aborted, seen["aborted"]["header"].split(",")[0], [b"data: {}\n\n"],
                streamed, ends=False)
        aborted.abort()
        if streamed:
            for name, kwargs in [("oversized", {"body": body * 4}), ("stalled", {"stall": True})]:
                stream = Stream(stub)
                seen[name] = pick(stream, kwargs.get("body", body), subset, True,
                                  stall=kwargs.get("stall", False))
                stream.abort()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
