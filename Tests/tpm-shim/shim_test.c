/* Exercises Sources/CTPM against two swtpm instances started by run.sh:
   shim_test PORT1 PORT2 CLOSED_PORT PID2
   PORT1/PORT2: swtpm data ports (control port = data port + 1), CLOSED_PORT: nothing listens
   there, PID2: swtpm #2's pid (killed near the end to test a TPM that goes away). */
#define _GNU_SOURCE
#include "kbfs_tpm.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <tss2/tss2_mu.h>

static int failures;
static char err[256];
static char tcti1[96], tcti2[96], tcti_closed[96];

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (cond) {                                                       \
            printf("ok    ");                                             \
        } else {                                                          \
            printf("FAIL  ");                                             \
            failures++;                                                   \
        }                                                                 \
        printf(__VA_ARGS__);                                              \
        printf("\n");                                                     \
        fflush(stdout);                                                   \
    } while (0)

/* Names a KBFS_TPM_* code. */
static const char *name(int code) {
    static const char *names[] = {"OK", "BAD_AUTH", "LOCKOUT", "NOT_THIS_TPM", "UNREACHABLE", "ERROR", "NV_MISSING",
                                  "STALE"};
    return code >= 0 && code <= 7 ? names[code] : "?";
}

/* Checks that rc is `want`, printing err when it is not. */
#define EXPECT(rc, want, what)                                                                     \
    do {                                                                                           \
        int rc_ = (rc);                                                                            \
        CHECK(rc_ == (want), "%s -> %s%s%s", what, name(rc_), rc_ == (want) ? "" : "  err: ",       \
              rc_ == (want) ? "" : err);                                                           \
    } while (0)

/* Milliseconds on the monotonic clock. */
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Sorts doubles ascending. */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of n samples (sorts them). */
static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Runs a tpm2-tools command line against the TPM at tcti; returns its exit status. */
static int tool(const char *tcti, const char *cmd) {
    char line[512];
    snprintf(line, sizeof line, "TPM2TOOLS_TCTI='%s' %s >/dev/null 2>&1", tcti, cmd);
    int st = system(line);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Reads one TPM2_PT_* value from `tpm2_getcap properties-variable`; -1 when absent. */
static long getcap_prop(const char *tcti, const char *prop) {
    char line[512];
    snprintf(line, sizeof line, "TPM2TOOLS_TCTI='%s' tpm2_getcap properties-variable 2>/dev/null", tcti);
    FILE *f = popen(line, "r");
    if (f == NULL) return -1;
    long value = -1;
    size_t plen = strlen(prop);
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, prop, plen) == 0 && line[plen] == ':') value = strtol(line + plen + 1, NULL, 0);
    }
    pclose(f);
    return value;
}

/* Whether `tpm2_getcap <what>` lists `needle` (case-insensitive); -1 when the tool failed. */
static int getcap_lists(const char *tcti, const char *what, const char *needle) {
    char line[512];
    snprintf(line, sizeof line, "TPM2TOOLS_TCTI='%s' tpm2_getcap %s 2>/dev/null", tcti, what);
    FILE *f = popen(line, "r");
    if (f == NULL) return -1;
    int found = 0;
    while (fgets(line, sizeof line, f) != NULL)
        if (strcasestr(line, needle) != NULL) found = 1;
    return pclose(f) == 0 ? found : -1;
}

/* Number of lines `tpm2_getcap <what>` prints (handles listed); -1 when the tool failed. */
static int getcap_count(const char *tcti, const char *what) {
    char line[512];
    snprintf(line, sizeof line, "TPM2TOOLS_TCTI='%s' tpm2_getcap %s 2>/dev/null", tcti, what);
    FILE *f = popen(line, "r");
    if (f == NULL) return -1;
    int n = 0;
    while (fgets(line, sizeof line, f) != NULL)
        if (strstr(line, "0x") != NULL) n++;
    return pclose(f) == 0 ? n : -1;
}

/* SHA-256 of the concatenation of n (pointer, length) pairs into out[32]. */
static void sha256(uint8_t out[32], int n, ...) {
    va_list ap;
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (c == NULL || EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) abort();
    va_start(ap, n);
    for (int i = 0; i < n; i++) {
        const void *p = va_arg(ap, const void *);
        size_t len = va_arg(ap, size_t);
        if (EVP_DigestUpdate(c, p, len) != 1) abort();
    }
    va_end(ap);
    unsigned int olen = 0;
    if (EVP_DigestFinal_ex(c, out, &olen) != 1 || olen != 32) abort();
    EVP_MD_CTX_free(c);
}

/* Writes v big-endian into n bytes at p. */
static void put_be(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * (n - 1 - i)));
}

/* The authPolicy kbfs_tpm_seal_epoch should produce, by hand from TPM 2.0 Part 3: PolicyAuthValue
   then PolicyNV(ULE, offset 0, operandB = bound) on the counter `index` as define_counter makes it
   (name computed from the expected TPMS_NV_PUBLIC, WRITTEN set). */
static void expected_epoch_policy(uint32_t index, uint64_t bound, uint8_t out[32]) {
    uint8_t d[32] = {0}, cc[4], args[32], ob[8], off_op[4], nvpub[128], nvname[34];
    put_be(cc, 0x0000016B, 4); /* TPM_CC_PolicyAuthValue */
    sha256(d, 2, d, (size_t)32, cc, (size_t)4);
    TPMS_NV_PUBLIC np;
    memset(&np, 0, sizeof np);
    np.nvIndex = index;
    np.nameAlg = TPM2_ALG_SHA256;
    np.attributes = TPMA_NV_AUTHWRITE | TPMA_NV_AUTHREAD | TPMA_NV_NO_DA | TPMA_NV_WRITTEN |
                    ((TPM2_NT_COUNTER << TPMA_NV_TPM2_NT_SHIFT) & TPMA_NV_TPM2_NT_MASK);
    np.dataSize = 8;
    size_t len = 0;
    if (Tss2_MU_TPMS_NV_PUBLIC_Marshal(&np, nvpub, sizeof nvpub, &len) != TSS2_RC_SUCCESS) abort();
    put_be(nvname, TPM2_ALG_SHA256, 2);
    sha256(nvname + 2, 1, nvpub, len);
    put_be(ob, bound, 8);
    put_be(off_op, 0, 2);                        /* offset */
    put_be(off_op + 2, TPM2_EO_UNSIGNED_LE, 2);  /* operation */
    sha256(args, 2, ob, (size_t)8, off_op, (size_t)4);
    put_be(cc, 0x00000149, 4); /* TPM_CC_PolicyNV */
    sha256(out, 4, d, (size_t)32, cc, (size_t)4, args, (size_t)32, nvname, sizeof nvname);
}

/* Fills buf with random bytes. */
static void random_bytes(uint8_t *buf, size_t n) {
    if (getrandom(buf, n, 0) != (ssize_t)n) abort();
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s PORT1 PORT2 CLOSED_PORT PID2\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    kbfs_tpm_quiet_logs();
    snprintf(tcti1, sizeof tcti1, "swtpm:host=127.0.0.1,port=%s", argv[1]);
    snprintf(tcti2, sizeof tcti2, "swtpm:host=127.0.0.1,port=%s", argv[2]);
    snprintf(tcti_closed, sizeof tcti_closed, "swtpm:host=127.0.0.1,port=%s", argv[3]);
    pid_t pid2 = (pid_t)atoi(argv[4]);
    double t_start = now_ms();

    kbfs_tpm *t1 = NULL, *t2 = NULL;
    kbfs_tpm_da da;
    EXPECT(kbfs_tpm_open(tcti1, &t1, err, sizeof err), KBFS_TPM_OK, "open swtpm #1");
    if (t1 == NULL) return 1;

    /* ---- Fresh swtpm's DA parameters ---- */
    EXPECT(kbfs_tpm_da_info(t1, &da, err, sizeof err), KBFS_TPM_OK, "da_info (fresh)");
    printf("info  fresh swtpm DA: counter=%u maxTries=%u recoveryTime(interval)=%us lockoutRecovery=%us inLockout=%d\n",
           da.counter, da.max_tries, da.interval, da.recovery, da.in_lockout);
    CHECK(da.max_tries == (uint32_t)getcap_prop(tcti1, "TPM2_PT_MAX_AUTH_FAIL") &&
              da.interval == (uint32_t)getcap_prop(tcti1, "TPM2_PT_LOCKOUT_INTERVAL") &&
              da.recovery == (uint32_t)getcap_prop(tcti1, "TPM2_PT_LOCKOUT_RECOVERY"),
          "da_info agrees with tpm2_getcap properties-variable");

    /* ---- Seal / unseal round trip ---- */
    uint8_t secret[32], auth[32], wrong[32], got[64];
    uint8_t pub[KBFS_TPM_PUB_MAX], priv[KBFS_TPM_PRIV_MAX];
    size_t pub_len = sizeof pub, priv_len = sizeof priv, got_len = sizeof got;
    random_bytes(secret, sizeof secret);
    random_bytes(auth, sizeof auth);
    memcpy(wrong, auth, sizeof wrong);
    wrong[31] ^= 1;
    EXPECT(kbfs_tpm_seal(t1, secret, sizeof secret, auth, sizeof auth, pub, &pub_len, priv, &priv_len, err, sizeof err),
           KBFS_TPM_OK, "seal 32-byte secret, 32-byte auth");
    printf("info  blob sizes: public %zu bytes, private %zu bytes\n", pub_len, priv_len);
    EXPECT(kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, auth, sizeof auth, got, &got_len, err, sizeof err),
           KBFS_TPM_OK, "unseal with the right auth");
    CHECK(got_len == sizeof secret && memcmp(got, secret, sizeof secret) == 0, "unsealed secret matches");

    {   /* 64-byte secret, 1-byte auth. */
        uint8_t big[64], a1[1] = {0x5A}, pb[KBFS_TPM_PUB_MAX], pv[KBFS_TPM_PRIV_MAX], o[64];
        size_t pbl = sizeof pb, pvl = sizeof pv, ol = sizeof o;
        random_bytes(big, sizeof big);
        EXPECT(kbfs_tpm_seal(t1, big, sizeof big, a1, 1, pb, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_OK,
               "seal 64-byte secret, 1-byte auth");
        EXPECT(kbfs_tpm_unseal(t1, pb, pbl, pv, pvl, a1, 1, o, &ol, err, sizeof err), KBFS_TPM_OK, "unseal it");
        CHECK(ol == 64 && memcmp(o, big, 64) == 0, "64-byte secret matches");
        ol = 10;
        EXPECT(kbfs_tpm_unseal(t1, pb, pbl, pv, pvl, a1, 1, o, &ol, err, sizeof err), KBFS_TPM_ERROR,
               "unseal into a 10-byte buffer");
        CHECK(ol == 64, "short buffer: *out_len reports the 64 bytes needed");
        uint8_t tiny[8];
        pbl = sizeof tiny;
        pvl = sizeof pv;
        EXPECT(kbfs_tpm_seal(t1, big, sizeof big, a1, 1, tiny, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_ERROR,
               "seal into an 8-byte public buffer");
        uint8_t z[1] = {0};
        pbl = sizeof pb;
        EXPECT(kbfs_tpm_seal(t1, big, 0, a1, 1, pb, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_ERROR, "seal 0-byte secret");
        EXPECT(kbfs_tpm_seal(t1, big, 65, a1, 1, pb, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_ERROR, "seal 65-byte secret");
        EXPECT(kbfs_tpm_seal(t1, big, 64, z, 0, pb, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_ERROR, "seal with 0-byte auth");
        EXPECT(kbfs_tpm_seal(t1, big, 64, big, 33, pb, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_ERROR, "seal with 33-byte auth");
        uint8_t junk[16] = {0};
        ol = sizeof o;
        EXPECT(kbfs_tpm_unseal(t1, junk, sizeof junk, pv, pvl, a1, 1, o, &ol, err, sizeof err), KBFS_TPM_ERROR,
               "unseal a malformed public blob");
    }

    /* ---- Benchmarks (10 each) ---- */
    {
        enum { N = 10 };
        double t_open[N], t_seal[N], t_unseal[N];
        int ok = 1;
        for (int i = 0; i < N; i++) {
            kbfs_tpm *b = NULL;
            double a = now_ms();
            ok &= kbfs_tpm_open(tcti1, &b, err, sizeof err) == KBFS_TPM_OK;
            t_open[i] = now_ms() - a;
            kbfs_tpm_close(b);
        }
        for (int i = 0; i < N; i++) {
            size_t pl = sizeof pub, vl = sizeof priv;
            double a = now_ms();
            ok &= kbfs_tpm_seal(t1, secret, sizeof secret, auth, sizeof auth, pub, &pl, priv, &vl, err, sizeof err) == KBFS_TPM_OK;
            t_seal[i] = now_ms() - a;
            pub_len = pl;
            priv_len = vl;
        }
        for (int i = 0; i < N; i++) {
            size_t gl = sizeof got;
            double a = now_ms();
            ok &= kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, auth, sizeof auth, got, &gl, err, sizeof err) == KBFS_TPM_OK;
            t_unseal[i] = now_ms() - a;
            ok &= gl == sizeof secret && memcmp(got, secret, gl) == 0;
        }
        CHECK(ok, "10x open, 10x seal, 10x unseal all succeed");
        printf("info  median of %d on swtpm: open (TCTI+ESYS+CreatePrimary) %.2f ms, seal %.2f ms, unseal %.2f ms\n",
               N, median(t_open, N), median(t_seal, N), median(t_unseal, N));
    }

    /* ---- Wrong auth counts in the DA counter ---- */
    CHECK(tool(tcti1, "tpm2_dictionarylockout -c") == 0, "tpm2_dictionarylockout -c");
    for (int i = 1; i <= 2; i++) { /* the fresh TPM allows 3 tries: stay below */
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, wrong, sizeof wrong, got, &got_len, err, sizeof err),
               KBFS_TPM_BAD_AUTH, "unseal with a wrong auth");
        if (i == 1) printf("info  wrong-auth message: %s\n", err);
        EXPECT(kbfs_tpm_da_info(t1, &da, err, sizeof err), KBFS_TPM_OK, "da_info");
        long cap = getcap_prop(tcti1, "TPM2_PT_LOCKOUT_COUNTER");
        CHECK(da.counter == (uint32_t)i && cap == i, "lockout counter after %d wrong tries: da_info %u, tpm2_getcap %ld", i,
              da.counter, cap);
    }
    {   /* Auth values are compared without trailing zero bytes: "X\0" and "X" open the same object. */
        uint8_t az[32], pb[KBFS_TPM_PUB_MAX], pv[KBFS_TPM_PRIV_MAX], o[64];
        size_t pbl = sizeof pb, pvl = sizeof pv, ol = sizeof o;
        random_bytes(az, sizeof az);
        az[31] = 0;
        if (az[30] == 0) az[30] = 1;
        EXPECT(kbfs_tpm_seal(t1, secret, sizeof secret, az, 32, pb, &pbl, pv, &pvl, err, sizeof err), KBFS_TPM_OK,
               "seal with an auth ending in 0x00");
        EXPECT(kbfs_tpm_unseal(t1, pb, pbl, pv, pvl, az, 32, o, &ol, err, sizeof err), KBFS_TPM_OK,
               "unseal with that auth");
        ol = sizeof o;
        int rc = kbfs_tpm_unseal(t1, pb, pbl, pv, pvl, az, 31, o, &ol, err, sizeof err);
        printf("info  same auth without its trailing 0x00 -> %s\n", name(rc));
    }

    /* ---- Lockout: 3 tries, 60 s recovery, 120 s lockout recovery ---- */
    CHECK(tool(tcti1, "tpm2_dictionarylockout -c") == 0, "tpm2_dictionarylockout -c");
    CHECK(tool(tcti1, "tpm2_dictionarylockout -s -n 3 -t 60 -l 120") == 0, "tpm2_dictionarylockout -s -n 3 -t 60 -l 120");
    EXPECT(kbfs_tpm_da_info(t1, &da, err, sizeof err), KBFS_TPM_OK, "da_info");
    CHECK(da.counter == 0 && da.max_tries == 3 && da.interval == 60 && da.recovery == 120 && !da.in_lockout,
          "DA now counter=%u maxTries=%u interval=%u recovery=%u inLockout=%d", da.counter, da.max_tries, da.interval,
          da.recovery, da.in_lockout);
    for (int i = 1; i <= 3; i++) {
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, wrong, sizeof wrong, got, &got_len, err, sizeof err),
               KBFS_TPM_BAD_AUTH, "unseal with a wrong auth");
        kbfs_tpm_da_info(t1, &da, err, sizeof err);
        long cap = getcap_prop(tcti1, "TPM2_PT_LOCKOUT_COUNTER");
        CHECK(da.counter == (uint32_t)i && cap == i, "lockout counter %u (tpm2_getcap %ld) after wrong try %d", da.counter, cap, i);
    }
    CHECK(da.in_lockout == 1, "in lockout after 3 wrong tries");
    got_len = sizeof got;
    EXPECT(kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, auth, sizeof auth, got, &got_len, err, sizeof err),
           KBFS_TPM_LOCKOUT, "unseal with the RIGHT auth while locked out");
    printf("info  lockout message: %s\n", err);
    got_len = sizeof got;
    EXPECT(kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, wrong, sizeof wrong, got, &got_len, err, sizeof err),
           KBFS_TPM_LOCKOUT, "unseal with a wrong auth while locked out");
    kbfs_tpm_da_info(t1, &da, err, sizeof err);
    CHECK(da.counter == 3, "tries while locked out do not count (counter %u)", da.counter);
    CHECK(tool(tcti1, "tpm2_dictionarylockout -c") == 0, "tpm2_dictionarylockout -c");
    got_len = sizeof got;
    EXPECT(kbfs_tpm_unseal(t1, pub, pub_len, priv, priv_len, auth, sizeof auth, got, &got_len, err, sizeof err),
           KBFS_TPM_OK, "unseal with the right auth after the lockout is cleared");
    CHECK(got_len == sizeof secret && memcmp(got, secret, sizeof secret) == 0, "secret matches");

    /* ---- Blobs from swtpm #1 on swtpm #2 ---- */
    EXPECT(kbfs_tpm_open(tcti2, &t2, err, sizeof err), KBFS_TPM_OK, "open swtpm #2");
    if (t2 != NULL) {
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal(t2, pub, pub_len, priv, priv_len, auth, sizeof auth, got, &got_len, err, sizeof err),
               KBFS_TPM_NOT_THIS_TPM, "unseal swtpm #1's blobs on swtpm #2");
        printf("info  not-this-TPM message: %s\n", err);
    }

    /* ---- NV counter ---- */
    {
        uint8_t nvauth[32];
        random_bytes(nvauth, sizeof nvauth);
        uint32_t index = 0;
        uint64_t v0 = 0, v1 = 0;
        EXPECT(kbfs_tpm_nv_define_counter(t1, nvauth, sizeof nvauth, &index, err, sizeof err), KBFS_TPM_OK, "nv_define_counter");
        printf("info  NV index 0x%08X\n", index);
        char hex[16];
        snprintf(hex, sizeof hex, "0x%x", index);
        CHECK(getcap_lists(tcti1, "handles-nv-index", hex) == 1, "tpm2_getcap handles-nv-index lists %s", hex);
        EXPECT(kbfs_tpm_nv_read_counter(t1, index, nvauth, sizeof nvauth, &v0, err, sizeof err), KBFS_TPM_OK, "nv_read_counter");
        CHECK(v0 >= 1, "counter readable after define: %llu", (unsigned long long)v0);
        EXPECT(kbfs_tpm_nv_increment(t1, index, nvauth, sizeof nvauth, err, sizeof err), KBFS_TPM_OK, "nv_increment");
        EXPECT(kbfs_tpm_nv_read_counter(t1, index, nvauth, sizeof nvauth, &v1, err, sizeof err), KBFS_TPM_OK, "nv_read_counter");
        CHECK(v1 == v0 + 1, "counter went %llu -> %llu", (unsigned long long)v0, (unsigned long long)v1);
        uint8_t nvwrong[32];
        memcpy(nvwrong, nvauth, 32);
        nvwrong[0] ^= 0x80;
        EXPECT(kbfs_tpm_nv_read_counter(t1, index, nvwrong, sizeof nvwrong, &v1, err, sizeof err), KBFS_TPM_BAD_AUTH,
               "nv_read_counter with a wrong auth");
        EXPECT(kbfs_tpm_nv_increment(t1, index, nvwrong, sizeof nvwrong, err, sizeof err), KBFS_TPM_BAD_AUTH,
               "nv_increment with a wrong auth");
        kbfs_tpm_da_info(t1, &da, err, sizeof err);
        CHECK(da.counter == 0, "NO_DA index: wrong NV auths leave the lockout counter at %u", da.counter);
        EXPECT(kbfs_tpm_nv_read_counter(t1, index, nvauth, sizeof nvauth, &v1, err, sizeof err), KBFS_TPM_OK, "nv_read_counter");
        CHECK(v1 == v0 + 1, "wrong-auth increment did not count (%llu)", (unsigned long long)v1);
        EXPECT(kbfs_tpm_nv_undefine(t1, index, err, sizeof err), KBFS_TPM_OK, "nv_undefine");
        EXPECT(kbfs_tpm_nv_read_counter(t1, index, nvauth, sizeof nvauth, &v1, err, sizeof err), KBFS_TPM_NV_MISSING,
               "nv_read_counter after undefine");
        EXPECT(kbfs_tpm_nv_increment(t1, index, nvauth, sizeof nvauth, err, sizeof err), KBFS_TPM_NV_MISSING,
               "nv_increment after undefine");
        EXPECT(kbfs_tpm_nv_undefine(t1, index, err, sizeof err), KBFS_TPM_NV_MISSING, "nv_undefine after undefine");
        CHECK(getcap_lists(tcti1, "handles-nv-index", hex) == 0, "tpm2_getcap handles-nv-index no longer lists %s", hex);
        /* A second counter on the same TPM never starts below the first one's last value. */
        uint32_t index2 = 0;
        uint64_t w = 0;
        EXPECT(kbfs_tpm_nv_define_counter(t1, nvauth, sizeof nvauth, &index2, err, sizeof err), KBFS_TPM_OK, "nv_define_counter again");
        EXPECT(kbfs_tpm_nv_read_counter(t1, index2, nvauth, sizeof nvauth, &w, err, sizeof err), KBFS_TPM_OK, "nv_read_counter");
        CHECK(w > v1, "new counter starts above the old one's %llu: %llu", (unsigned long long)v1, (unsigned long long)w);
        EXPECT(kbfs_tpm_nv_undefine(t1, index2, err, sizeof err), KBFS_TPM_OK, "nv_undefine");
    }

    /* ---- Epoch-bound sealed objects ---- */
    {
        uint8_t nvauth[32], nvwrong[32], ep[KBFS_TPM_PUB_MAX], ev[KBFS_TPM_PRIV_MAX], ep2[KBFS_TPM_PUB_MAX],
            ev2[KBFS_TPM_PRIV_MAX];
        size_t epl = sizeof ep, evl = sizeof ev, ep2l = sizeof ep2, ev2l = sizeof ev2;
        random_bytes(nvauth, sizeof nvauth);
        memcpy(nvwrong, nvauth, sizeof nvwrong);
        nvwrong[5] ^= 0x10;
        uint32_t ix = 0;
        uint64_t v = 0, w = 0;
        EXPECT(kbfs_tpm_nv_define_counter(t1, nvauth, sizeof nvauth, &ix, err, sizeof err), KBFS_TPM_OK,
               "nv_define_counter (epoch)");
        EXPECT(kbfs_tpm_nv_read_counter(t1, ix, nvauth, sizeof nvauth, &v, err, sizeof err), KBFS_TPM_OK,
               "nv_read_counter (epoch)");
        EXPECT(kbfs_tpm_seal_epoch(t1, secret, sizeof secret, auth, sizeof auth, ix, nvauth, sizeof nvauth, v, 0, ep, &epl,
                                   ev, &evl, err, sizeof err),
               KBFS_TPM_OK, "seal_epoch with bound = counter");
        {   /* The object: userWithAuth and noDA clear, authPolicy = the by-hand digest. */
            TPM2B_PUBLIC pb;
            memset(&pb, 0, sizeof pb);
            size_t off = 0;
            int parsed = Tss2_MU_TPM2B_PUBLIC_Unmarshal(ep, epl, &off, &pb) == TSS2_RC_SUCCESS && off == epl;
            TPMA_OBJECT a = pb.publicArea.objectAttributes;
            CHECK(parsed && !(a & TPMA_OBJECT_USERWITHAUTH) && !(a & TPMA_OBJECT_NODA) && (a & TPMA_OBJECT_FIXEDTPM),
                  "epoch object: userWithAuth clear, noDA clear, fixedTPM (attributes 0x%08X)", (unsigned)a);
            uint8_t want[32];
            expected_epoch_policy(ix, v, want);
            CHECK(pb.publicArea.authPolicy.size == 32 && memcmp(pb.publicArea.authPolicy.buffer, want, 32) == 0,
                  "authPolicy equals PolicyAuthValue+PolicyNV(ULE, bound %llu) computed by hand",
                  (unsigned long long)v);
        }
        got_len = sizeof got;
        memset(got, 0, sizeof got);
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep, epl, ev, evl, auth, sizeof auth, ix, nvauth, sizeof nvauth, v, 0, got, &got_len,
                                     err, sizeof err),
               KBFS_TPM_OK, "unseal_epoch with the right auth (real policy session reproduces the digest)");
        CHECK(got_len == sizeof secret && memcmp(got, secret, sizeof secret) == 0, "epoch secret matches");
        got_len = sizeof got;
        memset(got, 0, sizeof got);
        int rc = kbfs_tpm_unseal(t1, ep, epl, ev, evl, auth, sizeof auth, got, &got_len, err, sizeof err);
        CHECK(rc != KBFS_TPM_OK && memcmp(got, secret, sizeof secret) != 0,
              "plain unseal (HMAC session, userWithAuth clear) of the epoch object refused -> %s: %s", name(rc), err);

        CHECK(tool(tcti1, "tpm2_dictionarylockout -c") == 0, "tpm2_dictionarylockout -c");
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep, epl, ev, evl, wrong, sizeof wrong, ix, nvauth, sizeof nvauth, v, 0, got,
                                     &got_len, err, sizeof err),
               KBFS_TPM_BAD_AUTH, "unseal_epoch with a wrong auth");
        kbfs_tpm_da_info(t1, &da, err, sizeof err);
        long cap = getcap_prop(tcti1, "TPM2_PT_LOCKOUT_COUNTER");
        CHECK(da.counter == 1 && cap == 1, "lockout counter after one wrong epoch try: da_info %u, tpm2_getcap %ld",
              da.counter, cap);

        EXPECT(kbfs_tpm_seal_epoch(t1, secret, sizeof secret, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0, ep2,
                                   &ep2l, ev2, &ev2l, err, sizeof err),
               KBFS_TPM_OK, "seal_epoch with bound = counter + 1");
        EXPECT(kbfs_tpm_nv_increment(t1, ix, nvauth, sizeof nvauth, err, sizeof err), KBFS_TPM_OK, "nv_increment (epoch)");
        EXPECT(kbfs_tpm_nv_read_counter(t1, ix, nvauth, sizeof nvauth, &w, err, sizeof err), KBFS_TPM_OK,
               "nv_read_counter (epoch)");
        CHECK(w == v + 1, "epoch counter %llu -> %llu", (unsigned long long)v, (unsigned long long)w);
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep, epl, ev, evl, auth, sizeof auth, ix, nvauth, sizeof nvauth, v, 0, got, &got_len,
                                     err, sizeof err),
               KBFS_TPM_STALE, "unseal_epoch (bound v) with the right auth after the counter passed v");
        printf("info  stale message: %s\n", err);
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep, epl, ev, evl, wrong, sizeof wrong, ix, nvauth, sizeof nvauth, v, 0, got,
                                     &got_len, err, sizeof err),
               KBFS_TPM_STALE, "unseal_epoch (bound v) with a wrong auth after the counter passed v");
        kbfs_tpm_da_info(t1, &da, err, sizeof err);
        CHECK(da.counter == 1, "stale tries do not count in the lockout counter (%u)", da.counter);
        got_len = sizeof got;
        memset(got, 0, sizeof got);
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0, got,
                                     &got_len, err, sizeof err),
               KBFS_TPM_OK, "unseal_epoch (bound v+1) at counter v+1");
        CHECK(got_len == sizeof secret && memcmp(got, secret, sizeof secret) == 0, "epoch secret matches");
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 5, 0, got,
                                     &got_len, err, sizeof err),
               KBFS_TPM_ERROR, "unseal_epoch with a bound other than the sealed one");
        printf("info  other-bound message: %s\n", err);
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvwrong, sizeof nvwrong, v + 1, 0,
                                     got, &got_len, err, sizeof err),
               KBFS_TPM_ERROR, "unseal_epoch with a wrong nv_auth");
        printf("info  wrong-nv_auth message: %s\n", err);
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, pub, pub_len, priv, priv_len, auth, sizeof auth, ix, nvauth, sizeof nvauth,
                                     v + 1, 0, got, &got_len, err, sizeof err),
               KBFS_TPM_ERROR, "unseal_epoch of a plain kbfs_tpm_seal object");
        {
            uint8_t p3[KBFS_TPM_PUB_MAX], v3[KBFS_TPM_PRIV_MAX];
            size_t p3l = sizeof p3, v3l = sizeof v3;
            EXPECT(kbfs_tpm_seal_epoch(t1, secret, sizeof secret, auth, sizeof auth, ix, nvwrong, sizeof nvwrong, v + 1, 0,
                                       p3, &p3l, v3, &v3l, err, sizeof err),
                   KBFS_TPM_ERROR, "seal_epoch with a wrong nv_auth");
            p3l = sizeof p3;
            v3l = sizeof v3;
            EXPECT(kbfs_tpm_seal_epoch(t1, secret, sizeof secret, auth, sizeof auth, KBFS_TPM_NV_LAST, nvauth,
                                       sizeof nvauth, v + 1, 0, p3, &p3l, v3, &v3l, err, sizeof err),
                   KBFS_TPM_NV_MISSING, "seal_epoch on an undefined index");
        }
        if (t2 != NULL) {
            got_len = sizeof got;
            EXPECT(kbfs_tpm_unseal_epoch(t2, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0,
                                         got, &got_len, err, sizeof err),
                   KBFS_TPM_NOT_THIS_TPM, "unseal_epoch swtpm #1's blobs on swtpm #2");
        }

        /* Lockout (3 tries since the lockout test): two more wrong tries, then the right one. */
        for (int i = 2; i <= 3; i++) {
            got_len = sizeof got;
            EXPECT(kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, wrong, sizeof wrong, ix, nvauth, sizeof nvauth, v + 1, 0,
                                         got, &got_len, err, sizeof err),
                   KBFS_TPM_BAD_AUTH, "unseal_epoch with a wrong auth");
        }
        kbfs_tpm_da_info(t1, &da, err, sizeof err);
        CHECK(da.counter == 3 && da.in_lockout, "after 3 wrong epoch tries: counter %u, inLockout %d", da.counter,
              da.in_lockout);
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0, got,
                                     &got_len, err, sizeof err),
               KBFS_TPM_LOCKOUT, "unseal_epoch with the RIGHT auth while locked out");
        CHECK(tool(tcti1, "tpm2_dictionarylockout -c") == 0, "tpm2_dictionarylockout -c");

        /* Benchmarks (10 each). */
        enum { N = 10 };
        double t_seal[N], t_unseal[N];
        int ok = 1;
        for (int i = 0; i < N; i++) {
            size_t pl = sizeof ep2, vl = sizeof ev2;
            double a = now_ms();
            ok &= kbfs_tpm_seal_epoch(t1, secret, sizeof secret, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0, ep2,
                                      &pl, ev2, &vl, err, sizeof err) == KBFS_TPM_OK;
            t_seal[i] = now_ms() - a;
            ep2l = pl;
            ev2l = vl;
        }
        for (int i = 0; i < N; i++) {
            size_t gl = sizeof got;
            double a = now_ms();
            ok &= kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0, got,
                                        &gl, err, sizeof err) == KBFS_TPM_OK;
            t_unseal[i] = now_ms() - a;
            ok &= gl == sizeof secret && memcmp(got, secret, gl) == 0;
        }
        CHECK(ok, "10x seal_epoch, 10x unseal_epoch all succeed");
        printf("info  median of %d on swtpm: seal_epoch %.2f ms, unseal_epoch %.2f ms (epoch blobs: public %zu, "
               "private %zu bytes)\n", N, median(t_seal, N), median(t_unseal, N), ep2l, ev2l);

        EXPECT(kbfs_tpm_nv_undefine(t1, ix, err, sizeof err), KBFS_TPM_OK, "nv_undefine (epoch)");
        got_len = sizeof got;
        EXPECT(kbfs_tpm_unseal_epoch(t1, ep2, ep2l, ev2, ev2l, auth, sizeof auth, ix, nvauth, sizeof nvauth, v + 1, 0, got,
                                     &got_len, err, sizeof err),
               KBFS_TPM_NV_MISSING, "unseal_epoch after the counter was undefined");
    }

    /* ---- Only our kind of counter is read or incremented ---- */
    {
        uint8_t nvauth[32];
        random_bytes(nvauth, sizeof nvauth);
        char hexauth[65], cmd[512], file[64];
        for (int i = 0; i < 32; i++) snprintf(hexauth + 2 * i, 3, "%02x", nvauth[i]);
        uint16_t r;
        random_bytes((uint8_t *)&r, sizeof r);
        uint32_t ix = KBFS_TPM_NV_FIRST + r;
        snprintf(cmd, sizeof cmd, "tpm2_nvdefine 0x%08x -C o -s 8 -a 'authread|authwrite|no_da' -p hex:%s", ix, hexauth);
        CHECK(tool(tcti1, cmd) == 0, "tpm2_nvdefine an ordinary 8-byte index 0x%08X with the counter's attributes", ix);
        snprintf(file, sizeof file, "/tmp/shim_test_nv.%d", (int)getpid());
        FILE *f = fopen(file, "wb");
        if (f != NULL) {
            fwrite("\0\0\0\0\0\0\0\x01", 1, 8, f);
            fclose(f);
        }
        snprintf(cmd, sizeof cmd, "tpm2_nvwrite 0x%08x -C 0x%08x -P hex:%s -i %s", ix, ix, hexauth, file);
        CHECK(tool(tcti1, cmd) == 0, "tpm2_nvwrite 8 bytes into it");
        unlink(file);
        uint64_t value = 0;
        EXPECT(kbfs_tpm_nv_read_counter(t1, ix, nvauth, sizeof nvauth, &value, err, sizeof err), KBFS_TPM_ERROR,
               "nv_read_counter on an ordinary index");
        printf("info  not-a-counter message: %s\n", err);
        EXPECT(kbfs_tpm_nv_increment(t1, ix, nvauth, sizeof nvauth, err, sizeof err), KBFS_TPM_ERROR,
               "nv_increment on an ordinary index");
        EXPECT(kbfs_tpm_nv_undefine(t1, ix, err, sizeof err), KBFS_TPM_OK, "nv_undefine the ordinary index");
    }

    /* ---- The primary's name pins the TPM ---- */
    {
        uint8_t n1[KBFS_TPM_NAME_MAX], n1b[KBFS_TPM_NAME_MAX], n2[KBFS_TPM_NAME_MAX];
        size_t n1l = sizeof n1, n1bl = sizeof n1b, n2l = sizeof n2;
        kbfs_tpm *again = NULL;
        EXPECT(kbfs_tpm_primary_name(t1, n1, &n1l, err, sizeof err), KBFS_TPM_OK, "primary_name (swtpm #1)");
        EXPECT(kbfs_tpm_open(tcti1, &again, err, sizeof err), KBFS_TPM_OK, "open swtpm #1 again");
        if (again != NULL)
            EXPECT(kbfs_tpm_primary_name(again, n1b, &n1bl, err, sizeof err), KBFS_TPM_OK, "primary_name (swtpm #1 again)");
        kbfs_tpm_close(again);
        CHECK(n1l == 34 && n1l == n1bl && memcmp(n1, n1b, n1l) == 0, "same name across two opens (%zu bytes)", n1l);
        if (t2 != NULL) {
            EXPECT(kbfs_tpm_primary_name(t2, n2, &n2l, err, sizeof err), KBFS_TPM_OK, "primary_name (swtpm #2)");
            CHECK(n2l == n1l && memcmp(n1, n2, n1l) != 0, "swtpm #2's name differs");
        }
        uint8_t small[8];
        size_t sl = sizeof small;
        EXPECT(kbfs_tpm_primary_name(t1, small, &sl, err, sizeof err), KBFS_TPM_ERROR, "primary_name into 8 bytes");
        CHECK(sl == 34, "short buffer: *out_len reports %zu", sl);
    }

    /* ---- lockoutAuthSet ---- */
    EXPECT(kbfs_tpm_da_info(t1, &da, err, sizeof err), KBFS_TPM_OK, "da_info");
    CHECK(da.lockout_auth_set == 0, "lockout_auth_set %d on a fresh swtpm", da.lockout_auth_set);
    CHECK(tool(tcti1, "tpm2_changeauth -c lockout somepassword") == 0, "tpm2_changeauth -c lockout somepassword");
    EXPECT(kbfs_tpm_da_info(t1, &da, err, sizeof err), KBFS_TPM_OK, "da_info");
    CHECK(da.lockout_auth_set == 1, "lockout_auth_set %d after changing lockoutAuth", da.lockout_auth_set);
    CHECK(tool(tcti1, "tpm2_changeauth -c lockout -p somepassword") == 0, "tpm2_changeauth back to the empty lockoutAuth");
    EXPECT(kbfs_tpm_da_info(t1, &da, err, sizeof err), KBFS_TPM_OK, "da_info");
    printf("info  lockout_auth_set after changing lockoutAuth back to empty: %d\n", da.lockout_auth_set);
    CHECK(tool(tcti1, "tpm2_dictionarylockout -c") == 0, "tpm2_dictionarylockout -c works with the empty lockoutAuth again");

    /* ---- TCTI allow-list ---- */
    {
        static const char *refused[] = {"/tmp/evil.so", "../x:y", "libtss2-tcti-device.so", "", "devicex:/dev/tpm0",
                                        "swtpm/x:port=1", "libtss2-tcti-swtpm.so.0:port=2321"};
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
            kbfs_tpm *x = NULL;
            char what[96];
            snprintf(what, sizeof what, "open TCTI \"%s\"", refused[i]);
            EXPECT(kbfs_tpm_open(refused[i], &x, err, sizeof err), KBFS_TPM_ERROR, what);
            CHECK(x == NULL, "no context");
        }
        printf("info  refused-TCTI message: %s\n", err);
        kbfs_tpm *x = NULL;
        EXPECT(kbfs_tpm_open("device:/dev/nonexistent", &x, err, sizeof err), KBFS_TPM_UNREACHABLE,
               "open \"device:/dev/nonexistent\" (allowed module)");
    }

    /* ---- Unreachable TPMs ---- */
    {
        kbfs_tpm *x = NULL;
        EXPECT(kbfs_tpm_open(tcti_closed, &x, err, sizeof err), KBFS_TPM_UNREACHABLE, "open a closed port");
        printf("info  closed-port message: %s\n", err);
        CHECK(x == NULL, "no context on failure");
        EXPECT(kbfs_tpm_open("device:/nonexistent/tpmrm0", &x, err, sizeof err), KBFS_TPM_UNREACHABLE, "open a missing device");
        printf("info  missing-device message: %s\n", err);
        if (t2 != NULL && pid2 > 0) {
            kill(pid2, SIGTERM);
            for (int i = 0; i < 100 && kill(pid2, 0) == 0; i++) usleep(20000);
            EXPECT(kbfs_tpm_da_info(t2, &da, err, sizeof err), KBFS_TPM_UNREACHABLE, "da_info after swtpm #2 died");
            got_len = sizeof got;
            EXPECT(kbfs_tpm_unseal(t2, pub, pub_len, priv, priv_len, auth, sizeof auth, got, &got_len, err, sizeof err),
                   KBFS_TPM_UNREACHABLE, "unseal after swtpm #2 died");
            uint32_t ix;
            EXPECT(kbfs_tpm_nv_define_counter(t2, auth, sizeof auth, &ix, err, sizeof err), KBFS_TPM_UNREACHABLE,
                   "nv_define_counter after swtpm #2 died");
            printf("info  dead-context message: %s\n", err);
        }
    }
    kbfs_tpm_close(t2);

    /* ---- Nothing left loaded in swtpm #1 ---- */
    kbfs_tpm_close(t1);
    int objs = getcap_count(tcti1, "handles-transient"), sess = getcap_count(tcti1, "handles-loaded-session");
    CHECK(objs == 0 && sess == 0, "after close: %d transient objects, %d loaded sessions left in swtpm #1", objs, sess);

    printf("info  test time %.0f ms\n", now_ms() - t_start);
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
