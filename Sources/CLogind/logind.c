// The follower's view of systemd-logind, through sd-bus (libsystemd): sleep inhibitors,
// PrepareForSleep, Session.Lock/Unlock and LockedHint. Every signal is checked against
// the unique bus name that owns org.freedesktop.login1, so a process that sends a signal
// of the same shape (broadcast or straight to us) is ignored.
#include "kbfs_logind.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <systemd/sd-bus.h>
#include <systemd/sd-journal.h>

#define LOGIND "org.freedesktop.login1"
#define QUEUE 64

struct kbfs_logind {
    sd_bus *bus;
    char owner[256];          // unique name of logind, e.g. ":1.3"
    kbfs_logind_event queue[QUEUE];
    int head, count;
    uint64_t forged;
};

/// Asks the bus who owns org.freedesktop.login1 now.
static int refresh_owner(kbfs_logind *l) {
    sd_bus_error err = SD_BUS_ERROR_NULL;
    sd_bus_message *reply = NULL;
    const char *name = NULL;
    int r = sd_bus_call_method(l->bus, "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                               "GetNameOwner", &err, &reply, "s", LOGIND);
    if (r >= 0) r = sd_bus_message_read(reply, "s", &name);
    if (r >= 0) { strncpy(l->owner, name, sizeof l->owner - 1); l->owner[sizeof l->owner - 1] = 0; }
    sd_bus_message_unref(reply);
    sd_bus_error_free(&err);
    return r < 0 ? r : 0;
}

/// Whether `m` comes from logind (asking again once: logind may have restarted).
static int from_logind(kbfs_logind *l, sd_bus_message *m) {
    const char *sender = sd_bus_message_get_sender(m);
    if (!sender) return 0;
    // logind only broadcasts; a signal addressed to us is forged, and is dropped before
    // it can cost a GetNameOwner round trip.
    if (sd_bus_message_get_destination(m)) { l->forged++; return 0; }
    if (strcmp(sender, l->owner) == 0) return 1;
    if (refresh_owner(l) == 0 && strcmp(sender, l->owner) == 0) return 1;
    l->forged++;
    return 0;
}

static void push(kbfs_logind *l, kbfs_logind_kind kind, int flag, const char *session) {
    if (l->count == QUEUE) return;   // a flood of signals: the newest are dropped, the state is re-read anyway
    kbfs_logind_event *ev = &l->queue[(l->head + l->count) % QUEUE];
    ev->kind = kind;
    ev->flag = flag;
    ev->session[0] = 0;
    if (session) { strncpy(ev->session, session, sizeof ev->session - 1); ev->session[sizeof ev->session - 1] = 0; }
    l->count++;
}

static int on_prepare_for_sleep(sd_bus_message *m, void *userdata, sd_bus_error *e) {
    (void)e;
    kbfs_logind *l = userdata;
    int start = 0;
    if (!from_logind(l, m) || sd_bus_message_read(m, "b", &start) < 0) return 0;
    push(l, KBFS_LOGIND_PREPARE_FOR_SLEEP, start, NULL);
    return 0;
}

static int on_session_signal(sd_bus_message *m, void *userdata, sd_bus_error *e) {
    (void)e;
    kbfs_logind *l = userdata;
    if (!from_logind(l, m)) return 0;
    const char *member = sd_bus_message_get_member(m);
    kbfs_logind_kind kind = member && strcmp(member, "Lock") == 0 ? KBFS_LOGIND_SESSION_LOCK : KBFS_LOGIND_SESSION_UNLOCK;
    push(l, kind, 0, sd_bus_message_get_path(m));
    return 0;
}

/// PropertiesChanged of a session: reads the changed dictionary for LockedHint.
static int on_properties_changed(sd_bus_message *m, void *userdata, sd_bus_error *e) {
    (void)e;
    kbfs_logind *l = userdata;
    const char *iface = NULL;
    if (!from_logind(l, m) || sd_bus_message_read(m, "s", &iface) < 0) return 0;
    if (strcmp(iface, LOGIND ".Session") != 0) return 0;
    if (sd_bus_message_enter_container(m, 'a', "{sv}") < 0) return 0;
    while (sd_bus_message_enter_container(m, 'e', "sv") > 0) {
        const char *name = NULL;
        if (sd_bus_message_read(m, "s", &name) < 0) return 0;
        if (strcmp(name, "LockedHint") == 0) {
            int v = 0;
            if (sd_bus_message_read(m, "v", "b", &v) >= 0) push(l, KBFS_LOGIND_LOCKED_HINT, v, sd_bus_message_get_path(m));
        } else if (sd_bus_message_skip(m, "v") < 0) {
            return 0;
        }
        if (sd_bus_message_exit_container(m) < 0) return 0;
    }
    return 0;
}

int kbfs_logind_open(const char *address, kbfs_logind **out) {
    kbfs_logind *l = calloc(1, sizeof *l);
    if (!l) return -ENOMEM;
    int r;
    if (address) {
        r = sd_bus_new(&l->bus);
        if (r >= 0) r = sd_bus_set_address(l->bus, address);
        if (r >= 0) r = sd_bus_set_bus_client(l->bus, 1);
        if (r >= 0) r = sd_bus_start(l->bus);
    } else {
        r = sd_bus_open_system(&l->bus);
    }
    if (r >= 0) r = refresh_owner(l);
    if (r >= 0) r = sd_bus_match_signal(l->bus, NULL, LOGIND, "/org/freedesktop/login1", LOGIND ".Manager", "PrepareForSleep", on_prepare_for_sleep, l);
    if (r >= 0) r = sd_bus_match_signal(l->bus, NULL, LOGIND, NULL, LOGIND ".Session", "Lock", on_session_signal, l);
    if (r >= 0) r = sd_bus_match_signal(l->bus, NULL, LOGIND, NULL, LOGIND ".Session", "Unlock", on_session_signal, l);
    if (r >= 0) r = sd_bus_match_signal(l->bus, NULL, LOGIND, NULL, "org.freedesktop.DBus.Properties", "PropertiesChanged", on_properties_changed, l);
    if (r < 0) { kbfs_logind_close(l); return r; }
    *out = l;
    return 0;
}

void kbfs_logind_close(kbfs_logind *l) {
    if (!l) return;
    sd_bus_flush_close_unref(l->bus);
    free(l);
}

int kbfs_logind_inhibit(kbfs_logind *l, const char *what, const char *who, const char *why) {
    sd_bus_error err = SD_BUS_ERROR_NULL;
    sd_bus_message *reply = NULL;
    int fd = -1;
    int r = sd_bus_call_method(l->bus, LOGIND, "/org/freedesktop/login1", LOGIND ".Manager", "Inhibit", &err, &reply,
                               "ssss", what, who, why, "delay");
    if (r >= 0) r = sd_bus_message_read(reply, "h", &fd);
    if (r >= 0) { fd = fcntl(fd, F_DUPFD_CLOEXEC, 3); if (fd < 0) r = -errno; }   // the reply owns its descriptor
    sd_bus_message_unref(reply);
    sd_bus_error_free(&err);
    return r < 0 ? r : fd;
}

int kbfs_logind_next(kbfs_logind *l, uint64_t timeout_usec, kbfs_logind_event *ev) {
    for (;;) {
        if (l->count > 0) {
            *ev = l->queue[l->head];
            l->head = (l->head + 1) % QUEUE;
            l->count--;
            return 1;
        }
        int r = sd_bus_process(l->bus, NULL);
        if (r < 0) return r;
        if (r > 0) continue;
        r = sd_bus_wait(l->bus, timeout_usec);
        if (r < 0) return r;
        if (r == 0) return 0;
    }
}

uint64_t kbfs_logind_forged(const kbfs_logind *l) { return l->forged; }

int kbfs_logind_session(kbfs_logind *l, const char *session, uid_t *uid, int *locked_hint) {
    sd_bus_error err = SD_BUS_ERROR_NULL;
    sd_bus_message *reply = NULL;
    uint32_t u = 0;
    const char *path = NULL;
    int r = sd_bus_get_property(l->bus, LOGIND, session, LOGIND ".Session", "User", &err, &reply, "(uo)");
    if (r >= 0) r = sd_bus_message_read(reply, "(uo)", &u, &path);
    sd_bus_message_unref(reply);
    sd_bus_error_free(&err);
    if (r < 0) return r;
    int hint = 0;
    r = sd_bus_get_property_trivial(l->bus, LOGIND, session, LOGIND ".Session", "LockedHint", &err, 'b', &hint);
    sd_bus_error_free(&err);
    if (r < 0) return r;
    *uid = u;
    *locked_hint = hint;
    return 0;
}

int kbfs_journal_line(int priority, const char *line) {
    const char *e = getenv("JOURNAL_STREAM");
    unsigned long long dev = 0, ino = 0;
    struct stat st;
    if (!e || sscanf(e, "%llu:%llu", &dev, &ino) != 2) return -1;
    if (fstat(STDOUT_FILENO, &st) != 0 || st.st_dev != (dev_t)dev || st.st_ino != (ino_t)ino) return -1;
    return sd_journal_print(priority, "%s", line) == 0 ? 0 : -1;
}
