#ifndef KEYBAGFS_CSYSTEM_H
#define KEYBAGFS_CSYSTEM_H
/* Linux calls and constants that need _GNU_SOURCE, compiled in system.c so that the
   Swift-visible header stays free of feature macros. */

#include <sys/xattr.h>

extern const int kbfs_O_PATH;
extern const int kbfs_AT_EMPTY_PATH;
extern const int kbfs_O_TMPFILE;
extern const long kbfs_UTIME_NOW;
extern const long kbfs_UTIME_OMIT;
extern const unsigned int kbfs_RENAME_NOREPLACE;
extern const unsigned int kbfs_RENAME_EXCHANGE;
extern const unsigned int kbfs_RENAME_WHITEOUT;

/* Bytes a file handle buffer needs. */
extern const int kbfs_HANDLE_BUFFER;
/* name_to_handle_at(fd, "", AT_EMPTY_PATH) into `out`; returns the handle's length or -1. */
int kbfs_handle_of(int fd, unsigned char *out, int outsize);
/* name_to_handle_at(dirfd, name, 0) (a final symlink is not followed); length or -1. */
int kbfs_handle_at(int dirfd, const char *name, unsigned char *out, int outsize);
/* open_by_handle_at(mountfd, handle, flags). */
int kbfs_open_handle(int mountfd, const unsigned char *handle, int flags);
/* fallocate(2). */
int kbfs_fallocate(int fd, int mode, long long offset, long long len);
/* renameat2(2). */
int kbfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);
/* The peer's credentials of a Unix socket (SO_PEERCRED); 0 on success. */
int kbfs_peercred(int fd, unsigned int *uid, unsigned int *gid, int *pid);
/* PR_SET_DUMPABLE 0: no core dumps, no ptrace by other users. */
int kbfs_set_nondumpable(void);
/* mallopt(M_ARENA_MAX, n): fewer malloc arenas for many threads. */
int kbfs_limit_malloc_arenas(int n);
/* Fixed mmap and trim thresholds (stops glibc raising the mmap threshold after big frees). */
int kbfs_fix_malloc_thresholds(int mmap_threshold, int trim_threshold);
/* PR_SET_NAME: names the calling thread (15 bytes are kept) for ps -L, top -H, perf, gdb. */
int kbfs_name_this_thread(const char *name);
/* malloc_trim(0): returns free heap pages to the kernel. */
int kbfs_malloc_trim(void);
/* Raises the soft open-files limit to the hard one; returns it, or -1. */
long kbfs_raise_nofile(void);
/* This thread's note of the kernel's word on the FUSE request it is handling: 1 when the
   request asks the server to clear the set-user-ID / set-group-ID bits, 0 when it says they
   stay, -1 when the request carries no such word (FUSE_HANDLE_KILLPRIV_V2: WRITE, SETATTR,
   OPEN and CREATE do, once INIT agreed to it); set when the request is read. */
void kbfs_set_request_kills_setid(int on);
int kbfs_request_kills_setid(void);

/* Reserves [offset, offset+len) of fd without changing its size (fallocate with
   FALLOC_FL_KEEP_SIZE); 0 or -1 with errno. */
int kbfs_reserve(int fd, long long offset, long long len);
/* Offset of the first hole of fd's file at or after `from` (its size when there is none),
   or -1 with errno. */
long long kbfs_next_hole(int fd, long long from);
/* Whether the file system of fd reports holes exactly to SEEK_HOLE and keeps an
   overwritten block in place (tmpfs, ext2/3/4, XFS): 1, else 0. */
int kbfs_reports_holes(int fd);
/* syncfs(2): commits the filesystem holding fd. */
int kbfs_syncfs(int fd);
/* sync_file_range(2) with WAIT_BEFORE | WRITE | WAIT_AFTER: the range's dirty pages are written
   to the device and waited for (no cache flush, no metadata). */
int kbfs_write_and_wait(int fd, long long offset, long long len);

/* The device number of the filesystem mounted at `path` (statx with AT_STATX_DONT_SYNC:
   no request reaches a FUSE daemon that has not answered INIT yet). 0 or -1 with errno. */
int kbfs_mount_device(const char *path, unsigned int *major, unsigned int *minor);

/* fanotify for the store watcher (see StoreWatcher.swift). */
/* Mask bits of an event. */
extern const unsigned long long kbfs_FAN_CREATE, kbfs_FAN_DELETE, kbfs_FAN_MOVED_FROM, kbfs_FAN_MOVED_TO,
    kbfs_FAN_CLOSE_WRITE, kbfs_FAN_ATTRIB, kbfs_FAN_ONDIR, kbfs_FAN_Q_OVERFLOW;
/* A notification group reporting each event's directory (file handle) and entry name;
   `unlimited` asks for an unbounded queue and number of marks (CAP_SYS_ADMIN). fd or -1. */
int kbfs_fanotify_open(int unlimited);
/* Watches the entries of directory `dirfd`: created, deleted, moved, closed after writing,
   attributes changed (files and subdirectories). 0 or -1 with errno. */
int kbfs_fanotify_watch(int fanfd, int dirfd);
/* One event parsed out of a buffer read from a fanotify descriptor. */
struct kbfs_fan_event {
    unsigned long long mask;
    int pid;
    /* The directory's file handle (struct file_handle bytes), or NULL; and its length. */
    const unsigned char *handle;
    int handle_len;
    /* The entry's name (NUL-terminated, inside the buffer), or NULL. */
    const char *name;
};
/* Parses the event at `*offset` of `buf` (`len` bytes) into `ev` and moves `*offset` past it:
   1 when an event was parsed, 0 at the end, -1 when the buffer is malformed. */
int kbfs_fanotify_next(const unsigned char *buf, long len, long *offset, struct kbfs_fan_event *ev);
/* Opens `path` (relative) below directory `dirfd` with O_PATH, never leaving it and never
   following a symlink or a magic link, never crossing a mount (openat2 with RESOLVE_BENEATH |
   RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV): fd or -1 with errno (ELOOP
   for a symlink, EXDEV for an escape or a mount). */
int kbfs_open_beneath(int dirfd, const char *path);
/* A stamp of which file an inode is, stable for the inode's life and new when its number is
   reused: the file system's inode generation (FS_IOC_GETVERSION: ext4, XFS, btrfs), else its
   birth time in nanoseconds (statx), else 0 when the file system offers neither. */
unsigned long long kbfs_inode_stamp(int fd);
/* CRC32C (Castagnoli, as jbd2 and iSCSI) of `n` bytes continuing from `crc` (0 to start):
   the SSE4.2 instruction where the CPU has it, else bit by bit. A checksum against torn and
   stale writes, not a MAC. */
unsigned int kbfs_crc32c(unsigned int crc, const void *p, unsigned long n);
#endif
