from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_FLASH: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
    TIER_REMOTE_DRAM: _ClassVar[Tier]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_TCP: _ClassVar[Transport]
    TRANSPORT_RDMA: _ClassVar[Transport]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_FLASH: Tier
TIER_REMOTE: Tier
TIER_REMOTE_DRAM: Tier
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_TCP: Transport
TRANSPORT_RDMA: Transport

class Layout(_message.Message):
    __slots__ = ("dtype", "num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "kv_lora_rank", "qk_rope_head_dim", "tp_rank", "tp_size")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    tp_rank: int
    tp_size: int
    def __init__(self, dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("region", "generation", "offset", "length", "remote_addr", "rkey")
    REGION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDR_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    region: int
    generation: int
    offset: int
    length: int
    remote_addr: int
    rkey: int
    def __init__(self, region: _Optional[int] = ..., generation: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., remote_addr: _Optional[int] = ..., rkey: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "instance_id", "version", "transports", "shm_socket", "data_endpoint", "mode", "shm_ops", "tcp_ops")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SHM_OPS_FIELD_NUMBER: _ClassVar[int]
    TCP_OPS_FIELD_NUMBER: _ClassVar[int]
    status: str
    instance_id: str
    version: str
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    shm_socket: str
    data_endpoint: str
    mode: str
    shm_ops: bool
    tcp_ops: bool
    def __init__(self, status: _Optional[str] = ..., instance_id: _Optional[str] = ..., version: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., shm_socket: _Optional[str] = ..., data_endpoint: _Optional[str] = ..., mode: _Optional[str] = ..., shm_ops: bool = ..., tcp_ops: bool = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("client_name", "transport", "tenant", "tenant_token", "hold")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    transport: Transport
    tenant: str
    tenant_token: str
    hold: bool
    def __init__(self, client_name: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., tenant: _Optional[str] = ..., tenant_token: _Optional[str] = ..., hold: bool = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("session_id", "session_token", "instance_id", "lease_ttl_ms", "allocation_ttl_ms", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    session_token: bytes
    instance_id: str
    lease_ttl_ms: int
    allocation_ttl_ms: int
    tenant: str
    def __init__(self, session_id: _Optional[bytes] = ..., session_token: _Optional[bytes] = ..., instance_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., allocation_ttl_ms: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("session_id", "model_id", "layout", "tags", "weights_revision")
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REVISION_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    model_id: str
    layout: Layout
    tags: _containers.ScalarMap[str, str]
    weights_revision: str
    def __init__(self, session_id: _Optional[bytes] = ..., model_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., tags: _Optional[_Mapping[str, str]] = ..., weights_revision: _Optional[str] = ...) -> None: ...

class OpenNamespaceResponse(_message.Message):
    __slots__ = ("namespace_handle", "namespace_digest", "block_nbytes")
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_handle: int
    namespace_digest: bytes
    block_nbytes: int
    def __init__(self, namespace_handle: _Optional[int] = ..., namespace_digest: _Optional[bytes] = ..., block_nbytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "namespace_handle", "keys", "prefix", "packed_keys", "key_len", "want_tier_codes", "group_namespace_handles")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_LEN_FIELD_NUMBER: _ClassVar[int]
    WANT_TIER_CODES_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAMESPACE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_handle: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefix: bool
    packed_keys: bytes
    key_len: int
    want_tier_codes: bool
    group_namespace_handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_handle: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., prefix: bool = ..., packed_keys: _Optional[bytes] = ..., key_len: _Optional[int] = ..., want_tier_codes: bool = ..., group_namespace_handles: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hits", "tiers", "tier_codes")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_CODES_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    tier_codes: bytes
    def __init__(self, num_hits: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., tier_codes: _Optional[bytes] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("tier", "node_id")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    node_id: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., node_id: _Optional[str] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("num_hits", "locations", "node_id")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    node_id: str
    def __init__(self, num_hits: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., node_id: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "namespace_handle", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_handle: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_handle: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("allocation_id", "exists", "slots", "expires_in_ms")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    allocation_id: bytes
    exists: _containers.RepeatedScalarFieldContainer[bool]
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    expires_in_ms: int
    def __init__(self, allocation_id: _Optional[bytes] = ..., exists: _Optional[_Iterable[bool]] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "allocation_id", "crc32c", "abort", "group_allocation_ids", "group_crc32c")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ALLOCATION_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_CRC32C_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    allocation_id: bytes
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    abort: bool
    group_allocation_ids: _containers.RepeatedScalarFieldContainer[bytes]
    group_crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., allocation_id: _Optional[bytes] = ..., crc32c: _Optional[_Iterable[int]] = ..., abort: bool = ..., group_allocation_ids: _Optional[_Iterable[bytes]] = ..., group_crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "namespace_handle", "keys", "want_packed", "group_namespace_handles")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WANT_PACKED_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAMESPACE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_handle: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    want_packed: bool
    group_namespace_handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_handle: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., want_packed: bool = ..., group_namespace_handles: _Optional[_Iterable[int]] = ...) -> None: ...

class MemberLease(_message.Message):
    __slots__ = ("lease_id", "slots", "crc32c")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[bytes] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "num_acquired", "slots", "crc32c", "source_tiers", "expires_in_ms", "slot_regions", "slot_generations", "slot_offsets", "slot_lengths", "slot_crcs", "members")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIERS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SLOT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SLOT_CRCS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    num_acquired: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    source_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    expires_in_ms: int
    slot_regions: bytes
    slot_generations: bytes
    slot_offsets: bytes
    slot_lengths: bytes
    slot_crcs: bytes
    members: _containers.RepeatedCompositeFieldContainer[MemberLease]
    def __init__(self, lease_id: _Optional[bytes] = ..., num_acquired: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., crc32c: _Optional[_Iterable[int]] = ..., source_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., expires_in_ms: _Optional[int] = ..., slot_regions: _Optional[bytes] = ..., slot_generations: _Optional[bytes] = ..., slot_offsets: _Optional[bytes] = ..., slot_lengths: _Optional[bytes] = ..., slot_crcs: _Optional[bytes] = ..., members: _Optional[_Iterable[_Union[MemberLease, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_ids: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[bytes] = ..., lease_ids: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, valid: _Optional[_Iterable[bool]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "namespace_handle", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_handle: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_handle: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued", "in_dram")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_DRAM_FIELD_NUMBER: _ClassVar[int]
    queued: int
    in_dram: int
    def __init__(self, queued: _Optional[int] = ..., in_dram: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("session_id", "namespace_handle", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_handle: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_handle: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("session_id", "namespace_handle", "keys", "tier")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_handle: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_handle: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RdmaQp(_message.Message):
    __slots__ = ("qpn", "psn", "gid", "lid", "mtu", "rd_atomic")
    QPN_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    qpn: int
    psn: int
    gid: bytes
    lid: int
    mtu: int
    rd_atomic: int
    def __init__(self, qpn: _Optional[int] = ..., psn: _Optional[int] = ..., gid: _Optional[bytes] = ..., lid: _Optional[int] = ..., mtu: _Optional[int] = ..., rd_atomic: _Optional[int] = ...) -> None: ...

class DisconnectRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class DisconnectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class HoldEvent(_message.Message):
    __slots__ = ("orphan_ms",)
    ORPHAN_MS_FIELD_NUMBER: _ClassVar[int]
    orphan_ms: int
    def __init__(self, orphan_ms: _Optional[int] = ...) -> None: ...

class RdmaInfoRequest(_message.Message):
    __slots__ = ("session_id", "session_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    session_token: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., session_token: _Optional[bytes] = ...) -> None: ...

class RdmaInfoResponse(_message.Message):
    __slots__ = ("gid", "lid", "mtu", "rd_atomic")
    GID_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    gid: bytes
    lid: int
    mtu: int
    rd_atomic: int
    def __init__(self, gid: _Optional[bytes] = ..., lid: _Optional[int] = ..., mtu: _Optional[int] = ..., rd_atomic: _Optional[int] = ...) -> None: ...

class RdmaAttachRequest(_message.Message):
    __slots__ = ("session_id", "session_token", "qp")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    QP_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    session_token: bytes
    qp: RdmaQp
    def __init__(self, session_id: _Optional[bytes] = ..., session_token: _Optional[bytes] = ..., qp: _Optional[_Union[RdmaQp, _Mapping]] = ...) -> None: ...

class RdmaAttachResponse(_message.Message):
    __slots__ = ("qp",)
    QP_FIELD_NUMBER: _ClassVar[int]
    qp: RdmaQp
    def __init__(self, qp: _Optional[_Union[RdmaQp, _Mapping]] = ...) -> None: ...
