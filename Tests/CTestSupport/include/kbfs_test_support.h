#ifndef KEYBAGFS_TEST_SUPPORT_H
#define KEYBAGFS_TEST_SUPPORT_H
/* What the tests need from OpenSSL to know what a key looks like in memory. */
#include <stddef.h>
#include <stdint.h>
/* The 15 round keys of AES-256 under `key`, as OpenSSL's AES_KEY holds them (240 bytes). */
int kbfs_test_aes256_round_keys(const uint8_t *key, uint8_t *out240);
/* One AES-256 block encryption. */
int kbfs_test_aes256_block(const uint8_t *key, const uint8_t *in16, uint8_t *out16);
/* The memory scans' first pass: the offsets j in [start, len - width] whose 8 bytes at j hash
   (w * 0x9E3779B97F4A7C15 >> 44, w read little-endian) to a bit set in `filter` (2^20 bits).
   Writes up to `cap` of them to `out` and returns how many; when that is `cap`, resume from
   out[cap - 1] + 1. Plain C, so an unoptimised test build still scans ~100 MB in well under
   a second. */
size_t kbfs_test_filter_hits(const uint8_t *buf, size_t len, size_t width, const uint64_t *filter, size_t start,
                             size_t *out, size_t cap);
/* Syscalls and flags only the POSIX tests use. */
extern const int kbfs_O_DIRECT;
extern const int kbfs_SEEK_DATA;
extern const int kbfs_SEEK_HOLE;
/* copy_file_range(2). */
long kbfs_copy_file_range(int fd_in, long long *off_in, int fd_out, long long *off_out, unsigned long len);
#endif
