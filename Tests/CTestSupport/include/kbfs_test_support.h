#ifndef KEYBAGFS_TEST_SUPPORT_H
#define KEYBAGFS_TEST_SUPPORT_H
/* What the tests need from OpenSSL to know what a key looks like in memory. */
#include <stdint.h>
/* The 15 round keys of AES-256 under `key`, as OpenSSL's AES_KEY holds them (240 bytes). */
int kbfs_test_aes256_round_keys(const uint8_t *key, uint8_t *out240);
/* One AES-256 block encryption. */
int kbfs_test_aes256_block(const uint8_t *key, const uint8_t *in16, uint8_t *out16);
/* Syscalls and flags only the POSIX tests use. */
extern const int kbfs_O_DIRECT;
extern const int kbfs_SEEK_DATA;
extern const int kbfs_SEEK_HOLE;
/* copy_file_range(2). */
long kbfs_copy_file_range(int fd_in, long long *off_in, int fd_out, long long *off_out, unsigned long len);
#endif
