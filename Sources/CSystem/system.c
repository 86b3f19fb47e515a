#define _GNU_SOURCE
#include "csystem.h"
#include <fcntl.h>
#include <malloc.h>
#include <stdio.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/fanotify.h>
#include <sys/ioctl.h>
#include <linux/fs.h>
#include <linux/openat2.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/syscall.h>
#include <unistd.h>

const int kbfs_O_PATH = O_PATH;
const int kbfs_AT_EMPTY_PATH = AT_EMPTY_PATH;
const int kbfs_O_TMPFILE = O_TMPFILE;
const long kbfs_UTIME_NOW = UTIME_NOW;
const long kbfs_UTIME_OMIT = UTIME_OMIT;
const unsigned int kbfs_RENAME_NOREPLACE = RENAME_NOREPLACE;
const unsigned int kbfs_RENAME_EXCHANGE = RENAME_EXCHANGE;
const unsigned int kbfs_RENAME_WHITEOUT = RENAME_WHITEOUT;

const int kbfs_HANDLE_BUFFER = (int)(sizeof(struct file_handle) + MAX_HANDLE_SZ);

int kbfs_handle_of(int fd, unsigned char *out, int outsize) {
    struct file_handle *fh = (struct file_handle *)(void *)out;
    int mount_id;
    if (outsize < kbfs_HANDLE_BUFFER) return -1;
    fh->handle_bytes = MAX_HANDLE_SZ;
    if (name_to_handle_at(fd, "", fh, &mount_id, AT_EMPTY_PATH) != 0) return -1;
    return (int)(sizeof(struct file_handle) + fh->handle_bytes);
}

int kbfs_handle_at(int dirfd, const char *name, unsigned char *out, int outsize) {
    struct file_handle *fh = (struct file_handle *)(void *)out;
    int mount_id;
    if (outsize < kbfs_HANDLE_BUFFER) return -1;
    fh->handle_bytes = MAX_HANDLE_SZ;
    if (name_to_handle_at(dirfd, name, fh, &mount_id, 0) != 0) return -1;
    return (int)(sizeof(struct file_handle) + fh->handle_bytes);
}

int kbfs_open_handle(int mountfd, const unsigned char *handle, int flags) {
    return open_by_handle_at(mountfd, (struct file_handle *)(void *)handle, flags);
}

int kbfs_fallocate(int fd, int mode, long long offset, long long len) {
    return fallocate(fd, mode, (off_t)offset, (off_t)len);
}

int kbfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags) {
    return (int)syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags);
}

int kbfs_peercred(int fd, unsigned int *uid, unsigned int *gid, int *pid) {
    struct ucred c;
    socklen_t len = sizeof(c);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0) return -1;
    *uid = c.uid; *gid = c.gid; *pid = c.pid;
    return 0;
}

int kbfs_set_nondumpable(void) { return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); }

long kbfs_raise_nofile(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
    return (long)rl.rlim_cur;
}

int kbfs_limit_malloc_arenas(int n) { return mallopt(M_ARENA_MAX, n); }

int kbfs_fix_malloc_thresholds(int mmap_threshold, int trim_threshold) {
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) && mallopt(M_TRIM_THRESHOLD, trim_threshold);
}

int kbfs_malloc_trim(void) { return malloc_trim(0); }

int kbfs_name_this_thread(const char *name) { return prctl(PR_SET_NAME, (unsigned long)name, 0, 0, 0); }

static __thread int kbfs_kills_setid = -1;

void kbfs_set_request_kills_setid(int on) { kbfs_kills_setid = on; }

int kbfs_request_kills_setid(void) { return kbfs_kills_setid; }

int kbfs_reserve(int fd, long long offset, long long len) {
    return fallocate(fd, FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)len);
}

long long kbfs_next_hole(int fd, long long from) { return (long long)lseek(fd, (off_t)from, SEEK_HOLE); }

int kbfs_reports_holes(int fd) {
    struct statfs s;
    if (fstatfs(fd, &s) != 0) return 0;
    return s.f_type == 0x01021994 /* tmpfs */ || s.f_type == 0xEF53 /* ext2/3/4 */ ||
           s.f_type == 0x58465342 /* XFS */;
}

int kbfs_syncfs(int fd) { return syncfs(fd); }

int kbfs_write_and_wait(int fd, long long offset, long long len) {
    return sync_file_range(fd, offset, len,
                           SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
}

int kbfs_mount_device(const char *path, unsigned int *major, unsigned int *minor) {
    struct statx stx;
    /* AT_STATX_DONT_SYNC: FUSE answers from the inode it has, without a GETATTR request
       (which would wait for INIT); the device number is the superblock's. */
    if (statx(AT_FDCWD, path, AT_STATX_DONT_SYNC | AT_SYMLINK_NOFOLLOW, 0, &stx) != 0) return -1;
    *major = stx.stx_dev_major;
    *minor = stx.stx_dev_minor;
    return 0;
}

const unsigned long long kbfs_FAN_CREATE = FAN_CREATE, kbfs_FAN_DELETE = FAN_DELETE,
    kbfs_FAN_MOVED_FROM = FAN_MOVED_FROM, kbfs_FAN_MOVED_TO = FAN_MOVED_TO, kbfs_FAN_CLOSE_WRITE = FAN_CLOSE_WRITE,
    kbfs_FAN_ATTRIB = FAN_ATTRIB, kbfs_FAN_ONDIR = FAN_ONDIR, kbfs_FAN_Q_OVERFLOW = FAN_Q_OVERFLOW;

int kbfs_fanotify_open(int unlimited) {
    unsigned int flags = FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_REPORT_DFID_NAME;
    if (unlimited) flags |= FAN_UNLIMITED_QUEUE | FAN_UNLIMITED_MARKS;
    return fanotify_init(flags, O_RDONLY | O_CLOEXEC);
}

int kbfs_fanotify_watch(int fanfd, int dirfd) {
    uint64_t mask = FAN_CREATE | FAN_DELETE | FAN_MOVED_FROM | FAN_MOVED_TO | FAN_CLOSE_WRITE | FAN_ATTRIB |
                    FAN_ONDIR | FAN_EVENT_ON_CHILD;
    return fanotify_mark(fanfd, FAN_MARK_ADD, mask, dirfd, NULL);
}

int kbfs_fanotify_next(const unsigned char *buf, long len, long *offset, struct kbfs_fan_event *ev) {
    long at = *offset;
    struct fanotify_event_metadata meta;
    if (at >= len) return 0;
    if (len - at < (long)sizeof(meta)) return -1;
    memcpy(&meta, buf + at, sizeof(meta));
    if (meta.event_len < sizeof(meta) || (long)meta.event_len > len - at || meta.vers != FANOTIFY_METADATA_VERSION)
        return -1;
    ev->mask = meta.mask;
    ev->pid = meta.pid;
    ev->handle = NULL;
    ev->handle_len = 0;
    ev->name = NULL;
    long info = at + meta.metadata_len, end = at + meta.event_len;
    while (info + (long)sizeof(struct fanotify_event_info_header) <= end) {
        struct fanotify_event_info_header hdr;
        memcpy(&hdr, buf + info, sizeof(hdr));
        if (hdr.len < sizeof(hdr) || (long)hdr.len > end - info) return -1;
        if (hdr.info_type == FAN_EVENT_INFO_TYPE_DFID_NAME || hdr.info_type == FAN_EVENT_INFO_TYPE_DFID) {
            long fh = info + (long)offsetof(struct fanotify_event_info_fid, handle);
            struct file_handle h;
            if (fh + (long)sizeof(h) > info + hdr.len) return -1;
            memcpy(&h, buf + fh, sizeof(h));
            long hlen = (long)sizeof(h) + (long)h.handle_bytes;
            if (h.handle_bytes > MAX_HANDLE_SZ || fh + hlen > info + hdr.len) return -1;
            ev->handle = buf + fh;
            ev->handle_len = (int)hlen;
            if (hdr.info_type == FAN_EVENT_INFO_TYPE_DFID_NAME) {
                const char *name = (const char *)(buf + fh + hlen);
                long room = info + hdr.len - (fh + hlen);
                if (room <= 0 || memchr(name, 0, (size_t)room) == NULL) return -1;
                ev->name = name;
            }
        }
        info += hdr.len;
    }
    *offset = end;
    return 1;
}

int kbfs_open_beneath(int dirfd, const char *path) {
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = O_PATH | O_CLOEXEC | O_NOFOLLOW;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
    return (int)syscall(SYS_openat2, dirfd, path, &how, sizeof how);
}

unsigned long long kbfs_inode_stamp(int fd) {
    int generation = 0;
    if (ioctl(fd, FS_IOC_GETVERSION, &generation) == 0 && generation != 0)
        return (unsigned long long)(unsigned int)generation;
    struct statx stx;
    if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_BTIME, &stx) == 0 && (stx.stx_mask & STATX_BTIME))
        return (1ULL << 63) | ((unsigned long long)stx.stx_btime.tv_sec * 1000000000ULL + stx.stx_btime.tv_nsec);
    return 0;
}

#if defined(__x86_64__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static unsigned int crc32c_sse42(unsigned int crc, const unsigned char *p, unsigned long n) {
    unsigned long long c = ~crc & 0xffffffffu;
    for (; n >= 8; p += 8, n -= 8) {
        unsigned long long v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    unsigned int c32 = (unsigned int)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}
#endif

unsigned int kbfs_crc32c(unsigned int crc, const void *data, unsigned long n) {
    const unsigned char *p = data;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2")) return crc32c_sse42(crc, p, n);
#endif
    unsigned int c = ~crc;
    while (n--) {
        c ^= *p++;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    }
    return ~c;
}
