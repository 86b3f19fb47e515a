#ifndef KEYBAGFS_CTPM_H
#define KEYBAGFS_CTPM_H
/* A 256-bit secret sealed in a TPM 2.0 behind a passcode-derived authValue, the TPM's
   dictionary-attack lockout doing the throttling, and a monotonic NV counter for rollback
   detection. Built on tpm2-tss (ESAPI + TCTI loader); no TSS type crosses this header.
   Every command that carries a secret runs in a salted HMAC or policy session (salt encrypted
   to the storage primary) with AES-128-CFB parameter encryption. One kbfs_tpm is not thread-safe:
   serialize calls on it. Every function returns a KBFS_TPM_* code and, on failure, puts a
   one-line message without secrets into err (when err is not NULL and errlen > 0).
   After a call on an open context returns KBFS_TPM_UNREACHABLE the context is dead (tpm2-tss
   cannot resume after a transport failure mid-command): every later call returns UNREACHABLE
   again; close it and open a new one. */

#include <stddef.h>
#include <stdint.h>

enum {
    KBFS_TPM_OK = 0,
    KBFS_TPM_BAD_AUTH = 1,       /* wrong authValue (TPM_RC_AUTH_FAIL / TPM_RC_BAD_AUTH) */
    KBFS_TPM_LOCKOUT = 2,        /* the TPM is in DA lockout (TPM_RC_LOCKOUT) */
    KBFS_TPM_NOT_THIS_TPM = 3,   /* the blobs fail the integrity check under this TPM's primary */
    KBFS_TPM_UNREACHABLE = 4,    /* the TCTI could not be loaded/connect, or the TPM stopped answering */
    KBFS_TPM_ERROR = 5,          /* anything else (bad arguments, buffer too small, TPM errors) */
    KBFS_TPM_NV_MISSING = 6,     /* the NV index is not defined */
    KBFS_TPM_STALE = 7,          /* this sealed object's epoch has passed (NV counter > its bound) */
    KBFS_TPM_PCR_CHANGED = 8     /* the PCRs the object is bound to no longer hold their sealed values */
};

/* Buffer sizes that always suffice for kbfs_tpm_seal's outputs (real blobs are far smaller). */
#define KBFS_TPM_PUB_MAX 1024
#define KBFS_TPM_PRIV_MAX 2048
/* Limits on the inputs. */
#define KBFS_TPM_SECRET_MAX 64
#define KBFS_TPM_AUTH_MAX 32
/* Buffer size that always suffices for kbfs_tpm_primary_name (a SHA-256 name is 34 bytes). */
#define KBFS_TPM_NAME_MAX 128
/* Where kbfs_tpm_nv_define_counter picks its NV index. */
#define KBFS_TPM_NV_FIRST 0x01C90000u
#define KBFS_TPM_NV_LAST 0x01C9FFFFu

typedef struct kbfs_tpm kbfs_tpm; /* opaque: TCTI + ESYS context + the primary's handle */

/* The TPM's dictionary-attack state: failed tries now, tries allowed, seconds per forgiven
   try, seconds before lockoutAuth may be retried, whether the TPM is locked out now, and
   TPMA_PERMANENT lockoutAuthSet (a lockoutAuth was set; swtpm clears it when set back to empty). */
typedef struct { uint32_t counter, max_tries, interval, recovery; int in_lockout; int lockout_auth_set; } kbfs_tpm_da;

/* Sets TSS2_LOG=all+NONE (unless TSS2_LOG is already set) so tpm2-tss prints nothing on stderr
   for expected failures; call once early, before threads start (it uses setenv). */
void kbfs_tpm_quiet_logs(void);

/* Connects through the TCTI string (NULL = tctildr default, e.g. "device:/dev/tpmrm0" or
   "swtpm:host=127.0.0.1,port=2321"; its module name, the part before the first ':', must be
   exactly device, swtpm, mssim or tabrmd, else KBFS_TPM_ERROR) and creates the storage primary
   (owner hierarchy, empty owner auth) from a fixed template: ECC NIST P-256, AES-128-CFB,
   restricted|decrypt|fixedTPM|fixedParent|sensitiveDataOrigin|userWithAuth|noDA; the same TPM
   always yields the same key. */
int kbfs_tpm_open(const char *tcti, kbfs_tpm **out, char *err, size_t errlen);
/* Flushes the primary, finalizes ESYS and the TCTI, frees t (NULL is fine). */
void kbfs_tpm_close(kbfs_tpm *t);
/* Writes the storage primary's TPM name (nameAlg || SHA-256 of its public area; a function of
   the owner seed, so of this TPM until TPM2_Clear) into out (capacity *out_len in, length out),
   so a caller can pin the TPM and refuse another one before sending any authorization. */
int kbfs_tpm_primary_name(kbfs_tpm *t, uint8_t *out, size_t *out_len, char *err, size_t errlen);

/* Seals secret (1..64 bytes) in a KEYEDHASH object under the primary with authValue auth
   (1..32 bytes), attributes fixedTPM|fixedParent|userWithAuth (DA-protected), through a salted
   session with command parameter encryption; writes the marshalled TPM2B_PUBLIC / TPM2B_PRIVATE
   into pub / priv (capacities in *pub_len / *priv_len, lengths out). */
int kbfs_tpm_seal(kbfs_tpm *t, const uint8_t *secret, size_t secret_len, const uint8_t *auth, size_t auth_len,
                  uint8_t *pub, size_t *pub_len, uint8_t *priv, size_t *priv_len, char *err, size_t errlen);
/* Loads the blobs under the primary (integrity failure: NOT_THIS_TPM) and unseals with auth
   through a salted session with response parameter encryption; writes the secret into out
   (capacity *out_len in, length out). BAD_AUTH on a wrong auth (one more DA failure),
   LOCKOUT while the TPM is locked out. The loaded object and the session are always flushed. */
int kbfs_tpm_unseal(kbfs_tpm *t, const uint8_t *pub, size_t pub_len, const uint8_t *priv, size_t priv_len,
                    const uint8_t *auth, size_t auth_len, uint8_t *out, size_t *out_len, char *err, size_t errlen);

/* Like kbfs_tpm_seal, but bound to the epoch counter at epoch_index (a counter made by
   kbfs_tpm_nv_define_counter, authValue nv_auth): the object has userWithAuth clear and
   authPolicy = PolicyAuthValue then PolicyNV(counter <= bound, unsigned, 8 bytes at offset 0),
   so it unseals only with auth AND while the counter is at most bound. The digest comes from a
   trial policy session (PolicyNV there checks nv_auth, so a wrong nv_auth fails here).
   With pcr_mask (bit i = PCR i, 0..23) not 0, the policy ends with PolicyPCR over the SHA-256
   bank's selected PCRs at their values now: the object then unseals only while they hold them. */
int kbfs_tpm_seal_epoch(kbfs_tpm *t, const uint8_t *secret, size_t secret_len, const uint8_t *auth, size_t auth_len,
                        uint32_t epoch_index, const uint8_t *nv_auth, size_t nv_auth_len, uint64_t bound,
                        uint32_t pcr_mask, uint8_t *pub, size_t *pub_len, uint8_t *priv, size_t *priv_len, char *err,
                        size_t errlen);
/* Unseals a kbfs_tpm_seal_epoch object: loads it (NOT_THIS_TPM on integrity failure), runs
   PolicyAuthValue and PolicyNV in a salted policy session (PolicyNV authorized by nv_auth in a
   salted HMAC session), then Unseal with response encryption. STALE when the counter is above
   bound (checked before the authValue: no DA failure), BAD_AUTH on a wrong auth (one more DA
   failure), LOCKOUT while locked out, NV_MISSING when the index is gone; a wrong nv_auth, an
   index that is not our kind of counter, or a bound other than the sealed one give ERROR.
   pcr_mask must be the one it was sealed with: PCR_CHANGED when those PCRs changed since (the
   policy fails before the authValue counts: no DA failure). */
int kbfs_tpm_unseal_epoch(kbfs_tpm *t, const uint8_t *pub, size_t pub_len, const uint8_t *priv, size_t priv_len,
                          const uint8_t *auth, size_t auth_len, uint32_t epoch_index, const uint8_t *nv_auth,
                          size_t nv_auth_len, uint64_t bound, uint32_t pcr_mask, uint8_t *out, size_t *out_len,
                          char *err, size_t errlen);

/* Reads TPM_PT_LOCKOUT_COUNTER, _MAX_AUTH_FAIL, _LOCKOUT_INTERVAL, _LOCKOUT_RECOVERY and
   TPM_PT_PERMANENT's inLockout and lockoutAuthSet through TPM2_GetCapability. */
int kbfs_tpm_da_info(kbfs_tpm *t, kbfs_tpm_da *out, char *err, size_t errlen);

/* Defines a TPM_NT_COUNTER NV index (owner hierarchy, empty owner auth; AUTHWRITE|AUTHREAD|
   NO_DA, authValue auth of 1..32 bytes) at a random free index in KBFS_TPM_NV_FIRST..LAST,
   increments it once so it is readable, and returns the index. */
int kbfs_tpm_nv_define_counter(kbfs_tpm *t, const uint8_t *auth, size_t auth_len, uint32_t *index_out, char *err, size_t errlen);
/* Increments the counter at index by one (NV_MISSING when the index is not defined; ERROR when
   it is not a TPM_NT_COUNTER with AUTHREAD|AUTHWRITE|NO_DA and 8 bytes, as define_counter makes). */
int kbfs_tpm_nv_increment(kbfs_tpm *t, uint32_t index, const uint8_t *auth, size_t auth_len, char *err, size_t errlen);
/* Reads the counter at index into *value (NV_MISSING when the index is not defined; ERROR when
   it is not a counter as kbfs_tpm_nv_define_counter makes them, like kbfs_tpm_nv_increment). */
int kbfs_tpm_nv_read_counter(kbfs_tpm *t, uint32_t index, const uint8_t *auth, size_t auth_len, uint64_t *value, char *err, size_t errlen);
/* Undefines the NV index with the owner's (empty) auth (NV_MISSING when it is not defined). */
int kbfs_tpm_nv_undefine(kbfs_tpm *t, uint32_t index, char *err, size_t errlen);

/* Sets the lockout hierarchy's authValue to new_auth (0..32 bytes; 0: empty), authorized by
   old_auth (0..32 bytes; 0: empty), through a salted HMAC session with command parameter
   encryption (new_auth never crosses the bus in the clear). BAD_AUTH when old_auth is wrong
   (the TPM then refuses the lockout authorization for its lockoutRecovery time: LOCKOUT). */
int kbfs_tpm_lockout_change_auth(kbfs_tpm *t, const uint8_t *old_auth, size_t old_len, const uint8_t *new_auth,
                                 size_t new_len, char *err, size_t errlen);
/* TPM2_DictionaryAttackLockReset (the DA counter back to 0, lockout over), authorized by the
   lockout authValue auth (0..32 bytes) in a salted HMAC session. BAD_AUTH and LOCKOUT as above. */
int kbfs_tpm_lockout_reset(kbfs_tpm *t, const uint8_t *auth, size_t auth_len, char *err, size_t errlen);

#endif
