"""Both AES-256-XTS implementations behind ``XtsCipher`` (``openssl``: the system's
libcrypto by ctypes with kept contexts; ``cryptography``) agree with the published
vectors and with each other byte for byte: in place and into another buffer, from
read-only sources, from many threads on one cipher (each thread its own OpenSSL
context, freed when the thread ends), at the data unit's length bounds; wrong sizes and
read-only outputs are refused; ``CTXMEM_XTS_IMPL`` picks one at import.

The ``openssl`` path needs the system's libcrypto (libcrypto.so.3 here, on CI and in
the images): its absence fails these tests rather than skipping them.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from ctxmem_common.codecs import XtsCipher, xts, xts_openssl
from tests.shared.xts_vectors import XTS_AES_256_VECTORS

IMPLS = ["openssl", "cryptography"]
KEY = bytes(range(64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "key", "tweak", "pt", "ct"), XTS_AES_256_VECTORS,
                         ids=[v[0] for v in XTS_AES_256_VECTORS])
def test_published_vectors(impl: str, name: str, key: bytes, tweak: bytes, pt: bytes,
                           ct: bytes) -> None:
    cipher = XtsCipher(key, impl)
    assert cipher.implementation == impl
    out = bytearray(len(pt))
    cipher.encrypt_into(pt, out, tweak)  # a bytes source: read-only
    assert bytes(out) == ct, name
    back = bytearray(len(ct))
    cipher.decrypt_into(ct, back, tweak)
    assert bytes(back) == pt, name
    # In place, the way the flash paths call it (a slot decrypted over itself).
    buf = bytearray(pt)
    cipher.encrypt_into(buf, buf, tweak)
    assert bytes(buf) == ct
    cipher.decrypt_into(buf, buf, tweak)
    assert bytes(buf) == pt


@pytest.mark.parametrize("n", [16, 17, 31, 4096, 65536 + 5, 2 << 20])
def test_the_implementations_agree(n: int) -> None:
    rng = np.random.default_rng(n)
    key = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    ours, theirs = XtsCipher(key, "openssl"), XtsCipher(key, "cryptography")
    src = rng.integers(0, 256, n, dtype=np.uint8)
    for tweak in (bytes(16), os.urandom(16)):
        a, b = np.empty(n, np.uint8), np.empty(n, np.uint8)
        ours.encrypt_into(src.data, a.data, tweak)
        theirs.encrypt_into(src.data, b.data, tweak)
        assert np.array_equal(a, b) and not np.array_equal(a, src)
        ours.decrypt_into(a.data, a.data, tweak)
        assert np.array_equal(a, src)
    assert ours.check_value == theirs.check_value


def _expected(n: int, tweak: bytes, src: bytes) -> bytes:
    out = bytearray(n)
    XtsCipher(KEY, "cryptography").encrypt_into(src, out, tweak)
    return bytes(out)


@pytest.mark.parametrize("impl", IMPLS)
def test_read_only_sources_and_offsets(impl: str) -> None:
    """Sources that cannot be written (a bytes object, a slice of one, a read-only numpy
    array) are read where they lie; an output at an offset into a larger buffer is
    written there and nowhere else."""
    cipher = XtsCipher(KEY, impl)
    data = os.urandom(8192 + 100)
    tweak = xts.xts_tweak(2, 4096)
    want = _expected(8192, tweak, data[100:])
    sources: list[object] = [data[100:], memoryview(data)[100:]]
    ro = np.frombuffer(data, dtype=np.uint8)[100:]
    assert not ro.flags.writeable
    sources.append(ro)
    for src in sources:
        big = bytearray(8192 + 64)
        cipher.encrypt_into(src, memoryview(big)[32 : 32 + 8192], tweak)  # type: ignore[arg-type]
        assert bytes(big[32 : 32 + 8192]) == want
        assert big[:32] == bytes(32) and big[-32:] == bytes(32)


@pytest.mark.parametrize("impl", IMPLS)
def test_wrong_sizes_and_outputs_are_refused(impl: str) -> None:
    cipher = XtsCipher(KEY, impl)
    tweak = bytes(16)
    with pytest.raises(ValueError, match=r"16 B\.\.16 MiB"):
        cipher.encrypt_into(bytes(15), bytearray(15), tweak)
    with pytest.raises(ValueError, match=r"16 B\.\.16 MiB"):
        cipher.decrypt_into(bytes(0), bytearray(16), tweak)
    big = np.zeros((16 << 20) + 16, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"16 B\.\.16 MiB"):
        cipher.encrypt_into(big.data, big.data, tweak)
    top = big[: 16 << 20]  # the largest data unit is accepted
    cipher.encrypt_into(top.data, top.data, tweak)
    cipher.decrypt_into(top.data, top.data, tweak)
    assert not top.any()
    with pytest.raises(ValueError, match="output buffer holds 100 bytes, needs 128"):
        cipher.encrypt_into(bytes(128), bytearray(100), tweak)
    with pytest.raises((ValueError, TypeError)):
        cipher.encrypt_into(bytes(128), bytes(128), tweak)  # a read-only output
    with pytest.raises(ValueError):
        cipher.encrypt_into(bytes(128), bytearray(128), bytes(15))  # a short tweak
    with pytest.raises(ValueError, match="64 bytes"):
        XtsCipher(bytes(63), impl)
    with pytest.raises(ValueError, match="halves are equal"):
        XtsCipher(bytes(32) * 2, impl).encrypt_into(bytes(32), bytearray(32), tweak)
    with pytest.raises(ValueError, match="implementation"):
        XtsCipher(KEY, "nss")


def test_many_threads_on_one_cipher() -> None:
    """Eight threads encrypt and decrypt at once through one cipher, each with its own
    tweaks: every result is exact, and each thread used its own OpenSSL contexts."""
    cipher = XtsCipher(KEY, "openssl")
    contexts = cipher._contexts
    assert contexts is not None
    n, per = 65536, 24
    rng = np.random.default_rng(7)
    plain = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(8)]
    want = [[_expected(n, xts.xts_tweak(t, k * 4096), plain[t].tobytes()) for k in range(per)]
            for t in range(8)]
    barrier = threading.Barrier(8, timeout=30)
    errors: list[str] = []
    ctx_of: dict[int, list[int]] = {}

    def work(t: int) -> None:
        out = np.empty(n, np.uint8)
        barrier.wait()
        for k in range(per):
            tweak = xts.xts_tweak(t, k * 4096)
            cipher.encrypt_into(plain[t].data, out.data, tweak)
            if out.tobytes() != want[t][k]:
                errors.append(f"thread {t} record {k}: wrong ciphertext")
            cipher.decrypt_into(out.data, out.data, tweak)
            if not np.array_equal(out, plain[t]):
                errors.append(f"thread {t} record {k}: wrong plaintext")
        ctx_of[t] = list(contexts._contexts().ctxs)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    addresses = [a for ctxs in ctx_of.values() for a in ctxs]
    assert len(ctx_of) == 8 and len(set(addresses)) == 16, "threads shared a context"


def test_contexts_are_freed_with_their_thread_and_cipher(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    lib = xts.system_libcrypto()
    freed: list[int] = []
    real_free = lib.ctx_free

    def counting_free(ctx: int) -> None:
        freed.append(ctx)
        real_free(ctx)

    monkeypatch.setattr(lib, "ctx_free", counting_free)
    holder = [xts_openssl.XtsContexts(lib, KEY)]
    src = memoryview(bytearray(64))

    def use() -> None:
        holder[0].run(True, src, src, bytes(16), 64)

    th = threading.Thread(target=use)
    th.start()
    th.join(timeout=30)
    gc.collect()
    assert len(freed) == 2, "a finished thread's two contexts were not freed"
    use()  # this thread's own
    holder.clear()
    gc.collect()
    assert len(freed) == 4, "a dropped cipher's contexts were not freed"


def test_an_openssl_failure_says_what_failed() -> None:
    """OpenSSL refusing a data unit (here: one over IEEE 1619's 2^20 blocks, which the
    cipher's own bound check normally stops first) raises with the call and OpenSSL's
    error text, and leaves the context usable."""
    contexts = xts_openssl.XtsContexts(xts.system_libcrypto(), KEY)
    n = (16 << 20) + 16
    buf = memoryview(bytearray(n))
    with pytest.raises(RuntimeError, match="EVP_CipherUpdate of 16777232 bytes"):
        contexts.run(True, buf, buf, bytes(16), n)
    small = bytearray(b"x" * 32)
    contexts.run(True, memoryview(small), memoryview(small), bytes(16), 32)
    assert bytes(small) == _expected(32, bytes(16), b"x" * 32)


def _run_with_env(choice: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = (prelude + "from ctxmem_common.codecs import XTS_IMPLEMENTATION as i, XtsCipher;"
            "from tests.shared.xts_vectors import XTS_AES_256_VECTORS as v;"
            "_, k, t, p, c = v[0]; o = bytearray(len(p)); XtsCipher(k).encrypt_into(p, o, t);"
            "assert o == c; print(i)")
    env = {**os.environ, xts.ENV: choice,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("choice", ["openssl", "cryptography", "", "bogus"])
def test_the_env_switch_picks_the_implementation(choice: str) -> None:
    r = _run_with_env(choice)
    if choice == "bogus":
        assert r.returncode != 0 and "use one of openssl, cryptography" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    if choice:
        assert r.stdout.startswith(f"{choice} (OpenSSL "), r.stdout
    else:  # unset: the rule of xts._choose, on this machine's two OpenSSL releases
        newer = xts._release(xts.system_libcrypto().version_number) >= xts._release(
            xts._cryptography_backend.openssl_version_number())
        assert r.stdout.startswith("openssl" if newer else "cryptography"), r.stdout


def test_without_a_system_libcrypto() -> None:
    """No libcrypto found: unforced, ``cryptography`` serves; forced ``openssl`` fails
    at import saying what is missing and what to do."""
    prelude = "import ctypes.util; ctypes.util.find_library = lambda name: None;"
    r = _run_with_env("", prelude)
    assert r.returncode == 0 and r.stdout.startswith("cryptography"), r.stderr
    r = _run_with_env("openssl", prelude)
    assert r.returncode != 0
    assert "no libcrypto found" in r.stderr and "CTXMEM_XTS_IMPL=cryptography" in r.stderr


def test_a_libcrypto_that_cannot_load_is_unavailable() -> None:
    with pytest.raises(xts_openssl.XtsUnavailable, match="cannot load"):
        xts_openssl.load("/nonexistent/libcrypto.so.3")


def test_a_libcrypto_failing_its_self_test_is_unavailable(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """load() checks the library against a published vector before anyone uses it: a
    wrong answer (or an OpenSSL error) makes it unavailable, so ``cryptography`` serves."""
    monkeypatch.setattr(xts_openssl, "_CHECK_CT", bytes(16))
    with pytest.raises(xts_openssl.XtsUnavailable, match="wrong ciphertext"):
        xts_openssl.load()
    monkeypatch.setattr(xts_openssl, "_CHECK_PT", bytes(15))  # OpenSSL refuses < 16 B
    monkeypatch.setattr(xts_openssl, "_CHECK_CT", bytes(15))
    with pytest.raises(xts_openssl.XtsUnavailable, match="self-test failed"):
        xts_openssl.load()
