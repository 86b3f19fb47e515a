/* TPM 2.0 sealing, dictionary-attack state and NV counters through tpm2-tss' ESAPI and
   TCTI loader. See kbfs_tpm.h. */
#define _GNU_SOURCE
#include "kbfs_tpm.h"

#include <tss2/tss2_esys.h>
#include <tss2/tss2_mu.h>
#include <tss2/tss2_rc.h>
#include <tss2/tss2_sys.h>
#include <tss2/tss2_tctildr.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

_Static_assert(KBFS_TPM_PUB_MAX >= sizeof(TPM2B_PUBLIC), "KBFS_TPM_PUB_MAX too small");
_Static_assert(KBFS_TPM_PRIV_MAX >= sizeof(TPM2B_PRIVATE), "KBFS_TPM_PRIV_MAX too small");
_Static_assert(KBFS_TPM_AUTH_MAX <= sizeof(((TPM2B_AUTH *)0)->buffer), "auth buffer");
_Static_assert(KBFS_TPM_SECRET_MAX <= sizeof(((TPM2B_SENSITIVE_DATA *)0)->buffer), "secret buffer");
_Static_assert(KBFS_TPM_NAME_MAX >= sizeof(((TPM2B_NAME *)0)->name), "KBFS_TPM_NAME_MAX too small");

struct kbfs_tpm {
    TSS2_TCTI_CONTEXT *tcti;
    ESYS_CONTEXT *esys;
    ESYS_TR primary;
    int dead; /* a transport failure left ESYS/SAPI mid-command: only close works now */
};

/* AES-128-CFB: every session's parameter cipher (and the primary's symmetric scheme). */
static const TPMT_SYM_DEF session_cipher = {
    .algorithm = TPM2_ALG_AES, .keyBits = {.aes = 128}, .mode = {.aes = TPM2_ALG_CFB}};

/* ---- Errors ---- */

/* Formats a message into err when the caller gave room for one. */
static void say(char *err, size_t errlen, const char *fmt, ...) {
    if (err == NULL || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* A TPM response code without its layer and handle/session/parameter number: the error itself. */
static TSS2_RC tpm_base(TSS2_RC rc) {
    TSS2_RC layer = rc & TSS2_RC_LAYER_MASK;
    if (layer != TSS2_TPM_RC_LAYER && layer != TSS2_RESMGR_TPM_RC_LAYER) return rc;
    rc &= 0xFFFF;
    if (rc & TPM2_RC_FMT1) return rc & (TPM2_RC_FMT1 | 0x3F);
    return rc & 0xFFF;
}

/* Whether rc came from the TPM (directly or relayed by a resource manager). */
static int from_tpm(TSS2_RC rc) {
    TSS2_RC layer = rc & TSS2_RC_LAYER_MASK;
    return layer == TSS2_TPM_RC_LAYER || layer == TSS2_RESMGR_TPM_RC_LAYER;
}

/* The KBFS_TPM_* code for rc: auth failures, lockout, and transport failures get their own. */
static int classify(TSS2_RC rc) {
    if (rc == TSS2_RC_SUCCESS) return KBFS_TPM_OK;
    if (from_tpm(rc)) {
        TSS2_RC b = tpm_base(rc);
        if (b == TPM2_RC_AUTH_FAIL || b == TPM2_RC_BAD_AUTH) return KBFS_TPM_BAD_AUTH;
        if (b == TPM2_RC_LOCKOUT) return KBFS_TPM_LOCKOUT;
        return KBFS_TPM_ERROR;
    }
    TSS2_RC base = rc & ~TSS2_RC_LAYER_MASK;
    if ((rc & TSS2_RC_LAYER_MASK) == TSS2_TCTI_RC_LAYER) {
        /* Caller mistakes reported by the TCTI are not "unreachable". */
        if (base == TSS2_BASE_RC_BAD_REFERENCE || base == TSS2_BASE_RC_BAD_SEQUENCE ||
            base == TSS2_BASE_RC_INSUFFICIENT_BUFFER || base == TSS2_BASE_RC_BAD_CONTEXT ||
            base == TSS2_BASE_RC_ABI_MISMATCH)
            return KBFS_TPM_ERROR;
        return KBFS_TPM_UNREACHABLE;
    }
    if (base == TSS2_BASE_RC_IO_ERROR || base == TSS2_BASE_RC_NO_CONNECTION) return KBFS_TPM_UNREACHABLE;
    return KBFS_TPM_ERROR;
}

/* Records "what: decoded rc (0x…)" in err and returns classify(rc); a transport failure
   marks t dead. */
static int fail(kbfs_tpm *t, char *err, size_t errlen, const char *what, TSS2_RC rc) {
    say(err, errlen, "%s: %s (0x%X)", what, Tss2_RC_Decode(rc), (unsigned)rc);
    int code = classify(rc);
    if (code == KBFS_TPM_UNREACHABLE && t != NULL) t->dead = 1;
    return code;
}

/* Same as fail, but a code that makes no sense for this call (an auth failure on the empty
   owner or primary auth) is reported as KBFS_TPM_ERROR. */
static int fail_plain(kbfs_tpm *t, char *err, size_t errlen, const char *what, TSS2_RC rc) {
    int code = fail(t, err, errlen, what, rc);
    return (code == KBFS_TPM_BAD_AUTH || code == KBFS_TPM_LOCKOUT) ? KBFS_TPM_ERROR : code;
}

/* ---- Retries and hygiene ---- */

/* Whether the TPM asked to be asked again (busy, yielded, self-testing). */
static int transient(TSS2_RC rc) {
    if (!from_tpm(rc)) return 0;
    TSS2_RC b = tpm_base(rc);
    return b == TPM2_RC_RETRY || b == TPM2_RC_YIELDED || b == TPM2_RC_TESTING;
}

/* Sleeps 20 ms << attempt before a retry. */
static void backoff(int attempt) {
    struct timespec ts = {0, 20L * 1000 * 1000 * (1L << attempt)};
    nanosleep(&ts, NULL);
}

/* Runs an ESYS call (which already resubmits a few times without waiting) up to 4 more
   times with a growing pause while the TPM keeps answering RETRY, YIELDED or TESTING. */
#define RETRYING(rc, call)                                          \
    do {                                                            \
        for (int attempt_ = 0;; attempt_++) {                       \
            (rc) = (call);                                          \
            if (!transient(rc) || attempt_ >= 4) break;             \
            backoff(attempt_);                                      \
        }                                                           \
    } while (0)

/* Zeroes 16 KiB of stack below the caller's frame, where ESYS kept plaintext parameters. */
static __attribute__((noinline)) void scrub_stack(void) {
    unsigned char area[16384];
    explicit_bzero(area, sizeof area);
    __asm__ volatile("" : : "r"(area) : "memory");
}

/* Zeroes the parameter area of the last response in the SAPI buffer, where ESYS leaves a
   decrypted response parameter (the unsealed secret) until the next command. */
static void scrub_response(kbfs_tpm *t) {
    TSS2_SYS_CONTEXT *sys = NULL;
    const uint8_t *rp = NULL;
    size_t n = 0;
    if (Esys_GetSysContext(t->esys, &sys) != TSS2_RC_SUCCESS || sys == NULL) return;
    if (Tss2_Sys_GetRpBuffer(sys, &n, &rp) != TSS2_RC_SUCCESS || rp == NULL) return;
    explicit_bzero((void *)rp, n);
}

/* Replaces ESYS' copy of an object's auth with zeros (it keeps a TPM2B_AUTH per ESYS_TR). */
static void forget_auth(kbfs_tpm *t, ESYS_TR tr) {
    TPM2B_AUTH zero;
    memset(&zero, 0, sizeof zero);
    if (tr != ESYS_TR_NONE) Esys_TR_SetAuth(t->esys, tr, &zero);
}

/* Flushes a transient object or session (only forgets it when t is dead); no-op for ESYS_TR_NONE. */
static void flush(kbfs_tpm *t, ESYS_TR *tr) {
    if (*tr == ESYS_TR_NONE) return;
    if (t->dead || Esys_FlushContext(t->esys, *tr) != TSS2_RC_SUCCESS) Esys_TR_Close(t->esys, tr);
    *tr = ESYS_TR_NONE;
}

/* Sets a session's attributes to `attrs` plus continueSession (we flush sessions ourselves). */
static TSS2_RC set_session_attrs(kbfs_tpm *t, ESYS_TR session, TPMA_SESSION attrs) {
    return Esys_TRSess_SetAttributes(t->esys, session, attrs | TPMA_SESSION_CONTINUESESSION, 0xFF);
}

/* Starts a session of `type` (HMAC or POLICY) salted to the primary (AES-128-CFB, SHA-256) with `attrs`. */
static TSS2_RC start_typed_session(kbfs_tpm *t, TPM2_SE type, TPMA_SESSION attrs, ESYS_TR *session) {
    TSS2_RC rc;
    *session = ESYS_TR_NONE;
    RETRYING(rc, Esys_StartAuthSession(t->esys, t->primary, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE,
                                       ESYS_TR_NONE, NULL, type, &session_cipher, TPM2_ALG_SHA256, session));
    if (rc != TSS2_RC_SUCCESS) {
        *session = ESYS_TR_NONE;
        return rc;
    }
    return set_session_attrs(t, *session, attrs);
}

/* Starts an HMAC session salted to the primary (AES-128-CFB, SHA-256) with `attrs`. */
static TSS2_RC start_session(kbfs_tpm *t, TPMA_SESSION attrs, ESYS_TR *session) {
    return start_typed_session(t, TPM2_SE_HMAC, attrs, session);
}

/* UNREACHABLE with a message when an earlier transport failure killed t. */
static int dead(kbfs_tpm *t, char *err, size_t errlen) {
    if (!t->dead) return 0;
    say(err, errlen, "the TPM connection failed earlier; close this context and open a new one");
    return 1;
}

/* Checks a 1..max-byte input. */
static int bad_len(size_t len, size_t max) { return len == 0 || len > max; }

/* Whether a TCTI string names an allowed module: the part before the first ':' (or all of it)
   is exactly device, swtpm, mssim or tabrmd, so tctildr never dlopens a path or another .so. */
static int tcti_allowed(const char *tcti) {
    static const char *const allowed[] = {"device", "swtpm", "mssim", "tabrmd"};
    const char *colon = strchr(tcti, ':');
    size_t n = colon != NULL ? (size_t)(colon - tcti) : strlen(tcti);
    if (memchr(tcti, '/', n) != NULL) return 0;
    for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++)
        if (strlen(allowed[i]) == n && memcmp(allowed[i], tcti, n) == 0) return 1;
    return 0;
}

/* Parses marshalled TPM2B_PUBLIC / TPM2B_PRIVATE blobs that must be consumed exactly. */
static int parse_blobs(const uint8_t *pub, size_t pub_len, const uint8_t *priv, size_t priv_len,
                       TPM2B_PUBLIC *in_public, TPM2B_PRIVATE *in_private, const char *who, char *err, size_t errlen) {
    memset(in_public, 0, sizeof *in_public);
    memset(in_private, 0, sizeof *in_private);
    size_t off = 0;
    TSS2_RC rc = Tss2_MU_TPM2B_PUBLIC_Unmarshal(pub, pub_len, &off, in_public);
    if (rc != TSS2_RC_SUCCESS || off != pub_len) {
        say(err, errlen, "%s: malformed public blob", who);
        return KBFS_TPM_ERROR;
    }
    off = 0;
    rc = Tss2_MU_TPM2B_PRIVATE_Unmarshal(priv, priv_len, &off, in_private);
    if (rc != TSS2_RC_SUCCESS || off != priv_len) {
        say(err, errlen, "%s: malformed private blob", who);
        return KBFS_TPM_ERROR;
    }
    return KBFS_TPM_OK;
}

/* Loads parsed blobs under the primary (no secret crosses: the private part is encrypted to the
   primary's seed); an integrity failure means another TPM's blobs: NOT_THIS_TPM. */
static int load_blobs(kbfs_tpm *t, const TPM2B_PUBLIC *in_public, const TPM2B_PRIVATE *in_private, ESYS_TR *object,
                      char *err, size_t errlen) {
    TSS2_RC rc;
    RETRYING(rc, Esys_Load(t->esys, t->primary, ESYS_TR_PASSWORD, ESYS_TR_NONE, ESYS_TR_NONE, in_private,
                           in_public, object));
    if (rc == TSS2_RC_SUCCESS) return KBFS_TPM_OK;
    *object = ESYS_TR_NONE;
    int code = fail_plain(t, err, errlen, "Load", rc);
    if (from_tpm(rc) && tpm_base(rc) == TPM2_RC_INTEGRITY) {
        say(err, errlen, "Load: the blobs do not belong to this TPM's storage primary (integrity check failed, 0x%X)",
            (unsigned)rc);
        code = KBFS_TPM_NOT_THIS_TPM;
    }
    return code;
}

/* Copies an unsealed secret into out (capacity *out_len); ERROR with the size needed when short. */
static int copy_secret(const TPM2B_SENSITIVE_DATA *data, uint8_t *out, size_t *out_len, const char *who, char *err,
                       size_t errlen) {
    if (data->size > *out_len) {
        say(err, errlen, "%s: output buffer holds %zu bytes, the secret has %u", who, *out_len, (unsigned)data->size);
        *out_len = data->size;
        return KBFS_TPM_ERROR;
    }
    memcpy(out, data->buffer, data->size);
    *out_len = data->size;
    return KBFS_TPM_OK;
}

/* Creates a sealed KEYEDHASH object holding secret with authValue auth, `attrs` and authPolicy
   `policy` (NULL: none) under the primary, through `session` (salted; set to command parameter
   encryption here), and marshals it into pub / priv. Leaves no copy of secret or auth in ESYS. */
static int create_sealed(kbfs_tpm *t, ESYS_TR session, const uint8_t *secret, size_t secret_len, const uint8_t *auth,
                         size_t auth_len, TPMA_OBJECT attrs, const TPM2B_DIGEST *policy, uint8_t *pub,
                         size_t *pub_len, uint8_t *priv, size_t *priv_len, char *err, size_t errlen) {
    int code = KBFS_TPM_OK;
    TSS2_RC rc;
    TPM2B_PRIVATE *out_private = NULL, *dummy_private = NULL;
    TPM2B_PUBLIC *out_public = NULL, *dummy_public = NULL;

    TPM2B_SENSITIVE_CREATE sensitive;
    memset(&sensitive, 0, sizeof sensitive);
    sensitive.sensitive.userAuth.size = (UINT16)auth_len;
    memcpy(sensitive.sensitive.userAuth.buffer, auth, auth_len);
    sensitive.sensitive.data.size = (UINT16)secret_len;
    memcpy(sensitive.sensitive.data.buffer, secret, secret_len);

    TPM2B_PUBLIC template;
    memset(&template, 0, sizeof template);
    template.publicArea.type = TPM2_ALG_KEYEDHASH;
    template.publicArea.nameAlg = TPM2_ALG_SHA256;
    template.publicArea.objectAttributes = attrs;
    if (policy != NULL) template.publicArea.authPolicy = *policy;
    template.publicArea.parameters.keyedHashDetail.scheme.scheme = TPM2_ALG_NULL;
    TPM2B_DATA outside;
    memset(&outside, 0, sizeof outside);
    TPML_PCR_SELECTION no_pcrs;
    memset(&no_pcrs, 0, sizeof no_pcrs);

    rc = set_session_attrs(t, session, TPMA_SESSION_DECRYPT);
    if (rc != TSS2_RC_SUCCESS) {
        explicit_bzero(&sensitive, sizeof sensitive);
        code = fail_plain(t, err, errlen, "Esys_TRSess_SetAttributes", rc);
        goto out;
    }
    RETRYING(rc, Esys_Create(t->esys, t->primary, session, ESYS_TR_NONE, ESYS_TR_NONE, &sensitive, &template,
                             &outside, &no_pcrs, &out_private, &out_public, NULL, NULL, NULL));
    explicit_bzero(&sensitive, sizeof sensitive);
    /* ESYS keeps a copy of the last TPM2_Create's inSensitive (secret and auth) in its context
       until another Create replaces it, whether the command succeeded or not: create a throwaway
       object holding one zero byte (the TPM refuses an empty sealed object) to overwrite it. */
    if (classify(rc) != KBFS_TPM_UNREACHABLE) {
        TSS2_RC rc2;
        sensitive.sensitive.data.size = 1;
        RETRYING(rc2, Esys_Create(t->esys, t->primary, ESYS_TR_PASSWORD, ESYS_TR_NONE, ESYS_TR_NONE, &sensitive,
                                  &template, &outside, &no_pcrs, &dummy_private, &dummy_public, NULL, NULL, NULL));
        if (classify(rc2) == KBFS_TPM_UNREACHABLE) t->dead = 1;
    }
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "Create (seal)", rc);
        goto out;
    }
    size_t off = 0;
    rc = Tss2_MU_TPM2B_PUBLIC_Marshal(out_public, pub, *pub_len, &off);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail(t, err, errlen, "marshalling TPM2B_PUBLIC (buffer too small?)", rc);
        goto out;
    }
    *pub_len = off;
    off = 0;
    rc = Tss2_MU_TPM2B_PRIVATE_Marshal(out_private, priv, *priv_len, &off);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail(t, err, errlen, "marshalling TPM2B_PRIVATE (buffer too small?)", rc);
        goto out;
    }
    *priv_len = off;

out:
    explicit_bzero(&sensitive, sizeof sensitive);
    Esys_Free(out_private);
    Esys_Free(out_public);
    Esys_Free(dummy_private);
    Esys_Free(dummy_public);
    return code;
}

/* ---- Public API ---- */

void kbfs_tpm_quiet_logs(void) { setenv("TSS2_LOG", "all+NONE", 0); }

int kbfs_tpm_open(const char *tcti, kbfs_tpm **out, char *err, size_t errlen) {
    if (out == NULL) {
        say(err, errlen, "kbfs_tpm_open: out is NULL");
        return KBFS_TPM_ERROR;
    }
    *out = NULL;
    if (tcti != NULL && !tcti_allowed(tcti)) {
        say(err, errlen, "kbfs_tpm_open: TCTI module must be one of device, swtpm, mssim, tabrmd (the part before "
                         "the first ':', no '/'); refusing \"%.64s\"", tcti);
        return KBFS_TPM_ERROR;
    }
    kbfs_tpm *t = calloc(1, sizeof *t);
    if (t == NULL) {
        say(err, errlen, "kbfs_tpm_open: out of memory");
        return KBFS_TPM_ERROR;
    }
    t->primary = ESYS_TR_NONE;
    TSS2_RC rc = Tss2_TctiLdr_Initialize(tcti, &t->tcti);
    if (rc != TSS2_RC_SUCCESS) {
        /* The loader reports every failure (no such TCTI, bad config, device or socket not
           there) in the TCTI layer: all of them mean no TPM through this string. */
        fail(NULL, err, errlen, "TCTI initialization", rc);
        t->tcti = NULL;
        kbfs_tpm_close(t);
        return KBFS_TPM_UNREACHABLE;
    }
    rc = Esys_Initialize(&t->esys, t->tcti, NULL);
    if (rc != TSS2_RC_SUCCESS) {
        int code = fail_plain(t, err, errlen, "Esys_Initialize", rc);
        t->esys = NULL;
        kbfs_tpm_close(t);
        return code;
    }

    TPM2B_SENSITIVE_CREATE sensitive;
    memset(&sensitive, 0, sizeof sensitive);
    TPM2B_PUBLIC template;
    memset(&template, 0, sizeof template);
    template.publicArea.type = TPM2_ALG_ECC;
    template.publicArea.nameAlg = TPM2_ALG_SHA256;
    template.publicArea.objectAttributes = TPMA_OBJECT_RESTRICTED | TPMA_OBJECT_DECRYPT | TPMA_OBJECT_FIXEDTPM |
                                           TPMA_OBJECT_FIXEDPARENT | TPMA_OBJECT_SENSITIVEDATAORIGIN |
                                           TPMA_OBJECT_USERWITHAUTH | TPMA_OBJECT_NODA;
    template.publicArea.parameters.eccDetail.symmetric.algorithm = TPM2_ALG_AES;
    template.publicArea.parameters.eccDetail.symmetric.keyBits.aes = 128;
    template.publicArea.parameters.eccDetail.symmetric.mode.aes = TPM2_ALG_CFB;
    template.publicArea.parameters.eccDetail.scheme.scheme = TPM2_ALG_NULL;
    template.publicArea.parameters.eccDetail.curveID = TPM2_ECC_NIST_P256;
    template.publicArea.parameters.eccDetail.kdf.scheme = TPM2_ALG_NULL;
    /* unique stays empty: the key is a function of the owner seed and this template only. */
    TPM2B_DATA outside;
    memset(&outside, 0, sizeof outside);
    TPML_PCR_SELECTION no_pcrs;
    memset(&no_pcrs, 0, sizeof no_pcrs);
    RETRYING(rc, Esys_CreatePrimary(t->esys, ESYS_TR_RH_OWNER, ESYS_TR_PASSWORD, ESYS_TR_NONE, ESYS_TR_NONE,
                                    &sensitive, &template, &outside, &no_pcrs, &t->primary, NULL, NULL, NULL,
                                    NULL));
    if (rc != TSS2_RC_SUCCESS) {
        int code = fail_plain(t, err, errlen, "CreatePrimary (owner hierarchy, empty owner auth)", rc);
        t->primary = ESYS_TR_NONE;
        kbfs_tpm_close(t);
        return code;
    }
    *out = t;
    return KBFS_TPM_OK;
}

void kbfs_tpm_close(kbfs_tpm *t) {
    if (t == NULL) return;
    if (t->esys != NULL) {
        flush(t, &t->primary);
        Esys_Finalize(&t->esys);
    }
    if (t->tcti != NULL) Tss2_TctiLdr_Finalize(&t->tcti);
    free(t);
}

/* Gives the loaded `object` its `auth`, unseals it through `session` and copies the secret
 * to `out` (for `who`'s messages). The auth copy and the TPM's response are zeroed and the
 * object's auth is forgotten, whatever happens. A policy that does not match is said as such
 * when `policy_hint` names the sealing function. */
static int unseal_loaded(kbfs_tpm *t, ESYS_TR object, ESYS_TR session, const uint8_t *auth, size_t auth_len,
                         const char *who, const char *policy_hint, uint8_t *out, size_t *out_len, char *err,
                         size_t errlen) {
    TPM2B_SENSITIVE_DATA *data = NULL;
    TPM2B_AUTH object_auth;
    memset(&object_auth, 0, sizeof object_auth);
    object_auth.size = (UINT16)auth_len;
    memcpy(object_auth.buffer, auth, auth_len);
    TSS2_RC rc = Esys_TR_SetAuth(t->esys, object, &object_auth);
    explicit_bzero(&object_auth, sizeof object_auth);
    int code;
    if (rc != TSS2_RC_SUCCESS) {
        code = fail(t, err, errlen, "Esys_TR_SetAuth", rc);
        goto out;
    }
    RETRYING(rc, Esys_Unseal(t->esys, object, session, ESYS_TR_NONE, ESYS_TR_NONE, &data));
    if (rc != TSS2_RC_SUCCESS) {
        data = NULL;
        code = fail(t, err, errlen, "Unseal", rc);
        if (policy_hint != NULL && from_tpm(rc) && tpm_base(rc) == TPM2_RC_POLICY_FAIL)
            say(err, errlen, "Unseal: the policy does not match this object (not sealed by %s, or with another NV "
                             "index or bound) (0x%X)", policy_hint, (unsigned)rc);
        goto out;
    }
    scrub_response(t);
    code = copy_secret(data, out, out_len, who, err, errlen);
out:
    if (data != NULL) {
        explicit_bzero(data, sizeof *data);
        Esys_Free(data);
    }
    forget_auth(t, object);
    return code;
}

int kbfs_tpm_seal(kbfs_tpm *t, const uint8_t *secret, size_t secret_len, const uint8_t *auth, size_t auth_len,
                  uint8_t *pub, size_t *pub_len, uint8_t *priv, size_t *priv_len, char *err, size_t errlen) {
    if (t == NULL || secret == NULL || auth == NULL || pub == NULL || pub_len == NULL || priv == NULL ||
        priv_len == NULL) {
        say(err, errlen, "kbfs_tpm_seal: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(secret_len, KBFS_TPM_SECRET_MAX) || bad_len(auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_seal: secret must be 1..%d bytes and auth 1..%d bytes", KBFS_TPM_SECRET_MAX,
            KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    int code = KBFS_TPM_OK;
    ESYS_TR session = ESYS_TR_NONE;
    TSS2_RC rc = start_session(t, TPMA_SESSION_DECRYPT, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    /* No noDA: every wrong auth counts toward the TPM's lockout. */
    code = create_sealed(t, session, secret, secret_len, auth, auth_len,
                         TPMA_OBJECT_FIXEDTPM | TPMA_OBJECT_FIXEDPARENT | TPMA_OBJECT_USERWITHAUTH, NULL, pub, pub_len,
                         priv, priv_len, err, errlen);
out:
    flush(t, &session);
    scrub_stack();
    return code;
}

int kbfs_tpm_unseal(kbfs_tpm *t, const uint8_t *pub, size_t pub_len, const uint8_t *priv, size_t priv_len,
                    const uint8_t *auth, size_t auth_len, uint8_t *out, size_t *out_len, char *err, size_t errlen) {
    if (t == NULL || pub == NULL || priv == NULL || auth == NULL || out == NULL || out_len == NULL) {
        say(err, errlen, "kbfs_tpm_unseal: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_unseal: auth must be 1..%d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    ESYS_TR session = ESYS_TR_NONE, object = ESYS_TR_NONE;
    TPM2B_PUBLIC in_public;
    TPM2B_PRIVATE in_private;
    int code = parse_blobs(pub, pub_len, priv, priv_len, &in_public, &in_private, "kbfs_tpm_unseal", err, errlen);
    if (code != KBFS_TPM_OK) return code;
    code = load_blobs(t, &in_public, &in_private, &object, err, errlen);
    if (code != KBFS_TPM_OK) goto out;
    TSS2_RC rc = start_session(t, TPMA_SESSION_ENCRYPT, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    code = unseal_loaded(t, object, session, auth, auth_len, "kbfs_tpm_unseal", NULL, out, out_len, err, errlen);
out:
    flush(t, &object);
    flush(t, &session);
    scrub_stack();
    return code;
}

int kbfs_tpm_da_info(kbfs_tpm *t, kbfs_tpm_da *out, char *err, size_t errlen) {
    if (t == NULL || out == NULL) {
        say(err, errlen, "kbfs_tpm_da_info: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    memset(out, 0, sizeof *out);
    enum { PERMANENT = 1, COUNTER = 2, MAX = 4, INTERVAL = 8, RECOVERY = 16, ALL = 31 };
    int seen = 0;
    UINT32 next = TPM2_PT_PERMANENT;
    while (seen != ALL && next <= TPM2_PT_LOCKOUT_RECOVERY) {
        TPMI_YES_NO more = TPM2_NO;
        TPMS_CAPABILITY_DATA *cap = NULL;
        TSS2_RC rc;
        RETRYING(rc, Esys_GetCapability(t->esys, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE, TPM2_CAP_TPM_PROPERTIES,
                                        next, TPM2_PT_LOCKOUT_RECOVERY - next + 1, &more, &cap));
        if (rc != TSS2_RC_SUCCESS) return fail_plain(t, err, errlen, "GetCapability(TPM_PROPERTIES)", rc);
        UINT32 count = cap->data.tpmProperties.count;
        if (cap->capability != TPM2_CAP_TPM_PROPERTIES || count == 0) {
            Esys_Free(cap);
            break;
        }
        for (UINT32 i = 0; i < count && i < TPM2_MAX_TPM_PROPERTIES; i++) {
            TPMS_TAGGED_PROPERTY *p = &cap->data.tpmProperties.tpmProperty[i];
            switch (p->property) {
            case TPM2_PT_PERMANENT:
                out->in_lockout = (p->value & TPMA_PERMANENT_INLOCKOUT) != 0;
                out->lockout_auth_set = (p->value & TPMA_PERMANENT_LOCKOUTAUTHSET) != 0;
                seen |= PERMANENT;
                break;
            case TPM2_PT_LOCKOUT_COUNTER: out->counter = p->value; seen |= COUNTER; break;
            case TPM2_PT_MAX_AUTH_FAIL: out->max_tries = p->value; seen |= MAX; break;
            case TPM2_PT_LOCKOUT_INTERVAL: out->interval = p->value; seen |= INTERVAL; break;
            case TPM2_PT_LOCKOUT_RECOVERY: out->recovery = p->value; seen |= RECOVERY; break;
            default: break;
            }
            if (p->property >= next) next = p->property + 1;
        }
        Esys_Free(cap);
        if (more != TPM2_YES) break;
    }
    if (seen != ALL) {
        say(err, errlen, "GetCapability(TPM_PROPERTIES): the TPM did not report every DA property");
        return KBFS_TPM_ERROR;
    }
    return KBFS_TPM_OK;
}

/* Checks (NV_ReadPublic) that the index is what kbfs_tpm_nv_define_counter makes: a TPM_NT_COUNTER
   with AUTHREAD, AUTHWRITE and NO_DA holding 8 bytes; anything else (say an ordinary index someone
   defined with the same auth) is ERROR. */
static int nv_check_counter(kbfs_tpm *t, ESYS_TR nv, uint32_t index, char *err, size_t errlen) {
    TPM2B_NV_PUBLIC *info = NULL;
    TSS2_RC rc;
    RETRYING(rc, Esys_NV_ReadPublic(t->esys, nv, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE, &info, NULL));
    if (rc != TSS2_RC_SUCCESS) return fail_plain(t, err, errlen, "NV_ReadPublic", rc);
    TPMA_NV a = info->nvPublic.attributes;
    TPMA_NV need = TPMA_NV_AUTHREAD | TPMA_NV_AUTHWRITE | TPMA_NV_NO_DA;
    unsigned type = (unsigned)((a & TPMA_NV_TPM2_NT_MASK) >> TPMA_NV_TPM2_NT_SHIFT);
    int ok = type == TPM2_NT_COUNTER && (a & need) == need && info->nvPublic.dataSize == 8 &&
             info->nvPublic.nvIndex == index;
    if (!ok)
        say(err, errlen,
            "NV index 0x%08X is not a keybagfs counter (type %u, attributes 0x%08X, %u bytes; want TPM_NT_COUNTER "
            "with AUTHREAD|AUTHWRITE|NO_DA, 8 bytes): refusing it",
            index, type, (unsigned)a, (unsigned)info->nvPublic.dataSize);
    Esys_Free(info);
    return ok ? KBFS_TPM_OK : KBFS_TPM_ERROR;
}

/* Gets an ESYS_TR for a defined NV index (NV_ReadPublic) with `auth` set on it; with `counter`,
   also requires nv_check_counter. */
static int nv_open(kbfs_tpm *t, uint32_t index, const uint8_t *auth, size_t auth_len, int counter, ESYS_TR *nv,
                   char *err, size_t errlen) {
    TSS2_RC rc;
    *nv = ESYS_TR_NONE;
    if (index < KBFS_TPM_NV_FIRST || index > KBFS_TPM_NV_LAST) {
        say(err, errlen, "NV index 0x%08X is outside 0x%08X..0x%08X", index, KBFS_TPM_NV_FIRST, KBFS_TPM_NV_LAST);
        return KBFS_TPM_ERROR;
    }
    RETRYING(rc, Esys_TR_FromTPMPublic(t->esys, index, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE, nv));
    if (rc != TSS2_RC_SUCCESS) {
        *nv = ESYS_TR_NONE;
        int code = fail_plain(t, err, errlen, "NV_ReadPublic", rc);
        if (from_tpm(rc) && tpm_base(rc) == TPM2_RC_HANDLE) {
            say(err, errlen, "NV index 0x%08X is not defined", index);
            code = KBFS_TPM_NV_MISSING;
        }
        return code;
    }
    if (counter) {
        int code = nv_check_counter(t, *nv, index, err, errlen);
        if (code != KBFS_TPM_OK) {
            Esys_TR_Close(t->esys, nv);
            *nv = ESYS_TR_NONE;
            return code;
        }
    }
    if (auth != NULL) {
        TPM2B_AUTH a;
        memset(&a, 0, sizeof a);
        a.size = (UINT16)auth_len;
        memcpy(a.buffer, auth, auth_len);
        rc = Esys_TR_SetAuth(t->esys, *nv, &a);
        explicit_bzero(&a, sizeof a);
        if (rc != TSS2_RC_SUCCESS) {
            Esys_TR_Close(t->esys, nv);
            *nv = ESYS_TR_NONE;
            return fail(t, err, errlen, "Esys_TR_SetAuth", rc);
        }
    }
    return KBFS_TPM_OK;
}

/* Drops an NV ESYS_TR (NV indices are not flushed), zeroing its auth first. */
static void nv_close(kbfs_tpm *t, ESYS_TR *nv) {
    if (*nv == ESYS_TR_NONE) return;
    forget_auth(t, *nv);
    Esys_TR_Close(t->esys, nv);
    *nv = ESYS_TR_NONE;
}

/* NV_Increment through a salted session (the command has no parameter to encrypt). */
static TSS2_RC nv_increment(kbfs_tpm *t, ESYS_TR nv, ESYS_TR session) {
    TSS2_RC rc = set_session_attrs(t, session, 0);
    if (rc != TSS2_RC_SUCCESS) return rc;
    RETRYING(rc, Esys_NV_Increment(t->esys, nv, nv, session, ESYS_TR_NONE, ESYS_TR_NONE));
    return rc;
}

int kbfs_tpm_nv_define_counter(kbfs_tpm *t, const uint8_t *auth, size_t auth_len, uint32_t *index_out, char *err,
                               size_t errlen) {
    if (t == NULL || auth == NULL || index_out == NULL) {
        say(err, errlen, "kbfs_tpm_nv_define_counter: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_nv_define_counter: auth must be 1..%d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    int code = KBFS_TPM_OK;
    TSS2_RC rc = TSS2_RC_SUCCESS;
    ESYS_TR session = ESYS_TR_NONE, nv = ESYS_TR_NONE;
    TPM2B_AUTH nv_auth;
    memset(&nv_auth, 0, sizeof nv_auth);
    nv_auth.size = (UINT16)auth_len;
    memcpy(nv_auth.buffer, auth, auth_len);
    TPM2B_NV_PUBLIC info;
    memset(&info, 0, sizeof info);
    info.nvPublic.nameAlg = TPM2_ALG_SHA256;
    info.nvPublic.attributes = TPMA_NV_AUTHWRITE | TPMA_NV_AUTHREAD | TPMA_NV_NO_DA |
                               ((TPM2_NT_COUNTER << TPMA_NV_TPM2_NT_SHIFT) & TPMA_NV_TPM2_NT_MASK);
    info.nvPublic.dataSize = 8;

    rc = start_session(t, TPMA_SESSION_DECRYPT, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    int defined = 0;
    for (int attempt = 0; attempt < 32 && !defined; attempt++) {
        uint16_t r;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) {
            say(err, errlen, "getrandom failed");
            code = KBFS_TPM_ERROR;
            goto out;
        }
        info.nvPublic.nvIndex = KBFS_TPM_NV_FIRST + r;
        RETRYING(rc, Esys_NV_DefineSpace(t->esys, ESYS_TR_RH_OWNER, session, ESYS_TR_NONE, ESYS_TR_NONE, &nv_auth,
                                         &info, &nv));
        if (rc == TSS2_RC_SUCCESS) defined = 1;
        else if (!(from_tpm(rc) && tpm_base(rc) == TPM2_RC_NV_DEFINED)) break;
    }
    /* ESYS keeps the last NV_DefineSpace's auth in its context, whatever the outcome: overwrite
       it with a define of an empty auth at handle 0, which the TPM refuses before touching NV. */
    if (classify(rc) != KBFS_TPM_UNREACHABLE) {
        TPM2B_AUTH empty;
        memset(&empty, 0, sizeof empty);
        TPM2B_NV_PUBLIC bogus = info;
        bogus.nvPublic.nvIndex = 0;
        ESYS_TR ignored = ESYS_TR_NONE;
        TSS2_RC rc2 = Esys_NV_DefineSpace(t->esys, ESYS_TR_RH_OWNER, ESYS_TR_PASSWORD, ESYS_TR_NONE, ESYS_TR_NONE,
                                          &empty, &bogus, &ignored);
        if (rc2 == TSS2_RC_SUCCESS) nv_close(t, &ignored); /* not expected */
        if (classify(rc2) == KBFS_TPM_UNREACHABLE) t->dead = 1;
    }
    if (!defined) {
        nv = ESYS_TR_NONE;
        code = fail_plain(t, err, errlen, "NV_DefineSpace", rc);
        if (code == KBFS_TPM_OK) code = KBFS_TPM_ERROR;
        goto out;
    }
    rc = nv_increment(t, nv, session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "NV_Increment (first)", rc);
        /* Do not leave an unreadable counter behind. */
        forget_auth(t, nv);
        if (Esys_NV_UndefineSpace(t->esys, ESYS_TR_RH_OWNER, nv, ESYS_TR_PASSWORD, ESYS_TR_NONE, ESYS_TR_NONE) ==
            TSS2_RC_SUCCESS)
            nv = ESYS_TR_NONE;
        goto out;
    }
    *index_out = info.nvPublic.nvIndex;

out:
    explicit_bzero(&nv_auth, sizeof nv_auth);
    nv_close(t, &nv);
    flush(t, &session);
    scrub_stack();
    return code;
}

int kbfs_tpm_nv_increment(kbfs_tpm *t, uint32_t index, const uint8_t *auth, size_t auth_len, char *err,
                          size_t errlen) {
    if (t == NULL || auth == NULL) {
        say(err, errlen, "kbfs_tpm_nv_increment: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_nv_increment: auth must be 1..%d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    ESYS_TR nv = ESYS_TR_NONE, session = ESYS_TR_NONE;
    int code = nv_open(t, index, auth, auth_len, 1, &nv, err, errlen);
    if (code != KBFS_TPM_OK) goto out;
    TSS2_RC rc = start_session(t, 0, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    rc = nv_increment(t, nv, session);
    if (rc != TSS2_RC_SUCCESS) code = fail(t, err, errlen, "NV_Increment", rc);
out:
    nv_close(t, &nv);
    flush(t, &session);
    scrub_stack();
    return code;
}

int kbfs_tpm_nv_read_counter(kbfs_tpm *t, uint32_t index, const uint8_t *auth, size_t auth_len, uint64_t *value,
                             char *err, size_t errlen) {
    if (t == NULL || auth == NULL || value == NULL) {
        say(err, errlen, "kbfs_tpm_nv_read_counter: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_nv_read_counter: auth must be 1..%d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    ESYS_TR nv = ESYS_TR_NONE, session = ESYS_TR_NONE;
    TPM2B_MAX_NV_BUFFER *data = NULL;
    int code = nv_open(t, index, auth, auth_len, 1, &nv, err, errlen);
    if (code != KBFS_TPM_OK) goto out;
    TSS2_RC rc = start_session(t, TPMA_SESSION_ENCRYPT, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    RETRYING(rc, Esys_NV_Read(t->esys, nv, nv, session, ESYS_TR_NONE, ESYS_TR_NONE, 8, 0, &data));
    if (rc != TSS2_RC_SUCCESS) {
        data = NULL;
        code = fail(t, err, errlen, "NV_Read", rc);
        goto out;
    }
    if (data->size != 8) {
        say(err, errlen, "NV_Read: expected 8 bytes, got %u", (unsigned)data->size);
        code = KBFS_TPM_ERROR;
        goto out;
    }
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | data->buffer[i];
    *value = v;
out:
    Esys_Free(data);
    nv_close(t, &nv);
    flush(t, &session);
    return code;
}

int kbfs_tpm_nv_undefine(kbfs_tpm *t, uint32_t index, char *err, size_t errlen) {
    if (t == NULL) {
        say(err, errlen, "kbfs_tpm_nv_undefine: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    ESYS_TR nv = ESYS_TR_NONE;
    int code = nv_open(t, index, NULL, 0, 0, &nv, err, errlen);
    if (code != KBFS_TPM_OK) return code;
    TSS2_RC rc;
    RETRYING(rc, Esys_NV_UndefineSpace(t->esys, ESYS_TR_RH_OWNER, nv, ESYS_TR_PASSWORD, ESYS_TR_NONE,
                                       ESYS_TR_NONE));
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "NV_UndefineSpace", rc);
        nv_close(t, &nv);
        return code;
    }
    return KBFS_TPM_OK; /* ESYS dropped the ESYS_TR with the index */
}

int kbfs_tpm_primary_name(kbfs_tpm *t, uint8_t *out, size_t *out_len, char *err, size_t errlen) {
    if (t == NULL || out == NULL || out_len == NULL) {
        say(err, errlen, "kbfs_tpm_primary_name: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    TPM2B_NAME *name = NULL;
    TSS2_RC rc = Esys_TR_GetName(t->esys, t->primary, &name);
    if (rc != TSS2_RC_SUCCESS) return fail_plain(t, err, errlen, "Esys_TR_GetName (primary)", rc);
    int code = KBFS_TPM_OK;
    if (name->size == 0 || name->size > *out_len) {
        say(err, errlen, "kbfs_tpm_primary_name: buffer holds %zu bytes, the name has %u", *out_len,
            (unsigned)name->size);
        if (name->size != 0) *out_len = name->size;
        code = KBFS_TPM_ERROR;
    } else {
        memcpy(out, name->name, name->size);
        *out_len = name->size;
    }
    Esys_Free(name);
    return code;
}

/* ---- Epoch-bound sealed objects ---- */

/* Runs PolicyAuthValue then PolicyNV(nv's data <= bound, 8 bytes big-endian at offset 0, unsigned)
   on `policy` (a policy or trial session); `nv_session` (salted HMAC) carries nv's auth for PolicyNV. */
static TSS2_RC policy_epoch(kbfs_tpm *t, ESYS_TR policy, ESYS_TR nv, ESYS_TR nv_session, uint64_t bound,
                            uint32_t pcr_mask, const char **step) {
    TSS2_RC rc;
    *step = "PolicyAuthValue";
    RETRYING(rc, Esys_PolicyAuthValue(t->esys, policy, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE));
    if (rc != TSS2_RC_SUCCESS) return rc;
    *step = "PolicyNV";
    /* operandB is not secret: no parameter encryption; the HMAC keeps nv's auth off the wire. */
    rc = set_session_attrs(t, nv_session, 0);
    if (rc != TSS2_RC_SUCCESS) return rc;
    TPM2B_OPERAND operand;
    memset(&operand, 0, sizeof operand);
    operand.size = 8;
    for (int i = 0; i < 8; i++) operand.buffer[i] = (uint8_t)(bound >> (56 - 8 * i));
    RETRYING(rc, Esys_PolicyNV(t->esys, nv, nv, policy, nv_session, ESYS_TR_NONE, ESYS_TR_NONE, &operand, 0,
                               TPM2_EO_UNSIGNED_LE));
    if (rc != TSS2_RC_SUCCESS || pcr_mask == 0) return rc;
    /* The boot state: the SHA-256 bank's PCRs in pcr_mask at their values now (an empty
       pcrDigest makes the TPM use its current values, in a trial session as at unseal). */
    *step = "PolicyPCR";
    TPML_PCR_SELECTION sel;
    memset(&sel, 0, sizeof sel);
    sel.count = 1;
    sel.pcrSelections[0].hash = TPM2_ALG_SHA256;
    sel.pcrSelections[0].sizeofSelect = 3;
    for (int i = 0; i < 24; i++)
        if (pcr_mask & (1u << i)) sel.pcrSelections[0].pcrSelect[i / 8] |= (uint8_t)(1u << (i % 8));
    TPM2B_DIGEST empty;
    memset(&empty, 0, sizeof empty);
    RETRYING(rc, Esys_PolicyPCR(t->esys, policy, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE, &empty, &sel));
    return rc;
}

/* The KBFS_TPM_* code for a failed policy_epoch step: a failed comparison is STALE, a refused
   nv_auth is ERROR (not the passcode's BAD_AUTH), a vanished index NV_MISSING. */
static int policy_epoch_fail(kbfs_tpm *t, const char *step, uint32_t index, TSS2_RC rc, char *err, size_t errlen) {
    int code = fail_plain(t, err, errlen, step, rc);
    if (!from_tpm(rc) || strcmp(step, "PolicyNV") != 0) return code;
    TSS2_RC b = tpm_base(rc);
    if (b == TPM2_RC_POLICY) {
        say(err, errlen, "this sealed object's epoch has passed: the counter at NV index 0x%08X is above its bound "
                         "(PolicyNV: 0x%X)", index, (unsigned)rc);
        return KBFS_TPM_STALE;
    }
    if (b == TPM2_RC_AUTH_FAIL || b == TPM2_RC_BAD_AUTH) {
        say(err, errlen, "PolicyNV: NV index 0x%08X refused nv_auth (0x%X)", index, (unsigned)rc);
        return KBFS_TPM_ERROR;
    }
    if (b == TPM2_RC_HANDLE) {
        say(err, errlen, "NV index 0x%08X is not defined (PolicyNV: 0x%X)", index, (unsigned)rc);
        return KBFS_TPM_NV_MISSING;
    }
    return code;
}

int kbfs_tpm_seal_epoch(kbfs_tpm *t, const uint8_t *secret, size_t secret_len, const uint8_t *auth, size_t auth_len,
                        uint32_t epoch_index, const uint8_t *nv_auth, size_t nv_auth_len, uint64_t bound,
                        uint32_t pcr_mask, uint8_t *pub, size_t *pub_len, uint8_t *priv, size_t *priv_len, char *err,
                        size_t errlen) {
    if (t == NULL || secret == NULL || auth == NULL || nv_auth == NULL || pub == NULL || pub_len == NULL ||
        priv == NULL || priv_len == NULL) {
        say(err, errlen, "kbfs_tpm_seal_epoch: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(secret_len, KBFS_TPM_SECRET_MAX) || bad_len(auth_len, KBFS_TPM_AUTH_MAX) ||
        bad_len(nv_auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_seal_epoch: secret must be 1..%d bytes, auth and nv_auth 1..%d bytes",
            KBFS_TPM_SECRET_MAX, KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    ESYS_TR nv = ESYS_TR_NONE, session = ESYS_TR_NONE, trial = ESYS_TR_NONE;
    TPM2B_DIGEST *digest = NULL;
    const char *step = "";
    TSS2_RC rc;
    int code = nv_open(t, epoch_index, nv_auth, nv_auth_len, 1, &nv, err, errlen);
    if (code != KBFS_TPM_OK) goto out;
    rc = start_session(t, 0, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    /* The trial session only accumulates the digest (it carries nothing secret): unsalted. */
    const TPMT_SYM_DEF no_cipher = {.algorithm = TPM2_ALG_NULL};
    RETRYING(rc, Esys_StartAuthSession(t->esys, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE,
                                       ESYS_TR_NONE, NULL, TPM2_SE_TRIAL, &no_cipher, TPM2_ALG_SHA256, &trial));
    if (rc != TSS2_RC_SUCCESS) {
        trial = ESYS_TR_NONE;
        code = fail_plain(t, err, errlen, "StartAuthSession (trial)", rc);
        goto out;
    }
    if (pcr_mask >> 24) {
        say(err, errlen, "kbfs_tpm_seal_epoch: PCRs are 0..23");
        code = KBFS_TPM_ERROR;
        goto out;
    }
    rc = policy_epoch(t, trial, nv, session, bound, pcr_mask, &step);
    if (rc != TSS2_RC_SUCCESS) {
        code = policy_epoch_fail(t, step, epoch_index, rc, err, errlen);
        goto out;
    }
    RETRYING(rc, Esys_PolicyGetDigest(t->esys, trial, ESYS_TR_NONE, ESYS_TR_NONE, ESYS_TR_NONE, &digest));
    if (rc != TSS2_RC_SUCCESS) {
        digest = NULL;
        code = fail_plain(t, err, errlen, "PolicyGetDigest (trial)", rc);
        goto out;
    }
    flush(t, &trial);
    /* No userWithAuth: only the policy authorizes; no noDA: wrong auths count toward lockout. */
    code = create_sealed(t, session, secret, secret_len, auth, auth_len, TPMA_OBJECT_FIXEDTPM | TPMA_OBJECT_FIXEDPARENT,
                         digest, pub, pub_len, priv, priv_len, err, errlen);
out:
    Esys_Free(digest);
    nv_close(t, &nv);
    flush(t, &trial);
    flush(t, &session);
    scrub_stack();
    return code;
}

int kbfs_tpm_unseal_epoch(kbfs_tpm *t, const uint8_t *pub, size_t pub_len, const uint8_t *priv, size_t priv_len,
                          const uint8_t *auth, size_t auth_len, uint32_t epoch_index, const uint8_t *nv_auth,
                          size_t nv_auth_len, uint64_t bound, uint32_t pcr_mask, uint8_t *out, size_t *out_len,
                          char *err, size_t errlen) {
    if (t == NULL || pub == NULL || priv == NULL || auth == NULL || nv_auth == NULL || out == NULL ||
        out_len == NULL) {
        say(err, errlen, "kbfs_tpm_unseal_epoch: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (bad_len(auth_len, KBFS_TPM_AUTH_MAX) || bad_len(nv_auth_len, KBFS_TPM_AUTH_MAX)) {
        say(err, errlen, "kbfs_tpm_unseal_epoch: auth and nv_auth must be 1..%d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    TSS2_RC rc;
    ESYS_TR object = ESYS_TR_NONE, nv = ESYS_TR_NONE, policy = ESYS_TR_NONE, nv_session = ESYS_TR_NONE;
    const char *step = "";

    TPM2B_PUBLIC in_public;
    TPM2B_PRIVATE in_private;
    int code = parse_blobs(pub, pub_len, priv, priv_len, &in_public, &in_private, "kbfs_tpm_unseal_epoch", err, errlen);
    if (code != KBFS_TPM_OK) return code;
    code = load_blobs(t, &in_public, &in_private, &object, err, errlen);
    if (code != KBFS_TPM_OK) goto out;
    code = nv_open(t, epoch_index, nv_auth, nv_auth_len, 1, &nv, err, errlen);
    if (code != KBFS_TPM_OK) goto out;
    rc = start_typed_session(t, TPM2_SE_POLICY, TPMA_SESSION_ENCRYPT, &policy);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted policy)", rc);
        goto out;
    }
    rc = start_session(t, 0, &nv_session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    rc = policy_epoch(t, policy, nv, nv_session, bound, pcr_mask, &step);
    if (rc != TSS2_RC_SUCCESS) {
        code = policy_epoch_fail(t, step, epoch_index, rc, err, errlen);
        goto out;
    }
    flush(t, &nv_session);
    code = unseal_loaded(t, object, policy, auth, auth_len, "kbfs_tpm_unseal_epoch", "kbfs_tpm_seal_epoch", out,
                         out_len, err, errlen);
    /* The object was sealed with these PCRs (its bound and index were checked at PolicyNV):
       a policy that no longer matches means their values changed. No DA failure is counted. */
    if (code == KBFS_TPM_ERROR && pcr_mask != 0 && strstr(err ? err : "", "policy does not match") != NULL) {
        say(err, errlen, "the PCRs this secret is bound to changed since it was sealed");
        code = KBFS_TPM_PCR_CHANGED;
    }
out:
    flush(t, &object);
    nv_close(t, &nv);
    flush(t, &nv_session);
    flush(t, &policy);
    scrub_stack();
    return code;
}

/* ---- The lockout hierarchy ---- */

/* Gives ESYS the lockout hierarchy's authValue (NULL or 0 bytes: empty). */
static TSS2_RC set_lockout_auth(kbfs_tpm *t, const uint8_t *auth, size_t auth_len) {
    TPM2B_AUTH a;
    memset(&a, 0, sizeof a);
    if (auth != NULL && auth_len > 0) {
        a.size = (UINT16)auth_len;
        memcpy(a.buffer, auth, auth_len);
    }
    TSS2_RC rc = Esys_TR_SetAuth(t->esys, ESYS_TR_RH_LOCKOUT, &a);
    explicit_bzero(&a, sizeof a);
    return rc;
}

/* The KBFS_TPM_* code for a refused lockout authorization: BAD_AUTH for a wrong one, LOCKOUT
   while the TPM refuses the lockout authorization after an earlier wrong one. */
static int lockout_fail(kbfs_tpm *t, const char *what, TSS2_RC rc, char *err, size_t errlen) {
    int code = fail(t, err, errlen, what, rc);
    if (code == KBFS_TPM_BAD_AUTH)
        say(err, errlen, "%s: the TPM refused the lockout authorization (0x%X)", what, (unsigned)rc);
    if (code == KBFS_TPM_LOCKOUT)
        say(err, errlen, "%s: the TPM refuses its lockout authorization for a while after a wrong one (0x%X)", what,
            (unsigned)rc);
    return code;
}

int kbfs_tpm_lockout_change_auth(kbfs_tpm *t, const uint8_t *old_auth, size_t old_len, const uint8_t *new_auth,
                                 size_t new_len, char *err, size_t errlen) {
    if (t == NULL || (old_auth == NULL && old_len > 0) || (new_auth == NULL && new_len > 0)) {
        say(err, errlen, "kbfs_tpm_lockout_change_auth: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (old_len > KBFS_TPM_AUTH_MAX || new_len > KBFS_TPM_AUTH_MAX) {
        say(err, errlen, "kbfs_tpm_lockout_change_auth: an auth has at most %d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    ESYS_TR session = ESYS_TR_NONE;
    int code = KBFS_TPM_OK;
    TSS2_RC rc = start_session(t, TPMA_SESSION_DECRYPT, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    rc = set_lockout_auth(t, old_auth, old_len);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail(t, err, errlen, "Esys_TR_SetAuth", rc);
        goto out;
    }
    TPM2B_AUTH next;
    memset(&next, 0, sizeof next);
    next.size = (UINT16)new_len;
    if (new_len > 0) memcpy(next.buffer, new_auth, new_len);
    RETRYING(rc, Esys_HierarchyChangeAuth(t->esys, ESYS_TR_RH_LOCKOUT, session, ESYS_TR_NONE, ESYS_TR_NONE, &next));
    explicit_bzero(&next, sizeof next);
    if (rc != TSS2_RC_SUCCESS) code = lockout_fail(t, "HierarchyChangeAuth(lockout)", rc, err, errlen);
out:
    set_lockout_auth(t, NULL, 0);
    flush(t, &session);
    scrub_stack();
    return code;
}

int kbfs_tpm_lockout_reset(kbfs_tpm *t, const uint8_t *auth, size_t auth_len, char *err, size_t errlen) {
    if (t == NULL || (auth == NULL && auth_len > 0)) {
        say(err, errlen, "kbfs_tpm_lockout_reset: NULL argument");
        return KBFS_TPM_ERROR;
    }
    if (dead(t, err, errlen)) return KBFS_TPM_UNREACHABLE;
    if (auth_len > KBFS_TPM_AUTH_MAX) {
        say(err, errlen, "kbfs_tpm_lockout_reset: auth has at most %d bytes", KBFS_TPM_AUTH_MAX);
        return KBFS_TPM_ERROR;
    }
    ESYS_TR session = ESYS_TR_NONE;
    int code = KBFS_TPM_OK;
    /* The command has no parameter: the salted HMAC session keeps the authValue off the wire. */
    TSS2_RC rc = start_session(t, 0, &session);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail_plain(t, err, errlen, "StartAuthSession (salted)", rc);
        goto out;
    }
    rc = set_lockout_auth(t, auth, auth_len);
    if (rc != TSS2_RC_SUCCESS) {
        code = fail(t, err, errlen, "Esys_TR_SetAuth", rc);
        goto out;
    }
    RETRYING(rc, Esys_DictionaryAttackLockReset(t->esys, ESYS_TR_RH_LOCKOUT, session, ESYS_TR_NONE, ESYS_TR_NONE));
    if (rc != TSS2_RC_SUCCESS) code = lockout_fail(t, "DictionaryAttackLockReset", rc, err, errlen);
out:
    set_lockout_auth(t, NULL, 0);
    flush(t, &session);
    scrub_stack();
    return code;
}
