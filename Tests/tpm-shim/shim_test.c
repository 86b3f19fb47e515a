/* Exercises Sources/CTPM against two swtpm instances started by run.sh:
   shim_test PORT1 PORT2 CLOSED_PORT PID2
   PORT1/PORT2: swtpm data ports (control port = data port + 1), CLOSED_PORT: nothing listens
   there, PID2: swtpm #2's pid (killed near the end to test a TPM that goes away). */
#define _GNU_SOURCE
#include "kbfs_tpm.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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
    static const char *names[] = {"OK", "BAD_AUTH", "LOCKOUT", "NOT_THIS_TPM", "UNREACHABLE", "ERROR", "NV_MISSING"};
    return code >= 0 && code <= 6 ? names[code] : "?";
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
