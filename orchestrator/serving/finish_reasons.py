"""Finish reasons by their wire name: the HTTP API's `finish_reason` and `specmesh generate --json`."""

from specmesh.v1 import generation_pb2

FINISH_REASON_NAMES = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length"}
