/* Test support: AES-256 key schedules and single blocks from OpenSSL's low-level API, so a
   memory scan can look for every round key of a file key. */
#define _GNU_SOURCE
#define OPENSSL_SUPPRESS_DEPRECATED
#include "kbfs_test_support.h"
#include <openssl/aes.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

const int kbfs_O_DIRECT = O_DIRECT;
const int kbfs_SEEK_DATA = SEEK_DATA;
const int kbfs_SEEK_HOLE = SEEK_HOLE;

long kbfs_copy_file_range(int fd_in, long long *off_in, int fd_out, long long *off_out, unsigned long len) {
    off_t i = *off_in, o = *off_out;
    ssize_t n = copy_file_range(fd_in, &i, fd_out, &o, len, 0);
    *off_in = i; *off_out = o;
    return (long)n;
}

int kbfs_test_aes256_round_keys(const uint8_t *key, uint8_t *out240) {
    AES_KEY k;
    if (AES_set_encrypt_key(key, 256, &k) != 0) return -1;
    /* The schedule's bytes as OpenSSL keeps them (x86-64: AES's own byte order, as the
       AES-NI code stores it); the caller also looks for each word byte-reversed. */
    memcpy(out240, k.rd_key, 240);
    memset(&k, 0, sizeof k);
    return 0;
}

int kbfs_test_aes256_block(const uint8_t *key, const uint8_t *in16, uint8_t *out16) {
    AES_KEY k;
    if (AES_set_encrypt_key(key, 256, &k) != 0) return -1;
    AES_encrypt(in16, out16, &k);
    memset(&k, 0, sizeof k);
    return 0;
}

size_t kbfs_test_filter_hits(const uint8_t *buf, size_t len, size_t width, const uint64_t *filter, size_t start,
                             size_t *out, size_t cap) {
    size_t n = 0;
    if (len < width || width < 8) return 0;
    for (size_t j = start; j + width <= len && n < cap; j++) {
        uint64_t w;
        memcpy(&w, buf + j, 8);
        uint64_t h = (w * 0x9E3779B97F4A7C15ull) >> 44;
        if (filter[h >> 6] & (1ull << (h & 63))) out[n++] = j;
    }
    return n;
}
