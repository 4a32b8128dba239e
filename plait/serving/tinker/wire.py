"""The Tinker SDK's protobuf bodies in and out, through the SDK's own generated messages (tinker.proto).

In: a `forward_backward` body (protobuf, zstd-compressed when `Content-Encoding: zstd`) to plain data:
each datum's tokens and its loss inputs as float/int tensors, checked here so that a malformed datum is
refused before any work, naming the datum and the field. Out: `ForwardBackwardOutput` and
`SampleResponse` as the protobuf the SDK (0.38) reads for those two types (it refuses JSON for them).

Left out: image and audio chunks, sparse (CSR) loss inputs and 2-D target tokens: refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plait.serving.protocol import ApiError
from plait.serving.tinker.losses import LOSSES, OPTIONAL_INPUTS, UNSERVED


@dataclass
class Datum:
    tokens: list[int]              # the model input
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs, each [len(tokens)]


@dataclass
class FwdBwd:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict
    data: list[Datum]
    forward_only: bool


def bad(message: str, field: str) -> ApiError:
    return ApiError(400, message, param=field)


def decode_forward_backward(body: bytes, encoding: str | None) -> FwdBwd:
    """A forward_backward body to a checked FwdBwd (ApiError 400 naming the field when it is malformed)."""
    from tinker.proto import tinker_public_pb2 as pb
    if encoding == "zstd":
        import zstandard
        body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
    elif encoding not in (None, "identity"):
        raise bad(f"Content-Encoding {encoding!r} is not served; send zstd or none", "Content-Encoding")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, whatever its module
        raise bad(f"the body is not a ForwardBackwardRequest protobuf: {err}", "body") from None
    if msg.loss_fn in UNSERVED:
        raise bad(f"loss_fn {msg.loss_fn!r} is not served: {UNSERVED[msg.loss_fn]}", "loss_fn")
    if msg.loss_fn not in LOSSES:
        raise bad(f"loss_fn {msg.loss_fn!r} is not served here; one of {', '.join(LOSSES)}", "loss_fn")
    _, required, known = LOSSES[msg.loss_fn]
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items()} or dict(msg.loss_fn_config)
    for key in config:
        if key not in known:
            raise bad(f"loss_fn_config.{key} is not read by {msg.loss_fn} (it reads: {', '.join(known) or 'nothing'})",
                      f"loss_fn_config.{key}")
    for key, default in known.items():
        if default is None and key not in config:
            raise bad(f"{msg.loss_fn} needs loss_fn_config.{key}", f"loss_fn_config.{key}")
    if not msg.data:
        raise bad("forward_backward got no data", "data")
    data = [_datum(d, i, required) for i, d in enumerate(msg.data)]
    return FwdBwd(msg.model_id, msg.seq_id, msg.loss_fn, config, data, msg.forward_only)


def _datum(d, i: int, required: tuple[str, ...]) -> Datum:
    from tinker.proto import tinker_public_pb2 as pb
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise bad(f"data[{i}].model_input: only encoded_text chunks are served (got {kind})", f"data[{i}].model_input")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    if not tokens:
        raise bad(f"data[{i}].model_input is empty", f"data[{i}].model_input")
    inputs = {}
    for name, tensor in d.loss_fn_inputs.items():
        field = f"data[{i}].loss_fn_inputs.{name}"
        if name not in required and name not in OPTIONAL_INPUTS:
            raise bad(f"{field} is not an input of this loss (it takes: {', '.join(required + tuple(OPTIONAL_INPUTS))})", field)
        if tensor.HasField("sparse_csr") or len(tensor.shape) > 1:
            raise bad(f"{field}: only dense 1-D tensors are served (shape {list(tensor.shape)})", field)
        dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(tensor.dtype)
        if dtype is None:
            raise bad(f"{field}: dtype {tensor.dtype} is not float32 or int64", field)
        values = torch.from_numpy(np.frombuffer(tensor.dense, dtype=dtype).copy())
        if len(values) != len(tokens):
            raise bad(f"{field} has {len(values)} values for {len(tokens)} input tokens; they must be equal", field)
        inputs[name] = values.long() if name == "target_tokens" else values.float()
    for name in required:
        if name not in inputs:
            raise bad(f"data[{i}].loss_fn_inputs.{name} is missing", f"data[{i}].loss_fn_inputs.{name}")
    return Datum(tokens, inputs)


def encode_forward_backward(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """Per-datum float32 outputs (each [n_i]) and metrics as the ForwardBackwardOutput protobuf."""
    from tinker.proto import tinker_public_pb2 as pb
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [o[name].detach().to(torch.float32).numpy() for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].data = b"".join(a.tobytes() for a in arrays)
        record.fields[name].offsets = offsets.tobytes()
        record.fields[name].dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample(sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None) -> bytes:
    """(tokens, their log-probs, "stop" | "length") per sample, and the prompt's log-probs (NaN first) as protobuf."""
    from tinker.proto import tinker_public_pb2 as pb
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        msg.sequences.add(tokens=np.asarray(tokens, np.int32).tobytes(), logprobs=np.asarray(logprobs, np.float32).tobytes(),
                          stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH)
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
