#ifndef KBFS_LOGIND_H
#define KBFS_LOGIND_H
#include <stdint.h>
#include <sys/types.h>

/// A connection to the system bus watching systemd-logind's signals (sd-bus).
typedef struct kbfs_logind kbfs_logind;

/// What logind said.
typedef enum {
    KBFS_LOGIND_NONE = 0,
    /// Manager.PrepareForSleep; `flag` 1 before sleep, 0 after resume.
    KBFS_LOGIND_PREPARE_FOR_SLEEP = 1,
    /// Session.Lock on `session`.
    KBFS_LOGIND_SESSION_LOCK = 2,
    /// Session.Unlock on `session`.
    KBFS_LOGIND_SESSION_UNLOCK = 3,
    /// A session's LockedHint property changed; `flag` its new value.
    KBFS_LOGIND_LOCKED_HINT = 4,
} kbfs_logind_kind;

/// One signal from logind.
typedef struct {
    kbfs_logind_kind kind;
    int flag;
    /// Session object path (empty for PrepareForSleep).
    char session[256];
} kbfs_logind_event;

/// Opens the system bus (or `address`, when not NULL) and subscribes to logind's
/// signals; 0 or -errno.
int kbfs_logind_open(const char *address, kbfs_logind **out);
/// Closes the connection (inhibitor descriptors stay with the caller).
void kbfs_logind_close(kbfs_logind *l);
/// Takes a `delay` inhibitor on `what` ("sleep"); the descriptor, or -errno.
int kbfs_logind_inhibit(kbfs_logind *l, const char *what, const char *who, const char *why);
/// Waits up to `timeout_usec` for the next signal sent by logind itself (signals from
/// any other sender are dropped and counted); 1 with `ev` filled, 0 on timeout, -errno.
int kbfs_logind_next(kbfs_logind *l, uint64_t timeout_usec, kbfs_logind_event *ev);
/// Signals dropped because logind did not send them.
uint64_t kbfs_logind_forged(const kbfs_logind *l);
/// The uid owning a session, and its LockedHint; 0 or -errno.
int kbfs_logind_session(kbfs_logind *l, const char *session, uid_t *uid, int *locked_hint);
/// Sends one line to the journal's native socket at `priority` (syslog level) when stdout
/// is the journal's stream (JOURNAL_STREAM names it), so its timestamp is the kernel's
/// receive time like every other native message, not the time journald gets to read a
/// stream. Returns 0 when sent, -1 when stdout is not the journal (the caller writes it).
int kbfs_journal_line(int priority, const char *line);

#endif
