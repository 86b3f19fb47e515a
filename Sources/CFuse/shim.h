#ifndef KEYBAGFS_CFUSE_SHIM_H
#define KEYBAGFS_CFUSE_SHIM_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>
#include <sys/xattr.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <linux/fs.h>

/* Macros Swift does not import, re-exported as constants. */
static const long kbfs_UTIME_NOW = UTIME_NOW;
static const long kbfs_UTIME_OMIT = UTIME_OMIT;
static const int kbfs_RENAME_NOREPLACE = RENAME_NOREPLACE;
static const int kbfs_RENAME_EXCHANGE = RENAME_EXCHANGE;
static const int kbfs_XATTR_CREATE = XATTR_CREATE;
static const int kbfs_XATTR_REPLACE = XATTR_REPLACE;
static const int kbfs_O_PATH = O_PATH;
static const int kbfs_AT_EMPTY_PATH = AT_EMPTY_PATH;

/* renameat2(2) by syscall number. */
static inline int kbfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags) {
    return (int)syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags);
}

/* The peer's credentials of a Unix socket (SO_PEERCRED); 0 on success. */
static inline int kbfs_peercred(int fd, unsigned int *uid, unsigned int *gid, int *pid) {
    struct ucred c;
    socklen_t len = sizeof(c);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0) return -1;
    *uid = c.uid; *gid = c.gid; *pid = c.pid;
    return 0;
}
/* Keeps core dumps and ptrace of the daemon's memory out (PR_SET_DUMPABLE 0). */
static inline int kbfs_set_nondumpable(void) { return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); }

/* Raises the soft open-files limit to the hard limit; returns the new soft limit. */
static inline long kbfs_raise_nofile(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    return (long)rl.rlim_cur;
}

#endif
