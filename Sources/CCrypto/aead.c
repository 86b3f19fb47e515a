/* Hardware AES for file contents: OpenSSL 3 EVP contexts from a pool, XAES-256-GCM's key
   derivation on top, and the allocator OpenSSL uses in keybagfs. See kbfs_crypto.h. */
#define _GNU_SOURCE
#include "kbfs_crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__aarch64__)
#include <sys/auxv.h>
#include <asm/hwcap.h>
#endif

/* ---- The allocator: a size header before each block, pages locked, zeroed on free. ---- */

/* Bytes before each block: its size, padded to keep 16-byte alignment. */
#define HEADER 16

static atomic_long unlocked_allocations;

/* Locks the pages under [p, p+n); counts a failure instead of failing the allocation. */
static void lock_pages(void *p, size_t n) {
    static long page;
    if (page == 0) page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)p & ~(uintptr_t)(page - 1);
    uintptr_t end = ((uintptr_t)p + n + page - 1) & ~(uintptr_t)(page - 1);
    if (mlock((void *)start, end - start) != 0) atomic_fetch_add(&unlocked_allocations, 1);
}

/* OpenSSL's malloc. */
static void *kb_malloc(size_t n, const char *file, int line) {
    (void)file; (void)line;
    if (n > SIZE_MAX - HEADER) return NULL;
    unsigned char *b = malloc(n + HEADER);
    if (b == NULL) return NULL;
    memcpy(b, &n, sizeof n);
    lock_pages(b, n + HEADER);
    return b + HEADER;
}

/* OpenSSL's free: the whole block, header included, is zeroed first. */
static void kb_free(void *p, const char *file, int line) {
    (void)file; (void)line;
    if (p == NULL) return;
    unsigned char *b = (unsigned char *)p - HEADER;
    size_t n;
    memcpy(&n, b, sizeof n);
    explicit_bzero(b, n + HEADER);
    free(b);
}

/* OpenSSL's realloc: always a new block, so the old one is zeroed, never left behind. */
static void *kb_realloc(void *p, size_t n, const char *file, int line) {
    if (p == NULL) return kb_malloc(n, file, line);
    if (n == 0) { kb_free(p, file, line); return NULL; }
    void *q = kb_malloc(n, file, line);
    if (q == NULL) return NULL;
    size_t old;
    memcpy(&old, (unsigned char *)p - HEADER, sizeof old);
    memcpy(q, p, old < n ? old : n);
    kb_free(p, file, line);
    return q;
}

/* ---- Init ---- */

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int owns_memory, init_ok;
static EVP_CIPHER *gcm_cipher, *ecb_cipher;
/* Bumped in a forked child: a nonce batch begun before the fork is not continued after it. */
static atomic_uint fork_generation;

static void after_fork_in_child(void) { atomic_fetch_add(&fork_generation, 1); }

static void init_once(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    owns_memory = CRYPTO_set_mem_functions(kb_malloc, kb_realloc, kb_free);
    gcm_cipher = EVP_CIPHER_fetch(NULL, "AES-256-GCM", NULL);
    ecb_cipher = EVP_CIPHER_fetch(NULL, "AES-256-ECB", NULL);
    init_ok = gcm_cipher != NULL && ecb_cipher != NULL;
}

int kbfs_crypto_init(void) { pthread_once(&once, init_once); return init_ok; }
int kbfs_crypto_owns_memory(void) { kbfs_crypto_init(); return owns_memory; }
long kbfs_crypto_unlocked_allocations(void) { return atomic_load(&unlocked_allocations); }

int kbfs_cpu_has_aes(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul");
#elif defined(__aarch64__)
    unsigned long hw = getauxval(AT_HWCAP);
    return (hw & HWCAP_AES) && (hw & HWCAP_PMULL);
#else
    return 0;
#endif
}

/* ---- The context pool ---- */

/* One call's working set: a GCM and an ECB context and 64 bytes of scratch, all in
   OpenSSL-allocated (locked, zeroed-on-free) memory. */
struct kb_ctx {
    EVP_CIPHER_CTX *gcm;
    EVP_CIPHER_CTX *ecb;
    unsigned char scratch[64];   /* [0,32): CMAC inputs, [32,64): XAES derived key */
    unsigned char ecb_key[32];   /* the key `ecb` is keyed with (valid when ecb_keyed) */
    int ecb_keyed;
    /* XAES: `gcm` holds the key derived from ecb_key, the subkey gcm_k1 and the nonce
       prefix gcm_prefix. */
    unsigned char gcm_prefix[12];
    unsigned char gcm_k1[16];
    int gcm_xaes;
    /* XAES sealing: the batch of nonces this context hands out under ecb_key: a random
       prefix and first suffix (batch_nonce), of which batch_count are used. */
    unsigned char batch_nonce[24];
    uint32_t batch_count;
    int batch_live;
    unsigned batch_generation;
    uint64_t epoch;          /* the pool's epoch when taken */
    struct kb_ctx *next;
};

/* Lock order: `pool_lock` is a leaf; OpenSSL is never called with it held. */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kb_ctx *pool_head;
static uint64_t pool_epoch;
static atomic_long contexts;

static void ctx_free(struct kb_ctx *c) {
    EVP_CIPHER_CTX_free(c->gcm);
    EVP_CIPHER_CTX_free(c->ecb);
    OPENSSL_clear_free(c, sizeof *c);
    atomic_fetch_sub(&contexts, 1);
}

static struct kb_ctx *ctx_new(void) {
    if (!kbfs_crypto_init()) return NULL;
    struct kb_ctx *c = OPENSSL_zalloc(sizeof *c);
    if (c == NULL) return NULL;
    atomic_fetch_add(&contexts, 1);
    c->gcm = EVP_CIPHER_CTX_new();
    c->ecb = EVP_CIPHER_CTX_new();
    if (c->gcm == NULL || c->ecb == NULL
        || EVP_EncryptInit_ex(c->gcm, gcm_cipher, NULL, NULL, NULL) != 1
        || EVP_EncryptInit_ex(c->ecb, ecb_cipher, NULL, NULL, NULL) != 1
        || EVP_CIPHER_CTX_set_padding(c->ecb, 0) != 1) {
        ctx_free(c);
        return NULL;
    }
    return c;
}

/* Takes an idle context or makes one. */
static struct kb_ctx *ctx_take(void) {
    pthread_mutex_lock(&pool_lock);
    struct kb_ctx *c = pool_head;
    if (c != NULL) pool_head = c->next;
    uint64_t epoch = pool_epoch;
    pthread_mutex_unlock(&pool_lock);
    if (c == NULL && (c = ctx_new()) == NULL) return NULL;
    c->epoch = epoch;
    c->next = NULL;
    return c;
}

/* Returns a context; one taken before the last forget is freed instead. */
static void ctx_give(struct kb_ctx *c) {
    pthread_mutex_lock(&pool_lock);
    int keep = c->epoch == pool_epoch;
    if (keep) { c->next = pool_head; pool_head = c; }
    pthread_mutex_unlock(&pool_lock);
    if (!keep) ctx_free(c);
}

void kbfs_crypto_forget(void) {
    pthread_mutex_lock(&pool_lock);
    struct kb_ctx *c = pool_head;
    pool_head = NULL;
    pool_epoch++;
    pthread_mutex_unlock(&pool_lock);
    while (c != NULL) { struct kb_ctx *n = c->next; ctx_free(c); c = n; }
}

long kbfs_crypto_contexts(void) { return atomic_load(&contexts); }

/* ---- AES-256-GCM on one context ---- */

/* `key` NULL: the context keeps the key it holds (only the nonce is set). */
static int gcm_seal(struct kb_ctx *c, const uint8_t *key, const uint8_t *n12, const uint8_t *ad, size_t adlen,
                    const uint8_t *m, size_t mlen, uint8_t *out, uint8_t *tag) {
    int len = 0, fin = 0;
    if (mlen > INT32_MAX || adlen > INT32_MAX) return -2;
    if (EVP_EncryptInit_ex(c->gcm, NULL, NULL, key, n12) != 1) return -2;
    if (adlen > 0 && EVP_EncryptUpdate(c->gcm, NULL, &len, ad, (int)adlen) != 1) return -2;
    if (mlen > 0 && EVP_EncryptUpdate(c->gcm, out, &len, m, (int)mlen) != 1) return -2;
    if (EVP_EncryptFinal_ex(c->gcm, out + len, &fin) != 1) return -2;
    return EVP_CIPHER_CTX_ctrl(c->gcm, EVP_CTRL_GCM_GET_TAG, 16, tag) == 1 ? 0 : -2;
}

static int gcm_open(struct kb_ctx *c, const uint8_t *key, const uint8_t *n12, const uint8_t *ad, size_t adlen,
                    const uint8_t *in, size_t clen, const uint8_t *tag, uint8_t *m) {
    int len = 0, fin = 0;
    if (clen > INT32_MAX || adlen > INT32_MAX) return -2;
    if (EVP_DecryptInit_ex(c->gcm, NULL, NULL, key, n12) != 1) return -2;
    if (EVP_CIPHER_CTX_ctrl(c->gcm, EVP_CTRL_GCM_SET_TAG, 16, (void *)tag) != 1) return -2;
    if (adlen > 0 && EVP_DecryptUpdate(c->gcm, NULL, &len, ad, (int)adlen) != 1) return -2;
    if (clen > 0 && EVP_DecryptUpdate(c->gcm, m, &len, in, (int)clen) != 1) return -2;
    if (EVP_DecryptFinal_ex(c->gcm, m + len, &fin) != 1) {
        if (clen > 0) explicit_bzero(m, clen);   /* GCM decrypts before it verifies */
        return -1;
    }
    return 0;
}

/* A context for plain AES-256-GCM: `gcm` is keyed anew, so it no longer holds an XAES key. */
static struct kb_ctx *ctx_take_gcm(void) {
    struct kb_ctx *c = ctx_take();
    if (c != NULL) c->gcm_xaes = 0;
    return c;
}

int kbfs_aes256gcm_seal(const uint8_t *key, const uint8_t *n12, const uint8_t *ad, size_t adlen,
                        const uint8_t *m, size_t mlen, uint8_t *out, uint8_t *tag) {
    struct kb_ctx *c = ctx_take_gcm();
    if (c == NULL) return -2;
    int rc = gcm_seal(c, key, n12, ad, adlen, m, mlen, out, tag);
    ctx_give(c);
    return rc;
}

int kbfs_aes256gcm_open(const uint8_t *key, const uint8_t *n12, const uint8_t *ad, size_t adlen,
                        const uint8_t *in, size_t clen, const uint8_t *tag, uint8_t *m) {
    struct kb_ctx *c = ctx_take_gcm();
    if (c == NULL) return -2;
    int rc = gcm_open(c, key, n12, ad, adlen, in, clen, tag, m);
    ctx_give(c);
    return rc;
}

/* ---- XAES-256-GCM ---- */

/* Keys `ecb` with `key` unless it holds it already (a file's blocks come in runs under one
   key: the schedule is kept, in the context's locked memory, zeroed when freed). A new key
   also ends what the context held for the old one: its XAES GCM key and nonce batch. */
static int ecb_set_key(struct kb_ctx *c, const uint8_t *key) {
    if (c->ecb_keyed && CRYPTO_memcmp(c->ecb_key, key, 32) == 0) return 0;
    c->ecb_keyed = 0;
    c->gcm_xaes = 0;
    c->batch_live = 0;
    if (EVP_EncryptInit_ex(c->ecb, NULL, NULL, key, NULL) != 1) return -2;
    memcpy(c->ecb_key, key, 32);
    c->ecb_keyed = 1;
    return 0;
}

/* AES-256 of the `n` (16 or 32) bytes at c->scratch under `key`, into `out`. */
static int ecb2(struct kb_ctx *c, const uint8_t *key, size_t n, uint8_t *out) {
    int len = 0;
    if (ecb_set_key(c, key) != 0) return -2;
    if (EVP_EncryptUpdate(c->ecb, out, &len, c->scratch, (int)n) != 1 || (size_t)len != n) return -2;
    return 0;
}

int kbfs_xaes_subkey(const uint8_t *key, uint8_t *k1) {
    struct kb_ctx *c = ctx_take();
    if (c == NULL) return -2;
    memset(c->scratch, 0, 16);
    uint8_t *l = c->scratch + 16;                 /* L = AES-256_K(0^128) */
    int rc = ecb2(c, key, 16, l);
    if (rc == 0) {
        uint8_t msb = l[0] >> 7;                  /* K1 = L << 1, xor 0x87 on carry */
        for (int i = 0; i < 15; i++) k1[i] = (uint8_t)((l[i] << 1) | (l[i + 1] >> 7));
        k1[15] = (uint8_t)((l[15] << 1) ^ (msb ? 0x87 : 0));
    }
    explicit_bzero(c->scratch, sizeof c->scratch);
    ctx_give(c);
    return rc;
}

/* The derived key of `nonce24`'s first 12 bytes into `kx` (32 bytes):
   AES-256_K(M1 ^ K1) || AES-256_K(M2 ^ K1), Mi = 0x00 || i || 'X' || 0x00 || N[0..<12]. */
static int xaes_derive(struct kb_ctx *c, const uint8_t *key, const uint8_t *k1, const uint8_t *nonce24, uint8_t *kx) {
    uint8_t *m = c->scratch;
    for (int i = 0; i < 2; i++) {
        uint8_t *mi = m + 16 * i;
        mi[0] = 0; mi[1] = (uint8_t)(i + 1); mi[2] = 'X'; mi[3] = 0;
        memcpy(mi + 4, nonce24, 12);
        for (int j = 0; j < 16; j++) mi[j] ^= k1[j];
    }
    int rc = ecb2(c, key, 32, kx);
    explicit_bzero(m, 32);
    return rc;
}

/* Blocks one context seals under one prefix before it draws a new one (docs/FORMAT.md,
   "Content blocks": 2^16 blocks, 256 MiB, keeps the sum of the per-derived-key GCM bounds at
   2^-32 over 2^64 block writes). */
#define XAES_BATCH (1u << 16)
static _Atomic uint32_t xaes_batch = XAES_BATCH;

void kbfs_test_set_xaes_batch(uint32_t blocks) {
    atomic_store(&xaes_batch, blocks && blocks < XAES_BATCH ? blocks : XAES_BATCH);
}

/* The nonce of the next block this context seals under its key (ecb_key) into `nonce24`,
   which holds 24 fresh random bytes on entry: they begin a new batch unless the context has
   one going under this key (then: the batch's prefix, and its first suffix plus the count,
   added to the suffix's last four bytes, big-endian: distinct within the batch by
   construction). */
static void xaes_batch_nonce(struct kb_ctx *c, uint8_t *nonce24) {
    unsigned generation = atomic_load(&fork_generation);
    uint32_t limit = atomic_load_explicit(&xaes_batch, memory_order_relaxed);
    if (c->batch_live && c->batch_generation == generation && c->batch_count < limit) {
        memcpy(nonce24, c->batch_nonce, 24);
        uint32_t low = ((uint32_t)nonce24[20] << 24 | (uint32_t)nonce24[21] << 16 | (uint32_t)nonce24[22] << 8
                        | nonce24[23]) + c->batch_count;
        nonce24[20] = (uint8_t)(low >> 24); nonce24[21] = (uint8_t)(low >> 16);
        nonce24[22] = (uint8_t)(low >> 8); nonce24[23] = (uint8_t)low;
        c->batch_count++;
        return;
    }
    memcpy(c->batch_nonce, nonce24, 24);
    c->batch_count = 1;
    c->batch_live = 1;
    c->batch_generation = generation;
}

/* One XAES-256-GCM seal (`tag` written; `nonce24` in: random bytes, out: the nonce used)
   or open (`tag` checked) of `len` bytes. The derived key stays in the context's GCM state
   while blocks come under the same key and prefix (one write's blocks share a prefix), so
   it is derived and expanded once per run rather than once per block. */
static int xaes(int seal, const uint8_t *key, const uint8_t *k1, uint8_t *nonce24, const uint8_t *ad,
                size_t adlen, const uint8_t *in, size_t len, uint8_t *tag, uint8_t *out) {
    struct kb_ctx *c = ctx_take();
    if (c == NULL) return -2;
    if (ecb_set_key(c, key) != 0) { ctx_give(c); return -2; }
    if (seal) xaes_batch_nonce(c, nonce24);
    const uint8_t *gcm_key = NULL;
    uint8_t *kx = c->scratch + 32;
    int rc = 0;
    int kept = c->gcm_xaes && memcmp(c->gcm_prefix, nonce24, 12) == 0 && CRYPTO_memcmp(c->gcm_k1, k1, 16) == 0;
    if (!kept) {
        c->gcm_xaes = 0;
        rc = xaes_derive(c, key, k1, nonce24, kx);
        gcm_key = kx;
    }
    if (rc == 0) {
        rc = seal ? gcm_seal(c, gcm_key, nonce24 + 12, ad, adlen, in, len, out, tag)
                  : gcm_open(c, gcm_key, nonce24 + 12, ad, adlen, in, len, tag, out);
        if (gcm_key != NULL && rc != -2) {
            memcpy(c->gcm_prefix, nonce24, 12);
            memcpy(c->gcm_k1, k1, 16);
            c->gcm_xaes = 1;
        }
    }
    explicit_bzero(kx, 32);
    ctx_give(c);
    return rc;
}

int kbfs_xaes256gcm_seal(const uint8_t *key, const uint8_t *k1, uint8_t *nonce24, const uint8_t *ad,
                         size_t adlen, const uint8_t *m, size_t mlen, uint8_t *out, uint8_t *tag) {
    return xaes(1, key, k1, nonce24, ad, adlen, m, mlen, tag, out);
}

int kbfs_xaes256gcm_open(const uint8_t *key, const uint8_t *k1, const uint8_t *nonce24, const uint8_t *ad,
                         size_t adlen, const uint8_t *in, size_t clen, const uint8_t *tag, uint8_t *m) {
    return xaes(0, key, k1, (uint8_t *)nonce24, ad, adlen, in, clen, (uint8_t *)tag, m);
}

/* ---- Stack and register scrubbing ---- */

#if defined(__x86_64__)
/* Zeroes ymm0-15 (their xmm halves too): OpenSSL's GCM and GHASH code leaves values of
   the GHASH key table there, which a core dump or ptrace would show. */
__attribute__((target("avx"), noinline)) static void zero_vector_registers_avx(void) {
    __asm__ __volatile__("vzeroall" ::: "memory");
}

/* The same without AVX: xmm0-15. */
__attribute__((noinline)) static void zero_vector_registers_sse(void) {
    __asm__ __volatile__(
        "pxor %%xmm0, %%xmm0\n pxor %%xmm1, %%xmm1\n pxor %%xmm2, %%xmm2\n pxor %%xmm3, %%xmm3\n"
        "pxor %%xmm4, %%xmm4\n pxor %%xmm5, %%xmm5\n pxor %%xmm6, %%xmm6\n pxor %%xmm7, %%xmm7\n"
        "pxor %%xmm8, %%xmm8\n pxor %%xmm9, %%xmm9\n pxor %%xmm10, %%xmm10\n pxor %%xmm11, %%xmm11\n"
        "pxor %%xmm12, %%xmm12\n pxor %%xmm13, %%xmm13\n pxor %%xmm14, %%xmm14\n pxor %%xmm15, %%xmm15\n"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
            "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory");
}
#endif

__attribute__((noinline)) void kbfs_scrub_stack(void) {
    unsigned char area[16384];
    explicit_bzero(area, sizeof area);
    __asm__ __volatile__("" : : "r"(area) : "memory");
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx")) zero_vector_registers_avx(); else zero_vector_registers_sse();
#endif
}
