/* Built and run by tests/shared/test_crc32c_paths.py (natively, and for aarch64 under
 * qemu-aarch64-static when the cross compiler is installed): the C core without Python. */
/* C-only check of every path this CPU runs: RFC 3720 vectors, and agreement with the table
 * path (copy and CRC) on random lengths, offsets and initial CRCs. */
#define CRC32C_NO_PYTHON
#include <stdio.h>
#include <stdlib.h>
#include "_crc32c_native.c"
int main(void) {
    init_tables();
    detect();
    static unsigned char v[5][32];
    size_t vl[5] = {32, 32, 32, 32, 9};
    uint32_t want[5] = {0x8A9136AA, 0x62A8AB43, 0x46DD794E, 0x113FDB5C, 0xE3069283};
    for (int i = 0; i < 32; i++) { v[0][i] = 0; v[1][i] = 0xff; v[2][i] = i; v[3][i] = 31 - i; }
    memcpy(v[4], "123456789", 9);
    int bad = 0;
    size_t n = (2u << 20) + 200;
    unsigned char *src = malloc(n), *dst = malloc(n);
    srand(7);
    for (size_t i = 0; i < n; i++) src[i] = rand();
    for (size_t p = 0; p < NPATHS; p++) {
        if (!paths[p].ok) { printf("%-20s not run by this CPU\n", paths[p].name); continue; }
        for (int i = 0; i < 5; i++)
            if (paths[p].run(0, v[i], NULL, vl[i]) != want[i]) { printf("%s vector %d FAIL\n", paths[p].name, i); bad++; }
        for (int t = 0; t < 300; t++) {
            size_t len = t < 20 ? (size_t[]){0,1,7,8,9,255,767,768,769,1023,1024,1025,24575,24576,24577,65535,65536,65537,2u<<20,300001}[t] : (size_t)rand() % 300000;
            size_t so = rand() % 64, d0 = rand() % 64;
            uint32_t init = rand();
            uint32_t w = table_run(init, src + so, NULL, len);
            memset(dst, 0x5a, n);
            if (paths[p].run(init, src + so, NULL, len) != w) { printf("%s crc len %zu FAIL\n", paths[p].name, len); bad++; }
            if (paths[p].run(init, src + so, dst + d0, len) != w || memcmp(dst + d0, src + so, len)) { printf("%s copy len %zu FAIL\n", paths[p].name, len); bad++; }
        }
        printf("%-20s %s\n", paths[p].name, bad ? "FAIL" : "ok");
    }
    return bad != 0;
}
