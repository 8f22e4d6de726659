/*
 * CRC32C (Castagnoli) and a fused copy + CRC32C, over buffer-protocol objects.
 *
 * Why: a verified get copies a block out of a shared slab and checks its CRC32C; a put
 * copies a block into a slab and sends its CRC32C. Done as two passes (memcpy, then CRC)
 * the block crosses the memory bus twice; fused, each 8-byte word is loaded once, stored
 * once and fed to the CRC from the same register, so the copy runs at about memcpy's
 * speed and the CRC is of the very bytes that were stored (a writer changing the source
 * during the copy cannot make the destination differ from what was checked).
 *
 * Implementations (available() lists those this CPU runs; the fastest is chosen at import,
 * set_implementation() picks another for tests and benchmarks):
 *   "avx512+vpclmulqdq"  x86-64 with AVX-512 and VPCLMULQDQ: carry-less-multiply folding,
 *                        256 bytes a step (about twice what the crc32 instruction does);
 *   "sse4.2+avx2"        x86-64 `crc32` instruction in three streams; copies of 64 KiB and
 *                        more use 32-byte non-temporal stores;
 *   "sse4.2"             the `crc32` instruction in three streams, plain stores;
 *   "armv8-crc"          aarch64 CRC32C instructions (__crc32cd, arm_acle.h, target "+crc"),
 *                        detected with getauxval(AT_HWCAP) & HWCAP_CRC32 (BlueField's cores);
 *   "table"              portable slicing-by-8 tables, anywhere.
 * x86 paths are detected at run time (__builtin_cpu_supports) and compiled with
 * __attribute__((target(...))), so the build works with any x86-64 compiler flags. The
 * instruction paths run three independent CRC streams over three stretches of the buffer
 * (the instruction's latency is 3 cycles, its throughput 1 per cycle) and combine them with
 * precomputed "append N zero bytes" operators, as in Mark Adler's crc32c.c. Large copies
 * stream their stores (non-temporal: the destination's lines are not read first), which
 * is what lets a copy of blocks bigger than the caches run at memcpy's speed or better.
 *
 * Built with the limited C API (abi3, Python >= 3.11). Every function releases the GIL
 * for buffers of 32 KiB and more.
 */
#ifndef CRC32C_NO_PYTHON /* defined by the C-only harness that runs the paths under qemu */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define CTX_X86 1
#include <nmmintrin.h>
#elif defined(__aarch64__)
#define CTX_ARM 1
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif

#define POLY 0x82f63b78u /* CRC32C, reflected */
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256
#define GIL_RELEASE_BYTES (32 << 10)

static uint32_t table8[8][256];          /* slicing-by-8 */
static uint32_t zeros_long[4][256];      /* operator: append LONG_BLOCK zero bytes */
static uint32_t zeros_short[4][256];     /* operator: append SHORT_BLOCK zero bytes */

/* ------------------------------------------------------------------ GF(2) operators */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes to a raw (uninverted) CRC register. */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    /* then 8 bits (one byte), 16, ...: apply the squares that len's bits select */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^
           zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static void init_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table8[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = table8[0][n];
        for (int k = 1; k < 8; k++) {
            c = table8[0][c & 0xff] ^ (c >> 8);
            table8[k][n] = c;
        }
    }
    zeros_table(zeros_long, LONG_BLOCK);
    zeros_table(zeros_short, SHORT_BLOCK);
}

/* ------------------------------------------------------------------ portable path */

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline void store64(unsigned char *p, uint64_t w) { memcpy(p, &w, 8); }

static inline uint32_t table_byte(uint32_t crc, unsigned char b) {
    return table8[0][(crc ^ b) & 0xff] ^ (crc >> 8);
}

/* One little-endian 64-bit word (the byte order the buffer holds it in). */
static inline uint32_t table_word(uint32_t crc, uint64_t w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    w ^= crc;
    return table8[7][w & 0xff] ^ table8[6][(w >> 8) & 0xff] ^ table8[5][(w >> 16) & 0xff] ^
           table8[4][(w >> 24) & 0xff] ^ table8[3][(w >> 32) & 0xff] ^
           table8[2][(w >> 40) & 0xff] ^ table8[1][(w >> 48) & 0xff] ^ table8[0][w >> 56];
}

/* dst == NULL: CRC only. Otherwise copy src to dst, CRC-ing each word as stored. */
static uint32_t table_run(uint32_t crc, const unsigned char *src, unsigned char *dst,
                          size_t len) {
    crc = ~crc;
    while (len >= 8) {
        uint64_t w = load64(src);
        if (dst) {
            store64(dst, w);
            dst += 8;
        }
        crc = table_word(crc, w);
        src += 8;
        len -= 8;
    }
    while (len--) {
        unsigned char b = *src++;
        if (dst) *dst++ = b;
        crc = table_byte(crc, b);
    }
    return ~crc;
}

/* ------------------------------------------------------------------ hardware paths */

#if defined(CTX_X86)
#define HW_TARGET __attribute__((target("sse4.2")))
#define HW_U64(c, w) ((uint32_t)_mm_crc32_u64((c), (w)))
#define HW_U8(c, b) _mm_crc32_u8((c), (b))
#elif defined(CTX_ARM)
#define HW_TARGET __attribute__((target("+crc")))
#define HW_U64(c, w) __crc32cd((c), (w))
#define HW_U8(c, b) __crc32cb((c), (b))
#endif

#ifdef HW_TARGET
/* Three streams over [0, n), [n, 2n), [2n, 3n) of the next 3n bytes; returns the raw CRC
 * of all 3n bytes continuing from `c0`. With `dst`, each word is stored from the register
 * that the CRC reads. */
#define HW_STRIPE(N, ZEROS)                                                            \
    while (len >= 3 * (size_t)(N)) {                                                   \
        uint32_t c1 = 0, c2 = 0;                                                       \
        const unsigned char *end = src + (N);                                          \
        if (dst) {                                                                     \
            do {                                                                       \
                uint64_t w0 = load64(src), w1 = load64(src + (N)),                     \
                         w2 = load64(src + 2 * (N));                                   \
                store64(dst, w0);                                                      \
                store64(dst + (N), w1);                                                \
                store64(dst + 2 * (N), w2);                                            \
                c0 = HW_U64(c0, w0);                                                   \
                c1 = HW_U64(c1, w1);                                                   \
                c2 = HW_U64(c2, w2);                                                   \
                src += 8;                                                              \
                dst += 8;                                                              \
            } while (src < end);                                                       \
            dst += 2 * (N);                                                            \
        } else {                                                                       \
            do {                                                                       \
                c0 = HW_U64(c0, load64(src));                                          \
                c1 = HW_U64(c1, load64(src + (N)));                                    \
                c2 = HW_U64(c2, load64(src + 2 * (N)));                                \
                src += 8;                                                              \
            } while (src < end);                                                       \
        }                                                                              \
        c0 = shift(ZEROS, c0) ^ c1;                                                    \
        c0 = shift(ZEROS, c0) ^ c2;                                                    \
        src += 2 * (N);                                                                \
        len -= 3 * (size_t)(N);                                                        \
    }

HW_TARGET static uint32_t hw_run(uint32_t crc, const unsigned char *src, unsigned char *dst,
                                 size_t len) {
    uint32_t c0 = ~crc;
    /* align the loads */
    while (len && ((uintptr_t)src & 7)) {
        unsigned char b = *src++;
        if (dst) *dst++ = b;
        c0 = HW_U8(c0, b);
        len--;
    }
    HW_STRIPE(LONG_BLOCK, zeros_long)
    HW_STRIPE(SHORT_BLOCK, zeros_short)
    while (len >= 8) {
        uint64_t w = load64(src);
        if (dst) {
            store64(dst, w);
            dst += 8;
        }
        c0 = HW_U64(c0, w);
        src += 8;
        len -= 8;
    }
    while (len--) {
        unsigned char b = *src++;
        if (dst) *dst++ = b;
        c0 = HW_U8(c0, b);
    }
    return ~c0;
}
#endif

#if defined(CTX_X86)
#include <immintrin.h>
/* x86-64 with AVX2, copies of 64 KiB and more: 32-byte loads, non-temporal 32-byte stores (the
 * destination's lines are not read for ownership first, which is what lets a plain copy
 * run at memcpy's speed), CRC over the four 64-bit lanes of the very register stored. */
static size_t nt_min_bytes = 64 << 10;

#define LANES_CRC(c, v)                                                                \
    do {                                                                               \
        __m128i lo_ = _mm256_castsi256_si128(v), hi_ = _mm256_extracti128_si256(v, 1); \
        c = (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(lo_));              \
        c = (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(lo_, 1));           \
        c = (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_cvtsi128_si64(hi_));              \
        c = (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(hi_, 1));           \
    } while (0)

#define NT_STRIPE(N, ZEROS)                                                            \
    while (len >= 3 * (size_t)(N)) {                                                   \
        uint32_t c1 = 0, c2 = 0;                                                       \
        const unsigned char *end = src + (N);                                          \
        do {                                                                           \
            __m256i v0 = _mm256_loadu_si256((const __m256i *)src);                     \
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(src + (N)));             \
            __m256i v2 = _mm256_loadu_si256((const __m256i *)(src + 2 * (N)));         \
            _mm256_stream_si256((__m256i *)dst, v0);                                   \
            _mm256_stream_si256((__m256i *)(dst + (N)), v1);                           \
            _mm256_stream_si256((__m256i *)(dst + 2 * (N)), v2);                       \
            LANES_CRC(c0, v0);                                                         \
            LANES_CRC(c1, v1);                                                         \
            LANES_CRC(c2, v2);                                                         \
            src += 32;                                                                 \
            dst += 32;                                                                 \
        } while (src < end);                                                           \
        c0 = shift(ZEROS, c0) ^ c1;                                                    \
        c0 = shift(ZEROS, c0) ^ c2;                                                    \
        src += 2 * (N);                                                                \
        dst += 2 * (N);                                                                \
        len -= 3 * (size_t)(N);                                                        \
    }

__attribute__((target("sse4.2,avx2"))) static uint32_t nt_run(
    uint32_t crc, const unsigned char *src, unsigned char *dst, size_t len) {
    if (dst == NULL || len < nt_min_bytes) return hw_run(crc, src, dst, len);
    uint32_t c0 = ~crc;
    while ((uintptr_t)dst & 31) { /* align the stores */
        unsigned char b = *src++;
        *dst++ = b;
        c0 = _mm_crc32_u8(c0, b);
        len--;
    }
    NT_STRIPE(LONG_BLOCK, zeros_long)
    _mm_sfence(); /* the streamed stores are ordered before anything that follows */
    return hw_run(~c0, src, dst, len);
}
#endif

#if defined(CTX_X86)
/* x86-64 with AVX-512 and VPCLMULQDQ: the CRC by carry-less multiplication ("folding",
 * Intel's "Fast CRC computation for generic polynomials using PCLMULQDQ"), 256 bytes per
 * step in four 512-bit accumulators: about twice the `crc32` instruction's 8 bytes per
 * cycle, so a fused copy runs at the memory's speed, not the CRC's. The last 128 bits are
 * reduced with two `crc32` instructions. Fold constants (reflected): for a distance of D
 * bits, x^(D+31) mod P and x^(D-33) mod P, bit-reversed. */
#define ZMM_TARGET \
    __attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512vl,vpclmulqdq")))
#define ZMM_MIN_BYTES 1024

ZMM_TARGET static inline __m512i fold512(__m512i x, __m512i k, __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), data, 0x96);
}

ZMM_TARGET static inline __m128i fold128(__m128i x, __m128i k, __m128i data) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)), data);
}

ZMM_TARGET static uint32_t zmm_run(uint32_t crc, const unsigned char *src, unsigned char *dst,
                                   size_t len) {
    if (len < ZMM_MIN_BYTES) return hw_run(crc, src, dst, len);
    int stream = dst != NULL && len >= nt_min_bytes;
    /* align the stores (copy) or the loads (CRC only) to 64 bytes */
    size_t head = (64 - ((uintptr_t)(dst ? dst : src) & 63)) & 63;
    if (head) {
        crc = hw_run(crc, src, dst, head);
        src += head;
        if (dst) dst += head;
        len -= head;
    }
    __m512i x0 = _mm512_loadu_si512((const void *)src);
    __m512i x1 = _mm512_loadu_si512((const void *)(src + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(src + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(src + 192));
#define ZMM_STORE(d, v)                                   \
    do {                                                  \
        if (stream)                                       \
            _mm512_stream_si512((void *)(d), v);          \
        else                                              \
            _mm512_store_si512((void *)(d), v);           \
    } while (0)
    if (dst) {
        ZMM_STORE(dst, x0);
        ZMM_STORE(dst + 64, x1);
        ZMM_STORE(dst + 128, x2);
        ZMM_STORE(dst + 192, x3);
        dst += 256;
    }
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc)));
    src += 256;
    len -= 256;
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0xb9e02b86, 0xdcb17aa4));
    while (len >= 256) {
        __m512i y0 = _mm512_loadu_si512((const void *)src);
        __m512i y1 = _mm512_loadu_si512((const void *)(src + 64));
        __m512i y2 = _mm512_loadu_si512((const void *)(src + 128));
        __m512i y3 = _mm512_loadu_si512((const void *)(src + 192));
        if (dst) {
            ZMM_STORE(dst, y0);
            ZMM_STORE(dst + 64, y1);
            ZMM_STORE(dst + 128, y2);
            ZMM_STORE(dst + 192, y3);
            dst += 256;
        }
        x0 = fold512(x0, k2048, y0);
        x1 = fold512(x1, k2048, y1);
        x2 = fold512(x2, k2048, y2);
        x3 = fold512(x3, k2048, y3);
        src += 256;
        len -= 256;
    }
#undef ZMM_STORE
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x9e4addf8, 0x740eef02));
    x1 = fold512(x0, k512, x1);
    x2 = fold512(x1, k512, x2);
    x3 = fold512(x2, k512, x3);
    const __m128i k128 = _mm_set_epi64x(0x493c7d27, 0xf20c0dfe);
    __m128i a = _mm512_extracti32x4_epi32(x3, 0);
    a = fold128(a, k128, _mm512_extracti32x4_epi32(x3, 1));
    a = fold128(a, k128, _mm512_extracti32x4_epi32(x3, 2));
    a = fold128(a, k128, _mm512_extracti32x4_epi32(x3, 3));
    uint32_t c = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    c = (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(a, 1));
    if (stream) _mm_sfence(); /* the streamed stores are ordered before what follows */
    return hw_run(~c, src, dst, len);
}
#endif

/* ------------------------------------------------------------------ dispatch */

typedef uint32_t (*run_fn)(uint32_t, const unsigned char *, unsigned char *, size_t);

/* Every path this build has, fastest last; `ok` says whether this CPU runs it. */
static struct {
    const char *name;
    run_fn run;
    int ok;
} paths[] = {
    {"table", table_run, 1},
#if defined(CTX_X86)
    {"sse4.2", hw_run, 0},
    {"sse4.2+avx2", nt_run, 0},
    {"avx512+vpclmulqdq", zmm_run, 0},
#elif defined(CTX_ARM)
    {"armv8-crc", hw_run, 0},
#endif
};
#define NPATHS (sizeof(paths) / sizeof(paths[0]))

static run_fn active_run = table_run;
static const char *active_name = "table";
static const char *hw_name = NULL; /* the fastest hardware path this CPU runs, if any */

static void detect(void) {
#if defined(CTX_X86)
    __builtin_cpu_init();
    int sse42 = __builtin_cpu_supports("sse4.2");
    paths[1].ok = sse42;
    paths[2].ok = sse42 && __builtin_cpu_supports("avx2");
    paths[3].ok = paths[2].ok && __builtin_cpu_supports("avx512f") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("pclmul") &&
                  __builtin_cpu_supports("vpclmulqdq");
#elif defined(CTX_ARM)
    paths[1].ok = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#endif
    for (size_t i = 1; i < NPATHS; i++) {
        if (paths[i].ok) {
            active_run = paths[i].run;
            active_name = hw_name = paths[i].name;
        }
    }
}

#ifndef CRC32C_NO_PYTHON
/* ------------------------------------------------------------------ Python API */

static int parse_crc(PyObject *obj, uint32_t *out) {
    if (obj == NULL) {
        *out = 0;
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError,
                        "value must be an int in [0, 2**32): the CRC32C to continue from");
        return -1;
    }
    if (v > 0xffffffffULL) {
        PyErr_SetString(PyExc_ValueError,
                        "value must be an int in [0, 2**32): the CRC32C to continue from");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *fn,
                      const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: %s must be a C-contiguous buffer (bytes, bytearray, memoryview, "
                     "numpy array)",
                     fn, what);
        return -1;
    }
    if (writable && view->readonly) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError,
                     "%s: %s is read-only; pass a writable buffer (bytearray, a writable "
                     "memoryview or numpy array)",
                     fn, what);
        return -1;
    }
    return 0;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "value", NULL};
    PyObject *buf, *crc_obj = NULL;
    uint32_t crc;
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:crc32c", kwlist, &buf, &crc_obj))
        return NULL;
    if (parse_crc(crc_obj, &crc) < 0) return NULL;
    if (get_buffer(buf, &view, 0, "crc32c", "buf") < 0) return NULL;
    size_t len = (size_t)view.len;
    run_fn run = active_run;
    if (len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = run(crc, (const unsigned char *)view.buf, NULL, len);
        Py_END_ALLOW_THREADS
    } else {
        crc = run(crc, (const unsigned char *)view.buf, NULL, len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* Read a sequence of ints in [0, PY_SSIZE_T_MAX) into a new C array (PyMem_Free it). */
static Py_ssize_t *ssize_array(PyObject *seq, Py_ssize_t n, const char *what) {
    Py_ssize_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (item == NULL) {
            PyMem_Free(out);
            return NULL;
        }
        Py_ssize_t v = PyLong_AsSsize_t(item);
        Py_DECREF(item);
        if (v < 0) {
            if (PyErr_Occurred()) PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "crc32c_many: %s[%zd] must be an int >= 0 that fits a Py_ssize_t",
                         what, i);
            PyMem_Free(out);
            return NULL;
        }
        out[i] = v;
    }
    return out;
}

/* crc32c_many(buf, offsets, lengths) -> list[int]: the CRC32C (from 0) of every
 * buf[offsets[i] : offsets[i] + lengths[i]] (`lengths` one int for all, or one per
 * offset). Why: the service checks a Commit's whole batch of slots in one call, with the
 * GIL released once, instead of one Python call (and one GIL round trip) per block. Every
 * range is checked against the buffer before any CRC is computed. */
static PyObject *py_crc32c_many(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buf", "offsets", "lengths", NULL};
    PyObject *buf, *offs_obj, *lens_obj;
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:crc32c_many", kwlist, &buf,
                                     &offs_obj, &lens_obj))
        return NULL;
    Py_ssize_t n = PySequence_Size(offs_obj);
    if (n < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError,
                        "crc32c_many: offsets must be a sequence of ints (a list)");
        return NULL;
    }
    Py_ssize_t one_len = -1;
    if (PyLong_Check(lens_obj)) {
        one_len = PyLong_AsSsize_t(lens_obj);
        if (one_len < 0) {
            if (PyErr_Occurred()) PyErr_Clear();
            PyErr_SetString(PyExc_ValueError,
                            "crc32c_many: lengths must be an int >= 0 or one int per offset");
            return NULL;
        }
    } else {
        Py_ssize_t m = PySequence_Size(lens_obj);
        if (m < 0) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError,
                            "crc32c_many: lengths must be an int or a sequence of ints");
            return NULL;
        }
        if (m != n) {
            PyErr_Format(PyExc_ValueError,
                         "crc32c_many: %zd offsets but %zd lengths; pass one length per "
                         "offset, or one int for all",
                         n, m);
            return NULL;
        }
    }
    Py_ssize_t *offs = ssize_array(offs_obj, n, "offsets");
    if (offs == NULL) return NULL;
    Py_ssize_t *lens = one_len >= 0 ? NULL : ssize_array(lens_obj, n, "lengths");
    if (one_len < 0 && lens == NULL) {
        PyMem_Free(offs);
        return NULL;
    }
    uint32_t *crcs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (crcs == NULL) {
        PyMem_Free(offs);
        PyMem_Free(lens);
        return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    if (get_buffer(buf, &view, 0, "crc32c_many", "buf") < 0) goto done;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = lens ? lens[i] : one_len;
        if (offs[i] > view.len || len > view.len - offs[i]) {
            PyErr_Format(PyExc_ValueError,
                         "crc32c_many: range %zd is [%zd, %zd + %zd), outside the %zd-byte "
                         "buffer; pass offsets and lengths within it",
                         i, offs[i], offs[i], len, view.len);
            PyBuffer_Release(&view);
            goto done;
        }
        total += (size_t)len;
    }
    const unsigned char *base = (const unsigned char *)view.buf;
    run_fn run = active_run;
    if (total >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            crcs[i] = run(0, base + offs[i], NULL, (size_t)(lens ? lens[i] : one_len));
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            crcs[i] = run(0, base + offs[i], NULL, (size_t)(lens ? lens[i] : one_len));
    }
    PyBuffer_Release(&view);
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SetItem(out, i, v); /* steals v */
    }
done:
    PyMem_Free(offs);
    PyMem_Free(lens);
    PyMem_Free(crcs);
    return out;
}

static PyObject *py_copy_crc32c(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"src", "dst", "value", NULL};
    PyObject *src, *dst, *crc_obj = NULL;
    uint32_t crc;
    Py_buffer sv, dv;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:copy_crc32c", kwlist, &src, &dst,
                                     &crc_obj))
        return NULL;
    if (parse_crc(crc_obj, &crc) < 0) return NULL;
    if (get_buffer(src, &sv, 0, "copy_crc32c", "src") < 0) return NULL;
    if (get_buffer(dst, &dv, 1, "copy_crc32c", "dst") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    if (sv.len != dv.len) {
        PyErr_Format(PyExc_ValueError,
                     "copy_crc32c: src is %zd bytes but dst is %zd; pass a destination of "
                     "exactly the source's size",
                     sv.len, dv.len);
        PyBuffer_Release(&sv);
        PyBuffer_Release(&dv);
        return NULL;
    }
    size_t len = (size_t)sv.len;
    const unsigned char *s = (const unsigned char *)sv.buf;
    unsigned char *d = (unsigned char *)dv.buf;
    run_fn run = active_run;
    if (len && s < d + len && d < s + len && s != d) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_crc32c: src and dst overlap; copy between distinct buffers");
        PyBuffer_Release(&sv);
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = run(crc, s, s == d ? NULL : d, len);
        Py_END_ALLOW_THREADS
    } else {
        crc = run(crc, s, s == d ? NULL : d, len);
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_set_stream_threshold(PyObject *self, PyObject *arg) {
    (void)self;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "_set_stream_threshold: bytes must be >= 0");
        return NULL;
    }
#if defined(CTX_X86)
    nt_min_bytes = (size_t)n;
#endif
    Py_RETURN_NONE;
}

static PyObject *py_implementation(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(active_name);
}

static PyObject *py_hardware(PyObject *self, PyObject *unused) {
    /* the fastest hardware path, which is what "hardware" selects */
    (void)self;
    (void)unused;
    if (hw_name == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(hw_name);
}

static PyObject *py_available(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < NPATHS; i++) {
        if (!paths[i].ok) continue;
        PyObject *name = PyUnicode_FromString(paths[i].name);
        if (name == NULL || PyList_Append(out, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(name);
    }
    return out;
}

static PyObject *py_set_implementation(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (name == NULL) return NULL;
    if (strcmp(name, "hardware") == 0) {
        if (hw_name == NULL) {
            PyErr_SetString(PyExc_ValueError,
                            "set_implementation: this CPU has no CRC32C instructions "
                            "(SSE4.2 / ARMv8 CRC); use \"table\"");
            return NULL;
        }
        name = hw_name;
    }
    for (size_t i = 0; i < NPATHS; i++) {
        if (strcmp(name, paths[i].name) != 0) continue;
        if (!paths[i].ok) {
            PyErr_Format(PyExc_ValueError,
                         "set_implementation: this CPU cannot run %R; see available()", arg);
            return NULL;
        }
        active_run = paths[i].run;
        active_name = paths[i].name;
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError,
                 "set_implementation: unknown implementation %R; use \"hardware\", "
                 "\"table\" or a name from available()",
                 arg);
    return NULL;
}

/* ------------------------------------------------------------------ batches (mtcopy)
 *
 * A get or a put of a batch moves many blocks between one mapped slab region and the
 * caller's buffers. One call per block costs a Python round (argument parsing, two buffer
 * exports, a GIL release) per block: at 64 KiB blocks that was a third of a get. These two
 * functions take a run of slots of one region and every buffer of it, check every bound
 * and size first (nothing is copied if any is wrong), then copy with the GIL released once.
 *
 * copy_crc32c_from_slots(region, offsets, lengths, dsts, crcs=None) -> (done, bad)
 *   region[offsets[i] : offsets[i] + lengths[i]] into dsts[i], in order. With crcs, each
 *   block is copied and CRC'd in one pass (the CRC of the bytes stored in dsts[i]); the
 *   first block whose CRC differs from crcs[i] has its dst zeroed and ends the call:
 *   done = i, bad = i. Without crcs, a plain copy: done = n, bad = None.
 * copy_crc32c_to_slots(srcs, region, offsets, lengths) -> list[int]
 *   srcs[i] into region[offsets[i] : offsets[i] + lengths[i]]; each block's CRC32C, of the
 *   words as stored into the region (another mapper writing the slot meanwhile cannot
 *   make the CRC cover bytes other than the source's).
 */

typedef struct {
    Py_ssize_t n;
    Py_buffer region;
    Py_buffer *bufs; /* n exported buffers (dsts or srcs) */
    Py_ssize_t nbufs; /* how many of bufs are held */
    uint64_t *off, *len;
    uint32_t *crc; /* NULL without crcs */
    int have_region;
} batch_t;

static void batch_free(batch_t *b) {
    for (Py_ssize_t i = 0; i < b->nbufs; i++) PyBuffer_Release(&b->bufs[i]);
    if (b->have_region) PyBuffer_Release(&b->region);
    PyMem_Free(b->bufs);
    PyMem_Free(b->off);
    PyMem_Free(b->len);
    PyMem_Free(b->crc);
}

/* seq[i] as an unsigned integer <= max; ValueError naming fn, what and i otherwise. */
static int seq_u64(PyObject *seq, Py_ssize_t i, uint64_t max, uint64_t *out, const char *fn,
                   const char *what) {
    PyObject *item = PySequence_GetItem(seq, i);
    if (item == NULL) return -1;
    int is_int = PyLong_Check(item);
    unsigned long long v = is_int ? PyLong_AsUnsignedLongLong(item) : 0;
    int failed = !is_int || (v == (unsigned long long)-1 && PyErr_Occurred()) || v > max;
    Py_DECREF(item);
    if (failed) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s[%zd] must be an int in [0, %llu]", fn, what, i,
                     (unsigned long long)max);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static Py_ssize_t seq_len(PyObject *seq, const char *fn, const char *what) {
    Py_ssize_t n = PySequence_Check(seq) ? PySequence_Size(seq) : -1;
    if (n < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s must be a sequence (list, tuple)", fn, what);
    }
    return n;
}

/* Parse and check a batch: every slot inside the region, every buffer exactly its slot's
 * length, buffers writable where written. On error, everything taken is released. */
static int batch_parse(batch_t *b, const char *fn, PyObject *region, int region_writable,
                       PyObject *offsets, PyObject *lengths, PyObject *bufs,
                       int bufs_writable, PyObject *crcs) {
    memset(b, 0, sizeof(*b));
    Py_ssize_t n = seq_len(bufs, fn, bufs_writable ? "dsts" : "srcs");
    if (n < 0) return -1;
    Py_ssize_t no = seq_len(offsets, fn, "offsets"), nl = seq_len(lengths, fn, "lengths");
    Py_ssize_t nc = crcs == NULL ? n : seq_len(crcs, fn, "crcs");
    if (no < 0 || nl < 0 || nc < 0) return -1;
    if (no != n || nl != n || nc != n) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %zd buffers but %zd offsets, %zd lengths and %zd crcs; pass one of "
                     "each per block",
                     fn, n, no, nl, nc);
        return -1;
    }
    b->n = n;
    if (get_buffer(region, &b->region, region_writable, fn, "region") < 0) return -1;
    b->have_region = 1;
    size_t cells = n ? (size_t)n : 1;
    b->bufs = PyMem_Calloc(cells, sizeof(Py_buffer));
    b->off = PyMem_Malloc(cells * sizeof(uint64_t));
    b->len = PyMem_Malloc(cells * sizeof(uint64_t));
    if (crcs != NULL) b->crc = PyMem_Malloc(cells * sizeof(uint32_t));
    if (!b->bufs || !b->off || !b->len || (crcs != NULL && !b->crc)) {
        PyErr_NoMemory();
        goto fail;
    }
    uint64_t rlen = (uint64_t)b->region.len;
    const unsigned char *r0 = (const unsigned char *)b->region.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t c;
        if (seq_u64(offsets, i, UINT64_MAX, &b->off[i], fn, "offsets") < 0 ||
            seq_u64(lengths, i, UINT64_MAX, &b->len[i], fn, "lengths") < 0)
            goto fail;
        if (crcs != NULL) {
            if (seq_u64(crcs, i, 0xffffffffULL, &c, fn, "crcs") < 0) goto fail;
            b->crc[i] = (uint32_t)c;
        }
        if (b->off[i] > rlen || b->len[i] > rlen - b->off[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s: slot %zd [%llu, %llu + %llu) lies outside the region (%llu "
                         "bytes); nothing was copied",
                         fn, i, (unsigned long long)b->off[i], (unsigned long long)b->off[i],
                         (unsigned long long)b->len[i], (unsigned long long)rlen);
            goto fail;
        }
        PyObject *item = PySequence_GetItem(bufs, i);
        if (item == NULL) goto fail;
        int rc = get_buffer(item, &b->bufs[i], bufs_writable, fn,
                            bufs_writable ? "a dst" : "a src");
        Py_DECREF(item);
        if (rc < 0) goto fail;
        b->nbufs = i + 1;
        if ((uint64_t)b->bufs[i].len != b->len[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s: buffer %zd is %zd bytes but its slot is %llu; pass buffers of "
                         "exactly their slot's length; nothing was copied",
                         fn, i, b->bufs[i].len, (unsigned long long)b->len[i]);
            goto fail;
        }
        const unsigned char *p = (const unsigned char *)b->bufs[i].buf;
        const unsigned char *s = r0 + b->off[i];
        size_t len = (size_t)b->len[i];
        if (len && p < s + len && s < p + len) {
            PyErr_Format(PyExc_ValueError,
                         "%s: buffer %zd overlaps its slot; copy between distinct buffers",
                         fn, i);
            goto fail;
        }
    }
    return 0;
fail:
    batch_free(b);
    return -1;
}

static size_t batch_bytes(const batch_t *b) {
    size_t total = 0;
    for (Py_ssize_t i = 0; i < b->n; i++) total += (size_t)b->len[i];
    return total;
}

/* The get's loop (GIL released by the caller when large); returns done, sets *bad. */
static Py_ssize_t from_slots_run(const batch_t *b, run_fn run, Py_ssize_t *bad) {
    const unsigned char *r0 = (const unsigned char *)b->region.buf;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        unsigned char *d = (unsigned char *)b->bufs[i].buf;
        size_t len = (size_t)b->len[i];
        if (b->crc == NULL) {
            memcpy(d, r0 + b->off[i], len);
        } else if (run(0, r0 + b->off[i], d, len) != b->crc[i]) {
            memset(d, 0, len); /* no byte of a block that failed its check stays */
            *bad = i;
            return i;
        }
    }
    *bad = -1;
    return b->n;
}

static PyObject *py_copy_crc32c_from_slots(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"region", "offsets", "lengths", "dsts", "crcs", NULL};
    const char *fn = "copy_crc32c_from_slots";
    PyObject *region, *offsets, *lengths, *dsts, *crcs = Py_None;
    batch_t b;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|O:copy_crc32c_from_slots", kwlist,
                                     &region, &offsets, &lengths, &dsts, &crcs))
        return NULL;
    if (batch_parse(&b, fn, region, 0, offsets, lengths, dsts, 1,
                    crcs == Py_None ? NULL : crcs) < 0)
        return NULL;
    run_fn run = active_run;
    Py_ssize_t done, bad;
    if (batch_bytes(&b) >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        done = from_slots_run(&b, run, &bad);
        Py_END_ALLOW_THREADS
    } else {
        done = from_slots_run(&b, run, &bad);
    }
    batch_free(&b);
    if (bad < 0) return Py_BuildValue("(nO)", done, Py_None);
    return Py_BuildValue("(nn)", done, bad);
}

static void to_slots_run(const batch_t *b, run_fn run, uint32_t *out) {
    unsigned char *r0 = (unsigned char *)b->region.buf;
    for (Py_ssize_t i = 0; i < b->n; i++)
        out[i] = run(0, (const unsigned char *)b->bufs[i].buf, r0 + b->off[i],
                     (size_t)b->len[i]);
}

static PyObject *py_copy_crc32c_to_slots(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"srcs", "region", "offsets", "lengths", NULL};
    const char *fn = "copy_crc32c_to_slots";
    PyObject *srcs, *region, *offsets, *lengths;
    batch_t b;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:copy_crc32c_to_slots", kwlist, &srcs,
                                     &region, &offsets, &lengths))
        return NULL;
    if (batch_parse(&b, fn, region, 1, offsets, lengths, srcs, 0, NULL) < 0) return NULL;
    uint32_t *crcs = PyMem_Malloc((b.n ? (size_t)b.n : 1) * sizeof(uint32_t));
    if (crcs == NULL) {
        batch_free(&b);
        return PyErr_NoMemory();
    }
    run_fn run = active_run;
    if (batch_bytes(&b) >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        to_slots_run(&b, run, crcs);
        Py_END_ALLOW_THREADS
    } else {
        to_slots_run(&b, run, crcs);
    }
    Py_ssize_t n = b.n;
    batch_free(&b);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (v == NULL || PyList_SetItem(out, i, v) < 0) {
            Py_CLEAR(out);
        }
    }
    PyMem_Free(crcs);
    return out;
}
/* copy_crc32c_between(src, src_offsets, dst, dst_offsets, length) -> list[int]
 *   src[src_offsets[i] : +length] into dst[dst_offsets[i] : +length], each block's CRC32C
 *   of the words as stored (fused). Why: a staged put copies blocks from a staging region
 *   (one buffer) into the slots of a slab (another) with no Python object per block; every
 *   range is checked against its buffer, and against overlap, before any copy. */
static PyObject *py_copy_crc32c_between(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"src", "src_offsets", "dst", "dst_offsets", "length", NULL};
    const char *fn = "copy_crc32c_between";
    PyObject *src, *soffs, *dst, *doffs;
    Py_ssize_t length;
    Py_buffer sv, dv;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOn:copy_crc32c_between", kwlist, &src,
                                     &soffs, &dst, &doffs, &length))
        return NULL;
    if (length < 0) {
        PyErr_Format(PyExc_ValueError, "%s: length must be >= 0", fn);
        return NULL;
    }
    Py_ssize_t n = seq_len(soffs, fn, "src_offsets");
    Py_ssize_t m = n < 0 ? -1 : seq_len(doffs, fn, "dst_offsets");
    if (n < 0 || m < 0) return NULL;
    if (n != m) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %zd src_offsets but %zd dst_offsets; pass one of each per block", fn,
                     n, m);
        return NULL;
    }
    if (get_buffer(src, &sv, 0, fn, "src") < 0) return NULL;
    if (get_buffer(dst, &dv, 1, fn, "dst") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    size_t cells = n ? (size_t)n : 1;
    uint64_t *so = PyMem_Malloc(cells * sizeof(uint64_t));
    uint64_t *dof = PyMem_Malloc(cells * sizeof(uint64_t));
    uint32_t *crcs = PyMem_Malloc(cells * sizeof(uint32_t));
    PyObject *out = NULL;
    if (!so || !dof || !crcs) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t len = (uint64_t)length, slen = (uint64_t)sv.len, dlen = (uint64_t)dv.len;
    const unsigned char *s0 = (const unsigned char *)sv.buf;
    unsigned char *d0 = (unsigned char *)dv.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (seq_u64(soffs, i, UINT64_MAX, &so[i], fn, "src_offsets") < 0 ||
            seq_u64(doffs, i, UINT64_MAX, &dof[i], fn, "dst_offsets") < 0)
            goto done;
        if (so[i] > slen || len > slen - so[i] || dof[i] > dlen || len > dlen - dof[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block %zd [%llu, +%llu) -> [%llu, +%llu) lies outside src "
                         "(%llu bytes) or dst (%llu bytes); nothing was copied",
                         fn, i, (unsigned long long)so[i], (unsigned long long)len,
                         (unsigned long long)dof[i], (unsigned long long)len,
                         (unsigned long long)slen, (unsigned long long)dlen);
            goto done;
        }
        const unsigned char *a = s0 + so[i];
        const unsigned char *b = d0 + dof[i];
        if (len && a < b + len && b < a + len) {
            PyErr_Format(PyExc_ValueError,
                         "%s: block %zd's source and destination overlap; copy between "
                         "distinct buffers; nothing was copied",
                         fn, i);
            goto done;
        }
    }
    run_fn run = active_run;
    if ((size_t)n * (size_t)len >= GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            crcs[i] = run(0, s0 + so[i], d0 + dof[i], (size_t)len);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            crcs[i] = run(0, s0 + so[i], d0 + dof[i], (size_t)len);
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (v == NULL || PyList_SetItem(out, i, v) < 0) Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    PyMem_Free(so);
    PyMem_Free(dof);
    PyMem_Free(crcs);
    return out;
}
/* ------------------------------------------------------------------ end of batches */

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, value=0) -> int\n\nCRC32C of data, continuing from value."},
    {"copy_crc32c", (PyCFunction)(void (*)(void))py_copy_crc32c,
     METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c(src, dst, value=0) -> int\n\nCopy src into dst (same size) and return the "
     "CRC32C, continuing from value, of the words as stored into dst."},
    {"crc32c_many", (PyCFunction)(void (*)(void))py_crc32c_many,
     METH_VARARGS | METH_KEYWORDS,
     "crc32c_many(buf, offsets, lengths) -> list[int]\n\nThe CRC32C (from 0) of each "
     "buf[offsets[i]:offsets[i] + lengths[i]] (lengths: one int for all, or one per "
     "offset), in one call with the GIL released once; ValueError before any work when a "
     "range is outside buf."},
    {"implementation", py_implementation, METH_NOARGS,
     "implementation() -> str: the active path (\"sse4.2\", \"armv8-crc\" or \"table\")."},
    {"hardware", py_hardware, METH_NOARGS,
     "hardware() -> str | None: this CPU's hardware path, if it has one."},
    {"available", py_available, METH_NOARGS,
     "available() -> list[str]: the paths this CPU runs, slowest first (\"table\" always)."},
    {"set_implementation", py_set_implementation, METH_O,
     "set_implementation(name): \"hardware\" (the fastest), \"table\" or a name from "
     "available() (tests, benchmarks)."},
    {"_set_stream_threshold", py_set_stream_threshold, METH_O,
     "_set_stream_threshold(bytes): copies of at least this many bytes use non-temporal "
     "stores (x86-64 with AVX2; for measuring)."},
    {"copy_crc32c_from_slots", (PyCFunction)(void (*)(void))py_copy_crc32c_from_slots,
     METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c_from_slots(region, offsets, lengths, dsts, crcs=None) -> (done, bad)\n\n"
     "Copy each slot of region into its dst (all bounds and sizes checked first, the GIL "
     "released once); with crcs, CRC each in the same pass and stop at the first mismatch, "
     "zeroing that dst: (done, bad) = (i, i); else (n, None)."},
    {"copy_crc32c_to_slots", (PyCFunction)(void (*)(void))py_copy_crc32c_to_slots,
     METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c_to_slots(srcs, region, offsets, lengths) -> list[int]\n\nCopy each src "
     "into its slot of region (all bounds and sizes checked first, the GIL released once) "
     "and return each block's CRC32C of the words as stored."},
    {"copy_crc32c_between", (PyCFunction)(void (*)(void))py_copy_crc32c_between,
     METH_VARARGS | METH_KEYWORDS,
     "copy_crc32c_between(src, src_offsets, dst, dst_offsets, length) -> list[int]\n\n"
     "Copy each src[src_offsets[i]:+length] into dst[dst_offsets[i]:+length] (every range "
     "and overlap checked first, the GIL released once) and return each block's CRC32C of "
     "the words as stored."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_crc32c_native",
    "CRC32C and fused copy + CRC32C (SSE4.2 / ARMv8 CRC / tables).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crc32c_native(void) {
    init_tables();
    detect();
    return PyModule_Create(&module);
}
#endif /* CRC32C_NO_PYTHON */
