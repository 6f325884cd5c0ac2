"""Tensors and releases on the wire (privfusion.v1), independent of any math.

A tensor is a ``TensorHeader`` (name, dtype, shape, nbytes, SHA-256) followed by
``TensorChunk`` messages of at most ``MAX_CHUNK_BYTES`` raw little-endian bytes. The sender
slices the array's own buffer (one chunk-sized copy at a time); the receiver writes each chunk
straight into a preallocated array and hashes as it goes, so a release of several hundred MB
is held once on each side, never as one message.

A release stream is ``Receipt, ReleaseManifest, (TensorHeader, TensorChunk*)*, ReleaseEnd``
(:func:`release_frames` writes it, :class:`ReleaseReader` checks it frame by frame). The
receipt signs the manifest through its digest (:class:`peer.net.receipts.Manifest`); the contract,
language-neutral, is ``docs/wire.md``.

Every check raises ``InvalidArgument`` naming the field, e.g. ``probe.shape`` or
``chunk.data``; the service maps it to INVALID_ARGUMENT (and the client refuses a peer's
malformed stream the same way).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.desk.store import digest, raw_bytes  # the wire bytes a digest binds: one definition
from peer.net.receipts import Manifest, SignedReceipt, TensorEntry, check_manifest, receipt_digest
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import tensor_pb2 as tpb

PROTOCOL = "privfusion.v1"
#: Largest chunk sent or accepted (Flower uses 5 MiB, OpenFL 2 MiB; 4 MiB keeps per-message
#: overhead negligible while bounding what one message can make a peer allocate).
MAX_CHUNK_BYTES = 4 << 20
#: gRPC's own message limit on both ends: above MAX_CHUNK_BYTES (plus framing) so that an
#: oversize chunk reaches the application and is refused by name (INVALID_ARGUMENT); a message
#: above this is refused by gRPC itself with RESOURCE_EXHAUSTED before any handler runs.
GRPC_MESSAGE_LIMIT = 16 << 20
#: Upper bound on one tensor (elements) and on a whole release received by a client (bytes).
MAX_TENSOR_ELEMENTS = 1 << 31
MAX_RELEASE_BYTES = 8 << 30
MAX_DIMS = 8

DTYPES: dict[int, np.dtype] = {
    tpb.DTYPE_FLOAT32: np.dtype("<f4"),
    tpb.DTYPE_FLOAT64: np.dtype("<f8"),
    tpb.DTYPE_INT32: np.dtype("<i4"),
    tpb.DTYPE_INT64: np.dtype("<i8"),
}
_CODES = {v.str: k for k, v in DTYPES.items()}


def grpc_options() -> list[tuple[str, Any]]:
    """Channel and server options of every PrivFusion endpoint (message limits, keepalive)."""
    return [
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def dtype_code(dtype: np.dtype) -> int:
    code = _CODES.get(np.dtype(dtype).newbyteorder("<").str)
    if code is None:
        raise InvalidArgument(
            "dtype", f"{np.dtype(dtype)} cannot travel; use one of {[str(d) for d in DTYPES.values()]}"
        )
    return code


def tensor_messages(
    name: str, array: np.ndarray, sha256: bytes | None = None, chunk_bytes: int = MAX_CHUNK_BYTES
) -> Iterator[tpb.TensorHeader | tpb.TensorChunk]:
    """The header, then the chunks, of one tensor."""
    a = np.asarray(array)
    code = dtype_code(a.dtype)
    raw = raw_bytes(a)
    yield tpb.TensorHeader(
        name=name,
        dtype=code,
        shape=list(a.shape),
        nbytes=raw.nbytes,
        sha256=sha256 if sha256 is not None else hashlib.sha256(raw).digest(),
    )
    for start in range(0, raw.nbytes, chunk_bytes):
        yield tpb.TensorChunk(data=raw[start : start + chunk_bytes].tobytes())


@dataclass(frozen=True)
class TensorSpec:
    """A checked tensor header."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    sha256: bytes


def check_header(
    header: tpb.TensorHeader,
    field: str = "tensor",
    allowed: Sequence[int] | None = None,
    max_bytes: int = MAX_RELEASE_BYTES,
) -> TensorSpec:
    """Validate a header before anything is allocated for it."""
    if header.dtype not in DTYPES or (allowed is not None and header.dtype not in allowed):
        names = [tpb.DType.Name(c) for c in (allowed or DTYPES)]
        raise InvalidArgument(f"{field}.dtype", f"must be one of {names}, got {header.dtype}")
    if len(header.shape) > MAX_DIMS:
        raise InvalidArgument(f"{field}.shape", f"has {len(header.shape)} dimensions, at most {MAX_DIMS} are allowed")
    if any(d < 0 for d in header.shape):
        raise InvalidArgument(f"{field}.shape", f"must be non-negative, got {list(header.shape)}")
    count = math.prod(header.shape)
    if count > MAX_TENSOR_ELEMENTS:
        raise InvalidArgument(
            f"{field}.shape", f"{list(header.shape)} has {count} elements, more than {MAX_TENSOR_ELEMENTS}"
        )
    dtype = DTYPES[header.dtype]
    nbytes = count * dtype.itemsize
    if header.nbytes != nbytes:
        raise InvalidArgument(
            f"{field}.nbytes", f"is {header.nbytes}, but shape {list(header.shape)} of {dtype} needs {nbytes}"
        )
    if nbytes > max_bytes:
        raise InvalidArgument(f"{field}.nbytes", f"{nbytes} exceeds the limit of {max_bytes} bytes")
    if len(header.sha256) != 32:
        raise InvalidArgument(f"{field}.sha256", f"must be 32 bytes, got {len(header.sha256)}")
    return TensorSpec(header.name, dtype, tuple(int(d) for d in header.shape), nbytes, bytes(header.sha256))


class TensorReceiver:
    """Assembles one tensor from its header and chunks, checking everything on the way.

    ``field`` names the tensor in error messages (``probe``, ``tensor[0.weight]``).
    ``allowed`` limits the dtypes; ``max_bytes`` caps what the header may make us allocate.
    Bytes go into a new array, or to ``write(offset, data)`` when given (e.g. into a file).
    """

    def __init__(
        self,
        header: tpb.TensorHeader | TensorSpec,
        field: str = "tensor",
        allowed: Sequence[int] | None = None,
        max_bytes: int = MAX_RELEASE_BYTES,
        write: Callable[[int, memoryview], None] | None = None,
    ):
        self.field = field
        spec = header if isinstance(header, TensorSpec) else check_header(header, field, allowed, max_bytes)
        self.name, self.dtype, self.shape, self.nbytes, self.expected = (
            spec.name,
            spec.dtype,
            spec.shape,
            spec.nbytes,
            spec.sha256,
        )
        self.array = None
        if write is None:
            self.array = np.empty(self.shape, dtype=self.dtype)
            view = memoryview(self.array.reshape(-1).view(np.uint8)) if self.nbytes else memoryview(b"")

            def write(offset: int, data: memoryview) -> None:
                view[offset : offset + len(data)] = data

        self._write = write
        self._hash = hashlib.sha256()
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.nbytes

    def add(self, chunk: tpb.TensorChunk) -> None:
        data = chunk.data
        n = len(data)
        if n == 0:
            raise InvalidArgument("chunk.data", "is empty")
        if n > MAX_CHUNK_BYTES:
            raise InvalidArgument("chunk.data", f"{n} bytes exceeds the chunk limit of {MAX_CHUNK_BYTES}")
        if self.received + n > self.nbytes:
            raise InvalidArgument(
                "chunk.data", f"overruns {self.field}: {self.received + n} bytes for a {self.nbytes}-byte tensor"
            )
        self._write(self.received, data)
        self._hash.update(data)
        self.received += n

    def finish(self) -> np.ndarray | None:
        """Check completeness and checksum; the array (None when bytes went to ``write``)."""
        if not self.complete:
            raise InvalidArgument(f"{self.field}", f"truncated: {self.received} of {self.nbytes} bytes arrived")
        if self._hash.digest() != self.expected:
            raise InvalidArgument(f"{self.field}.sha256", "does not match the bytes received (corrupted in transit)")
        return self.array


# ------------------------------------------------------------------------------ where tensors go


class ArraySink:
    """Received tensors as arrays in memory."""

    def start(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def writer(self, index: int) -> None:
        return None  # the receiver allocates the array itself

    def done(self, spec: TensorSpec, array: np.ndarray | None) -> None:
        self.arrays[spec.name] = array

    def finish(self) -> dict[str, np.ndarray]:
        return self.arrays

    def abort(self) -> None:
        self.arrays = {}


_ST_DTYPES = {"<f4": "F32", "<f8": "F64", "<i4": "I32", "<i8": "I64"}


class SafetensorsSink:
    """Received tensors written straight into a safetensors file as they arrive.

    The manifest announces every tensor's dtype and shape before any byte, so the file's header
    (names, dtypes, shapes, byte offsets in stream order) is written first and each chunk goes to
    its place with ``pwrite``: the release never has to fit in memory. The file appears under its
    name only when every checksum has matched (temporary file, fsync, rename); a failed stream
    leaves nothing behind.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.fd: int | None = None

    def start(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
        self.offsets = []
        pos = 0
        for spec in specs:
            header[spec.name] = {
                "dtype": _ST_DTYPES[spec.dtype.str],
                "shape": list(spec.shape),
                "data_offsets": [pos, pos + spec.nbytes],
            }
            self.offsets.append(pos)
            pos += spec.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        os.write(self.fd, struct.pack("<Q", len(head)) + head)
        self.base = 8 + len(head)
        os.ftruncate(self.fd, self.base + pos)

    def writer(self, index: int) -> Callable[[int, memoryview], None]:
        fd, base = self.fd, self.base + self.offsets[index]

        def write(offset: int, data: memoryview) -> None:
            view, pos = memoryview(data).cast("B"), base + offset
            while len(view):
                n = os.pwrite(fd, view, pos)  # regular files may take less than asked (> 2 GiB)
                view, pos = view[n:], pos + n

        return write

    def done(self, spec: TensorSpec, array: np.ndarray | None) -> None:
        pass

    def finish(self) -> Path:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


# ------------------------------------------------------------------------------ chunk frames, fast
#
# Chunk frames are nearly all the bytes of a release. Encoding and decoding them through
# protobuf objects copies each payload three times on each side (bytes -> message -> wire, and
# back), which on a loaded machine costs more than TLS. Their protobuf encoding is fixed and
# tiny, so it is written and read here directly: ReleaseFrame{chunk: TensorChunk{data: D}} is
#   0x22 varint(len(inner)) inner,  inner = 0x0A varint(len(D)) D
# (field 4 / field 1, wire type 2). The bytes are exactly what protobuf produces (tested), so
# the contract is unchanged; anything that is not this exact shape goes through protobuf.

_FRAME_CHUNK_TAG = 0x22
_CHUNK_DATA_TAG = 0x0A


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(buf) and shift < 64:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
    return -1, pos


def encode_chunk_frame(data: memoryview | bytes) -> bytes:
    """The serialized ReleaseFrame carrying one non-empty chunk (one copy of the payload)."""
    n = len(data)
    inner_head = bytes((_CHUNK_DATA_TAG,)) + _varint(n)
    return b"".join((bytes((_FRAME_CHUNK_TAG,)), _varint(len(inner_head) + n), inner_head, data))


class ChunkFrame:
    """A decoded chunk frame: quacks like ``ReleaseFrame`` with ``chunk`` set, and its ``data``
    is a view into the received message (no copy)."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview):
        self.data = data

    def WhichOneof(self, _name: str) -> str:
        return "chunk"

    @property
    def chunk(self) -> ChunkFrame:
        return self


def decode_frame(raw: bytes) -> pb.ReleaseFrame | ChunkFrame:
    """Deserialize a ReleaseFrame: chunk frames without copying the payload, others by protobuf."""
    if len(raw) > 4 and raw[0] == _FRAME_CHUNK_TAG:
        outer, pos = _read_varint(raw, 1)
        if outer >= 0 and pos + outer == len(raw) and pos < len(raw) and raw[pos] == _CHUNK_DATA_TAG:
            inner, start = _read_varint(raw, pos + 1)
            if inner > 0 and start + inner == len(raw):
                return ChunkFrame(memoryview(raw)[start:])
    return pb.ReleaseFrame.FromString(raw)


def serialize_frame(frame: pb.ReleaseFrame | bytes) -> bytes:
    """Response serializer of the release RPCs: frames already encoded pass through."""
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


# ------------------------------------------------------------------------------ receipts


def receipt_to_proto(r: SignedReceipt) -> pb.Receipt:
    return pb.Receipt(
        signer=r.signer,
        ledger_entry_id=r.ledger_entry_id,
        record_json=r.record_json,
        tensors=[tpb.TensorDigest(name=n, sha256=d) for n, d in r.tensors],
        signature_algorithm=r.signature_algorithm,
        signature=r.signature,
        manifest_sha256=r.manifest_sha256,
        served_again=r.served_again,
        served_to=r.served_to,
        ledger_seq=r.ledger_seq,
        ledger_head=r.ledger_head,
    )


def receipt_from_proto(m: pb.Receipt) -> SignedReceipt:
    return SignedReceipt(
        m.signer,
        m.ledger_entry_id,
        bytes(m.record_json),
        tuple((t.name, bytes(t.sha256)) for t in m.tensors),
        bytes(m.manifest_sha256),
        bytes(m.signature),
        m.signature_algorithm,
        m.served_again,
        m.served_to,
        m.ledger_seq,
        bytes(m.ledger_head),
    )


# ------------------------------------------------------------------------------ manifests


def _json_text(value: Mapping | None) -> str:
    """How the sender writes architecture_json / metadata_json (the receiver never re-encodes
    them: the signed manifest covers the strings exactly as sent)."""
    return json.dumps(dict(value), sort_keys=True) if value is not None else ""


def release_manifest(
    kind: str,
    model: str,
    architecture: Mapping | None,
    metadata: Mapping,
    tensors: Sequence[tuple[str, np.ndarray]],
    upstream: Sequence[SignedReceipt] = (),
    digests: Sequence[tuple[str, bytes]] | None = None,
) -> Manifest:
    """The manifest of a release about to be sent (what its receipt signs).

    ``digests`` are the tensors' SHA-256 in the same order when already computed (the service
    hashes before it charges); otherwise they are computed here."""
    if digests is not None and [n for n, _ in digests] != [n for n, _ in tensors]:
        raise InvalidArgument("digests", "must list the release's tensors in stream order")
    entries = []
    for i, (name, array) in enumerate(tensors):
        a = np.asarray(array)
        sha = digests[i][1] if digests is not None else digest(a)
        entries.append(
            TensorEntry(name, dtype_code(a.dtype), tuple(int(d) for d in a.shape), int(a.nbytes), bytes(sha))
        )
    return Manifest(
        kind,
        model,
        _json_text(architecture),
        _json_text(metadata),
        tuple(entries),
        sum(e.nbytes for e in entries),
        tuple(receipt_digest(u) for u in upstream),
    )


def manifest_to_proto(m: Manifest, upstream: Sequence[SignedReceipt] = ()) -> pb.ReleaseManifest:
    return pb.ReleaseManifest(
        kind=m.kind,
        model=m.model,
        architecture_json=m.architecture_json,
        metadata_json=m.metadata_json,
        tensor_count=len(m.tensors),
        total_bytes=m.total_bytes,
        upstream=[receipt_to_proto(u) for u in upstream],
        tensors=[
            tpb.TensorHeader(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes, sha256=t.sha256)
            for t in m.tensors
        ],
    )


def manifest_from_proto(m: pb.ReleaseManifest) -> Manifest:
    """The signed view of a received manifest (strings as received; upstream by digest)."""
    return Manifest(
        m.kind,
        m.model,
        m.architecture_json,
        m.metadata_json,
        tuple(
            TensorEntry(t.name, int(t.dtype), tuple(int(d) for d in t.shape), int(t.nbytes), bytes(t.sha256))
            for t in m.tensors
        ),
        int(m.total_bytes),
        tuple(receipt_digest(receipt_from_proto(u)) for u in m.upstream),
    )


# ------------------------------------------------------------------------------ releases


@dataclass
class Release:
    """A release as received: the receipt, what it holds, and its tensors in stream order."""

    receipt: SignedReceipt
    kind: str
    model: str
    architecture: dict | None
    metadata: dict
    arrays: dict[str, np.ndarray]
    upstream: tuple[SignedReceipt, ...] = ()
    total_bytes: int = 0
    #: where the tensors were written when received into a file (then ``arrays`` is empty)
    path: Path | None = None
    #: the manifest exactly as signed (strings as received): what an offline check rebuilds
    manifest: Manifest | None = None


def release_frames(
    receipt: SignedReceipt,
    kind: str,
    model: str,
    architecture: Mapping | None,
    metadata: Mapping,
    tensors: Sequence[tuple[str, np.ndarray]],
    upstream: Sequence[SignedReceipt] = (),
    chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Iterator[pb.ReleaseFrame]:
    """The frames of one release; the receipt's digests must be those of ``tensors``.

    Chunk frames come out already serialized (bytes, :func:`encode_chunk_frame`); the other
    frames as messages. :func:`serialize_frame` turns either into the wire bytes. The manifest
    sent must be the one the receipt signed (:func:`release_manifest` of the same arguments)."""
    if [n for n, _ in receipt.tensors] != [n for n, _ in tensors]:
        raise InvalidArgument("receipt.tensors", "must list the release's tensors in stream order")
    manifest = release_manifest(kind, model, architecture, metadata, tensors, upstream, digests=receipt.tensors)
    check_manifest(receipt, manifest)
    message = manifest_to_proto(manifest, upstream)
    headers = message.tensors
    total = manifest.total_bytes
    yield pb.ReleaseFrame(receipt=receipt_to_proto(receipt))
    yield pb.ReleaseFrame(manifest=message)
    for (_, array), header in zip(tensors, headers, strict=True):
        raw = raw_bytes(array)
        yield pb.ReleaseFrame(tensor=header)
        for start in range(0, raw.nbytes, chunk_bytes):
            yield encode_chunk_frame(raw[start : start + chunk_bytes])
    yield pb.ReleaseFrame(end=pb.ReleaseEnd(tensor_count=len(tensors), total_bytes=total))


def _json_object(text: str, field: str, allow_empty: bool) -> dict | None:
    if not text and allow_empty:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(field, f"is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(field, "must be a JSON object")
    return value


class ReleaseReader:
    """Checks a release stream frame by frame (order, sizes, checksums, the receipt's digests).

    ``on_receipt`` is called with the receipt as soon as it arrives (before any tensor byte):
    the client verifies the signature there. ``sink`` receives the tensors (``ArraySink``: in
    memory, the default; ``SafetensorsSink``: straight into a file). Call :meth:`read` with the
    frame iterator; on any failure the sink is aborted (nothing half-written is left).
    """

    def __init__(self, max_bytes: int = MAX_RELEASE_BYTES, on_receipt=None, sink=None):
        self.max_bytes = max_bytes
        self.on_receipt = on_receipt
        self.sink = sink if sink is not None else ArraySink()
        self.manifest: Manifest | None = None

    def read(self, frames: Iterable[pb.ReleaseFrame]) -> Release:
        try:
            return self._read(frames)
        except BaseException:
            self.sink.abort()
            raise

    def _start(self, receipt: SignedReceipt, manifest: pb.ReleaseManifest) -> list[TensorSpec]:
        if manifest.total_bytes > self.max_bytes:
            raise InvalidArgument(
                "manifest.total_bytes", f"{manifest.total_bytes} exceeds the limit of {self.max_bytes}"
            )
        if manifest.tensor_count != len(receipt.tensors) or len(manifest.tensors) != len(receipt.tensors):
            raise InvalidArgument(
                "manifest.tensors",
                f"announces {len(manifest.tensors)} tensors (count {manifest.tensor_count}); the receipt lists {len(receipt.tensors)}",
            )
        specs, total = [], 0
        for i, (h, (name, sha)) in enumerate(zip(manifest.tensors, receipt.tensors, strict=True)):
            if h.name != name or bytes(h.sha256) != sha:
                raise InvalidArgument(
                    f"manifest.tensors[{i}]", f"does not match the receipt's tensor {i} ({name!r} and its checksum)"
                )
            spec = check_header(h, f"tensor[{h.name}]", max_bytes=self.max_bytes - total)
            total += spec.nbytes
            specs.append(spec)
        if len({s.name for s in specs}) != len(specs):
            raise InvalidArgument("manifest.tensors", "names a tensor twice")
        if total != manifest.total_bytes:
            raise InvalidArgument("manifest.total_bytes", f"is {manifest.total_bytes}, the tensors add up to {total}")
        # the signed manifest: kind, model, architecture, metadata, dtypes, shapes, upstream
        self.manifest = manifest_from_proto(manifest)
        check_manifest(receipt, self.manifest)
        self.sink.start(
            specs,
            {
                "privfusion_signer": receipt.signer,
                "privfusion_ledger_entry": receipt.ledger_entry_id,
                "privfusion_release": receipt.record.release_id,
            },
        )
        return specs

    def _read(self, frames: Iterable[pb.ReleaseFrame]) -> Release:
        receipt = manifest = None
        specs: list[TensorSpec] = []
        current: TensorReceiver | None = None
        done = 0
        stream = iter(frames)
        for frame in stream:
            which = frame.WhichOneof("frame")
            if receipt is None:
                if which != "receipt":
                    raise InvalidArgument("frame", f"a release must start with its receipt, got {which!r}")
                receipt = receipt_from_proto(frame.receipt)
                if self.on_receipt is not None:
                    self.on_receipt(receipt)
                continue
            if manifest is None:
                if which != "manifest":
                    raise InvalidArgument("frame", f"the receipt must be followed by the manifest, got {which!r}")
                manifest = frame.manifest
                specs = self._start(receipt, manifest)
                continue
            if which == "tensor":
                if current is not None:
                    raise InvalidArgument(
                        f"tensor[{current.name}]",
                        f"truncated: {current.received} of {current.nbytes} bytes before the next tensor",
                    )
                if done >= len(specs):
                    raise InvalidArgument("tensor", f"more tensors than announced ({len(specs)})")
                if frame.tensor != manifest.tensors[done]:
                    raise InvalidArgument(f"tensor[{frame.tensor.name}]", f"differs from the manifest's tensor {done}")
                current = TensorReceiver(specs[done], f"tensor[{specs[done].name}]", write=self.sink.writer(done))
            elif which == "chunk":
                if current is None:
                    raise InvalidArgument("chunk", "arrived outside a tensor")
                current.add(frame.chunk)
            elif which == "end":
                if current is not None:
                    raise InvalidArgument(
                        f"tensor[{current.name}]", f"truncated: {current.received} of {current.nbytes} bytes"
                    )
                end = frame.end
                if done != len(specs) or end.tensor_count != done:
                    raise InvalidArgument(
                        "end.tensor_count",
                        f"{len(specs)} tensors were announced, {done} arrived, the end frame says {end.tensor_count}",
                    )
                if end.total_bytes != manifest.total_bytes:
                    raise InvalidArgument(
                        "end.total_bytes", f"{manifest.total_bytes} bytes arrived, {end.total_bytes} announced"
                    )
                # read on to the stream's own end: nothing may follow ReleaseEnd, and a call's
                # status arrives only after the sender has finished (so its ledger notes the
                # release as sent, not cut off by a client that hung up on the last frame)
                for extra in stream:
                    raise InvalidArgument("frame", f"{extra.WhichOneof('frame')!r} after ReleaseEnd")
                result = self.sink.finish()
                arrays = result if isinstance(result, dict) else {}
                return Release(
                    receipt,
                    manifest.kind,
                    manifest.model,
                    _json_object(manifest.architecture_json, "manifest.architecture_json", True),
                    _json_object(manifest.metadata_json or "{}", "manifest.metadata_json", False) or {},
                    arrays,
                    tuple(receipt_from_proto(u) for u in manifest.upstream),
                    manifest.total_bytes,
                    None if isinstance(result, dict) else result,
                    self.manifest,
                )
            else:
                raise InvalidArgument("frame", f"unexpected {which!r} inside a release")
            if current is not None and current.complete:
                self.sink.done(specs[done], current.finish())
                current = None
                done += 1
        raise InvalidArgument(
            "release",
            "truncated: the stream ended before ReleaseEnd"
            + (f" (in tensor {current.name!r}, {current.received} of {current.nbytes} bytes)" if current else ""),
        )
