from privfusion.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestHeader(_message.Message):
    __slots__ = ("sender", "receiver", "on_behalf_of")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    sender: str
    receiver: str
    on_behalf_of: str
    def __init__(self, sender: _Optional[str] = ..., receiver: _Optional[str] = ..., on_behalf_of: _Optional[str] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("signer", "ledger_entry_id", "record_json", "tensors", "signature_algorithm", "signature", "manifest_sha256", "served_again", "served_to", "ledger_seq", "ledger_head")
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    SERVED_AGAIN_FIELD_NUMBER: _ClassVar[int]
    SERVED_TO_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LEDGER_HEAD_FIELD_NUMBER: _ClassVar[int]
    signer: str
    ledger_entry_id: str
    record_json: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorDigest]
    signature_algorithm: str
    signature: bytes
    manifest_sha256: bytes
    served_again: str
    served_to: str
    ledger_seq: int
    ledger_head: bytes
    def __init__(self, signer: _Optional[str] = ..., ledger_entry_id: _Optional[str] = ..., record_json: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorDigest, _Mapping]]] = ..., signature_algorithm: _Optional[str] = ..., signature: _Optional[bytes] = ..., manifest_sha256: _Optional[bytes] = ..., served_again: _Optional[str] = ..., served_to: _Optional[str] = ..., ledger_seq: _Optional[int] = ..., ledger_head: _Optional[bytes] = ...) -> None: ...

class ReleaseManifest(_message.Message):
    __slots__ = ("kind", "model", "architecture_json", "metadata_json", "tensor_count", "total_bytes", "upstream", "tensors")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_JSON_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    model: str
    architecture_json: str
    metadata_json: str
    tensor_count: int
    total_bytes: int
    upstream: _containers.RepeatedCompositeFieldContainer[Receipt]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorHeader]
    def __init__(self, kind: _Optional[str] = ..., model: _Optional[str] = ..., architecture_json: _Optional[str] = ..., metadata_json: _Optional[str] = ..., tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., upstream: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorHeader, _Mapping]]] = ...) -> None: ...

class ReleaseEnd(_message.Message):
    __slots__ = ("tensor_count", "total_bytes")
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    tensor_count: int
    total_bytes: int
    def __init__(self, tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ReleaseFrame(_message.Message):
    __slots__ = ("receipt", "manifest", "tensor", "chunk", "end")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    receipt: Receipt
    manifest: ReleaseManifest
    tensor: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    end: ReleaseEnd
    def __init__(self, receipt: _Optional[_Union[Receipt, _Mapping]] = ..., manifest: _Optional[_Union[ReleaseManifest, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., end: _Optional[_Union[ReleaseEnd, _Mapping]] = ...) -> None: ...

class GetPeerInfoRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture_json", "parameter_count", "hidden_sizes", "layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture_json: str
    parameter_count: int
    hidden_sizes: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    def __init__(self, name: _Optional[str] = ..., architecture_json: _Optional[str] = ..., parameter_count: _Optional[int] = ..., hidden_sizes: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ...) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("name", "kind", "weight_shape", "bias_shape", "hidden")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BIAS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    weight_shape: _containers.RepeatedScalarFieldContainer[int]
    bias_shape: _containers.RepeatedScalarFieldContainer[int]
    hidden: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., weight_shape: _Optional[_Iterable[int]] = ..., bias_shape: _Optional[_Iterable[int]] = ..., hidden: _Optional[bool] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "architecture_json", "members", "methods")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_JSON_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture_json: str
    members: _containers.RepeatedScalarFieldContainer[str]
    methods: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., architecture_json: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., methods: _Optional[_Iterable[str]] = ...) -> None: ...

class BudgetInfo(_message.Message):
    __slots__ = ("budget", "scope", "epsilon_limit", "delta_limit", "epsilon_spent", "epsilon_remaining", "releases")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DELTA_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    EPSILON_REMAINING_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    budget: str
    scope: str
    epsilon_limit: float
    delta_limit: float
    epsilon_spent: float
    epsilon_remaining: float
    releases: int
    def __init__(self, budget: _Optional[str] = ..., scope: _Optional[str] = ..., epsilon_limit: _Optional[float] = ..., delta_limit: _Optional[float] = ..., epsilon_spent: _Optional[float] = ..., epsilon_remaining: _Optional[float] = ..., releases: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("name", "certificate_sha256", "protocol", "insecure", "models", "pools", "mechanisms", "budgets", "has_probe_set", "max_chunk_bytes", "unusable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    MECHANISMS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROBE_SET_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNUSABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    certificate_sha256: str
    protocol: str
    insecure: bool
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    mechanisms: _containers.RepeatedScalarFieldContainer[str]
    budgets: _containers.RepeatedCompositeFieldContainer[BudgetInfo]
    has_probe_set: bool
    max_chunk_bytes: int
    unusable: _containers.RepeatedCompositeFieldContainer[UnusableFile]
    def __init__(self, name: _Optional[str] = ..., certificate_sha256: _Optional[str] = ..., protocol: _Optional[str] = ..., insecure: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., mechanisms: _Optional[_Iterable[str]] = ..., budgets: _Optional[_Iterable[_Union[BudgetInfo, _Mapping]]] = ..., has_probe_set: _Optional[bool] = ..., max_chunk_bytes: _Optional[int] = ..., unusable: _Optional[_Iterable[_Union[UnusableFile, _Mapping]]] = ...) -> None: ...

class UnusableFile(_message.Message):
    __slots__ = ("path", "reason")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    path: str
    reason: str
    def __init__(self, path: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FeaturesParams(_message.Message):
    __slots__ = ("header", "model", "activation_epsilon", "weight_epsilon", "unit", "activation_clip_low", "activation_clip_high", "weight_bound", "weights_epsilon", "weights_delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_EPSILON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_EPSILON_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BOUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_EPSILON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DELTA_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    model: str
    activation_epsilon: float
    weight_epsilon: float
    unit: str
    activation_clip_low: float
    activation_clip_high: float
    weight_bound: float
    weights_epsilon: float
    weights_delta: float
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., model: _Optional[str] = ..., activation_epsilon: _Optional[float] = ..., weight_epsilon: _Optional[float] = ..., unit: _Optional[str] = ..., activation_clip_low: _Optional[float] = ..., activation_clip_high: _Optional[float] = ..., weight_bound: _Optional[float] = ..., weights_epsilon: _Optional[float] = ..., weights_delta: _Optional[float] = ...) -> None: ...

class FeaturesRequest(_message.Message):
    __slots__ = ("params", "probe", "chunk")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    params: FeaturesParams
    probe: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, params: _Optional[_Union[FeaturesParams, _Mapping]] = ..., probe: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("header", "model", "epsilon", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    model: str
    epsilon: float
    delta: float
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., model: _Optional[str] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ...) -> None: ...

class MergeRequest(_message.Message):
    __slots__ = ("header", "pool", "method", "epsilon", "delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    pool: str
    method: str
    epsilon: float
    delta: float
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., pool: _Optional[str] = ..., method: _Optional[str] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ...) -> None: ...

class SegmentRequest(_message.Message):
    __slots__ = ("header", "run", "min_round", "max_round")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUND_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    run: str
    min_round: int
    max_round: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., run: _Optional[str] = ..., min_round: _Optional[int] = ..., max_round: _Optional[int] = ...) -> None: ...

class FuseRequest(_message.Message):
    __slots__ = ("header", "model", "partner", "partner_model", "alpha", "activation_epsilon", "weight_epsilon", "weights_epsilon", "weights_delta")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARTNER_FIELD_NUMBER: _ClassVar[int]
    PARTNER_MODEL_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_EPSILON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_EPSILON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_EPSILON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DELTA_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    model: str
    partner: str
    partner_model: str
    alpha: float
    activation_epsilon: float
    weight_epsilon: float
    weights_epsilon: float
    weights_delta: float
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., model: _Optional[str] = ..., partner: _Optional[str] = ..., partner_model: _Optional[str] = ..., alpha: _Optional[float] = ..., activation_epsilon: _Optional[float] = ..., weight_epsilon: _Optional[float] = ..., weights_epsilon: _Optional[float] = ..., weights_delta: _Optional[float] = ...) -> None: ...

class LedgerRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("entry_id", "record_json", "counterparty", "created_at")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    COUNTERPARTY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    record_json: bytes
    counterparty: str
    created_at: str
    def __init__(self, entry_id: _Optional[str] = ..., record_json: _Optional[bytes] = ..., counterparty: _Optional[str] = ..., created_at: _Optional[str] = ...) -> None: ...

class SecAggContext(_message.Message):
    __slots__ = ("run", "step", "attempt", "sites", "bits")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    attempt: int
    sites: _containers.RepeatedScalarFieldContainer[str]
    bits: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., sites: _Optional[_Iterable[str]] = ..., bits: _Optional[int] = ...) -> None: ...

class SecAggDigest(_message.Message):
    __slots__ = ("site", "digest", "signature")
    SITE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    site: str
    digest: bytes
    signature: bytes
    def __init__(self, site: _Optional[str] = ..., digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SecAggMessage(_message.Message):
    __slots__ = ("kind", "sender", "public_key", "key_signature", "masked", "digest", "release_id", "digests")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RELEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    sender: str
    public_key: bytes
    key_signature: bytes
    masked: bytes
    digest: SecAggDigest
    release_id: str
    digests: _containers.RepeatedCompositeFieldContainer[SecAggDigest]
    def __init__(self, kind: _Optional[str] = ..., sender: _Optional[str] = ..., public_key: _Optional[bytes] = ..., key_signature: _Optional[bytes] = ..., masked: _Optional[bytes] = ..., digest: _Optional[_Union[SecAggDigest, _Mapping]] = ..., release_id: _Optional[str] = ..., digests: _Optional[_Iterable[_Union[SecAggDigest, _Mapping]]] = ...) -> None: ...

class SecAggPublishRequest(_message.Message):
    __slots__ = ("header", "context", "message", "recipients")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    context: SecAggContext
    message: SecAggMessage
    recipients: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., context: _Optional[_Union[SecAggContext, _Mapping]] = ..., message: _Optional[_Union[SecAggMessage, _Mapping]] = ..., recipients: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggPublishReply(_message.Message):
    __slots__ = ("recipients",)
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    recipients: int
    def __init__(self, recipients: _Optional[int] = ...) -> None: ...

class SecAggFetchRequest(_message.Message):
    __slots__ = ("header", "context", "kind")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    context: SecAggContext
    kind: str
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., context: _Optional[_Union[SecAggContext, _Mapping]] = ..., kind: _Optional[str] = ...) -> None: ...
