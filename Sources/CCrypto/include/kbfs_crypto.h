#ifndef KEYBAGFS_CCRYPTO_H
#define KEYBAGFS_CCRYPTO_H
/* Hardware AES for file contents through OpenSSL 3's libcrypto: AES-256-GCM and
   XAES-256-GCM (c2sp.org/XAES-256-GCM) on one block at a time. No OpenSSL type crosses
   this header. Every key schedule lives in an OpenSSL context taken from a pool for one
   call; `kbfs_crypto_forget` frees the idle ones and marks the busy ones to be freed when
   their call ends. OpenSSL's memory comes from `kbfs_crypto_init`'s allocator: locked
   against swap where the process may lock memory, and zeroed when freed. */

#include <stddef.h>
#include <stdint.h>

/* Installs the allocator and fetches the ciphers; 1 on success. Call before any other use
   of OpenSSL in the process (later calls return the first result). */
int kbfs_crypto_init(void);
/* 1 when OpenSSL allocates through keybagfs' allocator (init came first). */
int kbfs_crypto_owns_memory(void);
/* OpenSSL allocations whose pages could not be locked (RLIMIT_MEMLOCK without CAP_IPC_LOCK). */
long kbfs_crypto_unlocked_allocations(void);
/* 1 when the CPU has AES and carry-less multiply instructions. */
int kbfs_cpu_has_aes(void);

/* AES-256-GCM, 12-byte nonce, 16-byte tag. 0 on success, -1 when the tag does not verify
   (the output is then zeroed), -2 on a library failure. */
int kbfs_aes256gcm_seal(const uint8_t *key, const uint8_t *nonce12, const uint8_t *ad, size_t adlen,
                        const uint8_t *m, size_t mlen, uint8_t *c, uint8_t *tag);
int kbfs_aes256gcm_open(const uint8_t *key, const uint8_t *nonce12, const uint8_t *ad, size_t adlen,
                        const uint8_t *c, size_t clen, const uint8_t *tag, uint8_t *m);

/* XAES-256-GCM's CMAC subkey K1 of `key` (16 bytes) into `k1`, computed once per key. */
int kbfs_xaes_subkey(const uint8_t *key, uint8_t *k1);
/* XAES-256-GCM, 24-byte nonce: the derived key's AES-256-GCM under nonce[12..<24].
   Seal: `nonce24` holds 24 fresh random bytes on entry and the nonce used on return (a
   context continues its batch under the same key: same prefix, next suffix; docs/FORMAT.md). */
int kbfs_xaes256gcm_seal(const uint8_t *key, const uint8_t *k1, uint8_t *nonce24, const uint8_t *ad,
                         size_t adlen, const uint8_t *m, size_t mlen, uint8_t *c, uint8_t *tag);
int kbfs_xaes256gcm_open(const uint8_t *key, const uint8_t *k1, const uint8_t *nonce24, const uint8_t *ad,
                         size_t adlen, const uint8_t *c, size_t clen, const uint8_t *tag, uint8_t *m);

/* Tests only: blocks per XAES nonce batch (0 or more than the default 2^16: the default). */
void kbfs_test_set_xaes_batch(uint32_t blocks);

/* Frees every idle context now and each busy one when its call returns. */
void kbfs_crypto_forget(void);
/* Contexts that exist (idle or busy), for tests and the bench. */
long kbfs_crypto_contexts(void);

/* Zeroes 16 KiB of this thread's stack below the caller's frame, where the cipher calls
   the caller just made kept their locals (libsodium's XChaCha20 subkeys, for one), and
   the vector registers (OpenSSL's GHASH code leaves key-table values in them). */
void kbfs_scrub_stack(void);

#endif
