"""AES-256-XTS through the system's libcrypto (OpenSSL) by ctypes: one key schedule per
(key, direction, thread), the GIL released while OpenSSL encrypts.

``cryptography`` builds a fresh cipher context per call (a key expansion of both AES keys
and a provider fetch per record) and holds the GIL around it. Here each thread keeps, per
:class:`XtsContexts` (one per namespace key), an ``EVP_CIPHER_CTX`` per direction,
initialised once with ``EVP_aes_256_xts()`` and the key; a record is then only the tweak
reset (``EVP_CipherInit_ex`` with the IV alone), one ``EVP_CipherUpdate`` over the
buffer's address and ``EVP_CipherFinal_ex``. The update goes through a ``ctypes.CDLL``
handle, which drops the GIL for the call, so two I/O threads encrypt at once; the short
calls go through a ``ctypes.PyDLL`` handle that keeps the GIL (releasing it for a call of
a few hundred nanoseconds costs more than the call).

Contexts are thread-local (an ``EVP_CIPHER_CTX`` must not be used by two threads at once)
and freed with ``EVP_CIPHER_CTX_free`` when their thread ends or the :class:`XtsContexts`
goes away. Buffers are passed by address, never copied: a writable buffer through
``ctypes.c_char.from_buffer`` (which also holds the buffer's export for the call), a
``bytes`` object as itself, any other read-only buffer through numpy's view of it.

:func:`load` raises :class:`XtsUnavailable` when no libcrypto is found or it lacks
AES-256-XTS; :mod:`ctxmem_common.codecs.xts` then falls back to ``cryptography``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np

__all__ = ["Libcrypto", "XtsContexts", "XtsUnavailable", "load"]

_VP = ctypes.c_void_p
_INT = ctypes.c_int
_INT_P = ctypes.POINTER(ctypes.c_int)
_KEY_BYTES = 64
_TWEAK_BYTES = 16


class XtsUnavailable(ImportError):
    """No usable libcrypto (not found, or without AES-256-XTS)."""


class Libcrypto:
    """The libcrypto functions this module calls, with their C signatures declared."""

    def __init__(self, path: str) -> None:
        try:
            nogil = ctypes.CDLL(path)
            gil = ctypes.PyDLL(path)
        except OSError as exc:
            raise XtsUnavailable(f"cannot load {path}: {exc}") from None
        self.path = path
        try:
            gil.OpenSSL_version.restype = ctypes.c_char_p
            gil.OpenSSL_version.argtypes = [_INT]
            self.version = (gil.OpenSSL_version(0) or b"").decode("ascii", "replace")
            gil.OpenSSL_version_num.restype = ctypes.c_ulong
            gil.OpenSSL_version_num.argtypes = []
            self.version_number: int = gil.OpenSSL_version_num()
            gil.EVP_aes_256_xts.restype = _VP
            gil.EVP_aes_256_xts.argtypes = []
            gil.EVP_CIPHER_CTX_new.restype = _VP
            gil.EVP_CIPHER_CTX_new.argtypes = []
            gil.EVP_CIPHER_CTX_free.restype = None
            gil.EVP_CIPHER_CTX_free.argtypes = [_VP]
            gil.EVP_CipherInit_ex.restype = _INT
            gil.EVP_CipherInit_ex.argtypes = [_VP, _VP, _VP, ctypes.c_char_p, ctypes.c_char_p,
                                              _INT]
            gil.EVP_CipherFinal_ex.restype = _INT
            gil.EVP_CipherFinal_ex.argtypes = [_VP, _VP, _INT_P]
            gil.ERR_get_error.restype = ctypes.c_ulong
            gil.ERR_get_error.argtypes = []
            gil.ERR_error_string_n.restype = None
            gil.ERR_error_string_n.argtypes = [ctypes.c_ulong, ctypes.c_char_p, ctypes.c_size_t]
            nogil.EVP_CipherUpdate.restype = _INT
            nogil.EVP_CipherUpdate.argtypes = [_VP, _VP, _INT_P, _VP, _INT]
        except AttributeError as exc:  # an OpenSSL before 1.1 (no OpenSSL_version)
            raise XtsUnavailable(f"{path} lacks a function this module needs: {exc}") from None
        self.cipher = gil.EVP_aes_256_xts()
        if not self.cipher:
            raise XtsUnavailable(f"{path} ({self.version}) has no AES-256-XTS")
        self.ctx_new = gil.EVP_CIPHER_CTX_new
        self.ctx_free = gil.EVP_CIPHER_CTX_free
        self.init = gil.EVP_CipherInit_ex
        self.final = gil.EVP_CipherFinal_ex
        self.update = nogil.EVP_CipherUpdate
        self._err_get = gil.ERR_get_error
        self._err_string = gil.ERR_error_string_n

    def errors(self) -> str:
        """OpenSSL's error queue of this thread as text (emptying it)."""
        texts = []
        buf = ctypes.create_string_buffer(256)
        while code := self._err_get():
            self._err_string(code, buf, len(buf))
            texts.append(buf.value.decode("ascii", "replace"))
        return "; ".join(texts) or "no OpenSSL error recorded"

    def fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"OpenSSL {what} failed ({self.version}, {self.path}): "
                            f"{self.errors()}")


def load(path: str | None = None) -> Libcrypto:
    """The system's libcrypto (``path``, or the one ``ctypes.util.find_library`` finds)
    with AES-256-XTS checked against a published vector; :class:`XtsUnavailable`
    otherwise (so the caller falls back to ``cryptography``)."""
    found = path or ctypes.util.find_library("crypto")
    if not found:
        raise XtsUnavailable("no libcrypto found (ctypes.util.find_library('crypto'))")
    lib = Libcrypto(found)
    out = bytearray(len(_CHECK_CT))
    try:
        XtsContexts(lib, _CHECK_KEY).run(True, memoryview(_CHECK_PT), memoryview(out),
                                         _CHECK_TWEAK, len(out))
    except (RuntimeError, MemoryError) as exc:
        raise XtsUnavailable(f"{found} ({lib.version}): AES-256-XTS self-test failed: "
                             f"{exc}") from None
    if bytes(out) != _CHECK_CT:
        raise XtsUnavailable(f"{found} ({lib.version}): AES-256-XTS self-test gave a wrong "
                             f"ciphertext")
    return lib


# The self-test of load(): Brian Gladman's XTS-AES-256 vector 30 (one 16-byte block;
# tests/shared/xts_vectors.py has it with the IEEE 1619 ones).
_CHECK_KEY = bytes.fromhex(
    "fffefdfcfbfaf9f8f7f6f5f4f3f2f1f0efeeedecebeae9e8e7e6e5e4e3e2e1e0"
    "bfbebdbcbbbab9b8b7b6b5b4b3b2b1b0afaeadacabaaa9a8a7a6a5a4a3a2a1a0")
_CHECK_TWEAK = bytes.fromhex("9a785634120000000000000000000000")
_CHECK_PT = bytes(range(16))
_CHECK_CT = bytes.fromhex("c30ca8f2ed57307edc87e544867ac888")


class _ThreadContexts:
    """One thread's two contexts of one key, freed with this object (its thread's end or
    its :class:`XtsContexts` being dropped)."""

    __slots__ = ("ctxs", "lib", "outl", "outl_ref")

    def __init__(self, lib: Libcrypto, key: bytes) -> None:
        self.lib = lib
        self.ctxs: list[int] = []
        self.outl = ctypes.c_int(0)
        self.outl_ref = ctypes.byref(self.outl)
        for enc in (0, 1):  # index 0 decrypts, 1 encrypts
            ctx = lib.ctx_new()
            if not ctx:
                raise MemoryError(f"EVP_CIPHER_CTX_new failed: {lib.errors()}")
            self.ctxs.append(ctx)
            if lib.init(ctx, lib.cipher, None, key, None, enc) != 1:
                raise lib.fail("EVP_CipherInit_ex (AES-256-XTS key setup)")

    def __del__(self) -> None:
        for ctx in self.ctxs:
            self.lib.ctx_free(ctx)
        self.ctxs = []


class XtsContexts:
    """AES-256-XTS with one key: :meth:`run` encrypts or decrypts one data unit."""

    def __init__(self, lib: Libcrypto, key: bytes) -> None:
        if len(key) != _KEY_BYTES:
            raise ValueError(f"AES-256-XTS key must be {_KEY_BYTES} bytes, got {len(key)}")
        self._lib = lib
        self._key = bytes(key)
        self._local = threading.local()

    def _contexts(self) -> _ThreadContexts:
        mine: _ThreadContexts | None = getattr(self._local, "c", None)
        if mine is None:
            mine = self._local.c = _ThreadContexts(self._lib, self._key)
        return mine

    def run(self, encrypt: bool, s: memoryview, d: memoryview, tweak: bytes, n: int) -> None:
        """Encrypt (or decrypt) the first ``n`` bytes of ``s`` into ``d`` (may be the same
        buffer; both byte memoryviews, as ``memoryview(x).cast("B")`` gives) with
        ``tweak``; the caller checks the data unit's length bounds (16 B..16 MiB)."""
        if d.readonly:
            raise ValueError("XTS output buffer is read-only; pass a writable buffer "
                             "(bytearray, a writable memoryview or numpy array)")
        if len(tweak) != _TWEAK_BYTES:
            raise ValueError(f"XTS tweak must be {_TWEAK_BYTES} bytes, got {len(tweak)}")
        if s.nbytes < n or d.nbytes < n:
            raise ValueError(f"XTS buffers hold {s.nbytes} and {d.nbytes} bytes, need {n}")
        dst_c = ctypes.c_char.from_buffer(d)  # holds d's export until the call is done
        out = ctypes.addressof(dst_c)
        if not s.readonly:
            src_c = ctypes.c_char.from_buffer(s)
            inp: int | bytes = ctypes.addressof(src_c)
        elif type(s.obj) is bytes and s.nbytes == len(s.obj):
            inp = s.obj  # passed to C as its own buffer, not copied
        else:
            arr = np.frombuffer(s, dtype=np.uint8)
            inp = arr.ctypes.data
        lib = self._lib
        mine = self._contexts()
        ctx = mine.ctxs[encrypt]
        if lib.init(ctx, None, None, None, tweak, -1) != 1:
            raise lib.fail("EVP_CipherInit_ex (XTS tweak)")
        if lib.update(ctx, out, mine.outl_ref, inp, n) != 1 or mine.outl.value != n:
            raise lib.fail(f"EVP_CipherUpdate of {n} bytes ({mine.outl.value} out)")
        if lib.final(ctx, out + n, mine.outl_ref) != 1:
            raise lib.fail("EVP_CipherFinal_ex")
