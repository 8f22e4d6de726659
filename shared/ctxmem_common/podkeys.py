"""The pod's keys, all derived from the service's master key (docs/security.md, "The pod's
keys"). Every node of a pod holds the same master key (docs/deploy.md, "A pod's master
key"); nothing else a node learns from outside (the index, a peer, a certificate, the pod
token) lets anyone make or check what these keys make.

* **peer key** — HKDF-SHA256(master key, salt ``ctxmem-pod-peer-v1``, info = the pod
  token): the peer handshake's challenge-response proves knowledge of it, both ways. The
  token is mixed in (never sent), so two pods that share a master key but not a token
  refuse each other, and a stolen token alone proves nothing.
* **namespace keys** — per namespace digest: the block authenticator
  (:class:`~ctxmem_common.codecs.blockauth.BlockAuthenticator`, GMAC under
  ``derive_auth_key``), and a request key (HMAC-SHA256 of the authenticator key under the
  label ``ctxmem-pod-request-v1``) with which a fetcher proves, per request, that it holds
  the namespace's key. Derived on first use and kept in a bounded LRU (they are
  functions of the master key: nothing to invalidate while it is unchanged).
* **index key** — HKDF-SHA256(master key, salt ``ctxmem-pod-index-v1``): the names under
  which the cluster index stores a namespace (hash tag) and its blocks (hash fields) are
  keyed hashes under it (:meth:`PodKeys.index_tag`, :meth:`PodKeys.index_fields`), so the
  index holds no plaintext block key and no namespace digest an index reader could
  recompute from a guessed tenant or prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ctxmem_common.codecs.blockauth import BlockAuthenticator, derive_auth_key

PEER_SALT = b"ctxmem-pod-peer-v1"
INDEX_SALT = b"ctxmem-pod-index-v1"
REQUEST_LABEL = b"ctxmem-pod-request-v1"
#: Namespaces whose derived keys are kept (one HKDF each to derive again).
NS_CACHE = 4096
#: Bytes of a keyed index name (hash field; the tag is twice as many hex digits).
NAME_BYTES = 16
_LEN = struct.Struct("!8xQ")  # the first block of a keyed name: the key's length


def _hkdf(master_key: bytes, salt: bytes, info: bytes) -> bytes:
    if len(master_key) != 32:
        raise ValueError(f"master key must be 32 bytes, got {len(master_key)}")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(master_key)


@dataclass(frozen=True, slots=True)
class NamespaceKeys:
    """One namespace's pod keys."""

    auth: BlockAuthenticator
    request_key: bytes  # HMAC key of the per-request proof
    index_cipher: Cipher[modes.ECB]  # the keyed names of its blocks in the index
    index_key: bytes  # the same key, for names of lengths that are not 16-byte multiples


class PodKeys:
    """The keys one node derives from the pod's master key (see the module's doc)."""

    def __init__(self, master_key: bytes, pod_token: bytes = b"") -> None:
        self._master = master_key
        self.peer_key = _hkdf(master_key, PEER_SALT, pod_token)
        self.index_key = _hkdf(master_key, INDEX_SALT, b"")
        self._ns: OrderedDict[bytes, NamespaceKeys] = OrderedDict()

    def namespace(self, ns_digest: bytes) -> NamespaceKeys:
        """The keys of namespace ``ns_digest`` (derived once, then from the LRU)."""
        got = self._ns.get(ns_digest)
        if got is not None:
            self._ns.move_to_end(ns_digest)
            return got
        auth_key = derive_auth_key(self._master, ns_digest)
        idx = hmac.digest(self.index_key, b"ns-fields" + ns_digest, "sha256")
        got = NamespaceKeys(BlockAuthenticator(auth_key, ns_digest),
                            hmac.digest(auth_key, REQUEST_LABEL, "sha256"),
                            Cipher(algorithms.AES(idx), modes.ECB()), idx)
        self._ns[ns_digest] = got
        if len(self._ns) > NS_CACHE:
            self._ns.popitem(last=False)
        return got

    def index_tag(self, ns_digest: bytes) -> str:
        """The hash tag (hex) under which the index keeps namespace ``ns_digest``."""
        return hmac.digest(self.index_key, b"ns-tag" + ns_digest, "sha256")[:NAME_BYTES].hex()

    def index_fields(self, ns_digest: bytes, keys: Sequence[bytes]) -> list[bytes]:
        """The index's hash field of each block key (:data:`NAME_BYTES` bytes each): a
        PRF under the namespace's index key. Keys whose length is a multiple of 16 (the
        chain hashes: 32 bytes) in bulk, in C: AES-256 CBC-MAC with the length as the
        first block (a PRF for messages of any such length), one ECB call per 16 bytes of
        key over all keys at once; other lengths by keyed BLAKE2b, each."""
        if not keys:
            return []
        nk = self.namespace(ns_digest)
        n0 = len(keys[0])
        if n0 == 0 or n0 % 16 or any(len(k) != n0 for k in keys):
            return [self._one(nk, k) for k in keys]
        n = len(keys)
        enc = nk.index_cipher.encryptor()
        first = np.frombuffer(enc.update(_LEN.pack(n0)), np.uint64)
        state = np.broadcast_to(first, (n, 2))
        blocks = np.frombuffer(b"".join(keys), np.uint64).reshape(n, n0 // 16, 2)
        for j in range(n0 // 16):
            state = np.frombuffer(enc.update((state ^ blocks[:, j]).tobytes()),
                                  np.uint64).reshape(n, 2)
        # Split in C: a 16-byte void item's tolist() is its bytes.
        out: list[bytes] = np.frombuffer(state.tobytes(), f"V{NAME_BYTES}").tolist()
        return out

    def _one(self, nk: NamespaceKeys, key: bytes) -> bytes:
        """The field of one key of a batch whose keys differ in length."""
        if key and len(key) % 16 == 0:
            return self.index_fields(nk.auth.namespace_digest, [key])[0]
        return hashlib.blake2b(key, key=nk.index_key, digest_size=NAME_BYTES,
                               person=b"ctxmem-idx-field").digest()
